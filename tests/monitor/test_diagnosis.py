"""The diagnosis the user sees, for runs built to be slow in one known way (CPU)."""

from __future__ import annotations

import json

import pytest

from gpufleet.monitor.diagnose import RunFacts, Summary, diagnose, findings_for_run

TOY = ["--model", "toyjob:make_model", "--model.loss", "torch.nn.functional:mse_loss",
       "--log.every", "5", "--optim.warmup_steps", "2", "--data.num_workers", "0",
       "--log.progress", "lines", "--run.eval_every", "0"]


def _rules(run_dir) -> dict[str, dict]:
    return {f["rule"]: f for f in json.loads((run_dir / "diagnosis.json").read_text())[
        "findings"]}


def test_a_slow_dataset_is_input_bound_with_a_num_workers_suggestion(run_cli, tmp_path):
    # 8 items of 3 ms each per batch: ~24 ms of loading against well under 1 ms of compute.
    proc = run_cli("train", *TOY, "--data", "toyjob:make_slow_data",
                   "--data.kwargs={delay = 0.003}", "--batch-size", "8", "--max-steps", "20",
                   "--run-dir", "runs/slow")
    seen = proc.stderr + proc.stdout
    assert "diagnosis at step 10: input-bound:" in seen
    assert "waits for the next batch, with data.num_workers = 0" in seen
    assert "raise data.num_workers from 0 to 2" in seen  # capped by this 2-core machine
    finding = _rules(tmp_path / "runs" / "slow")["input-bound"]
    assert finding["fix"].startswith("raise data.num_workers from 0 to")
    assert "[warn] input-bound:" in proc.stdout  # the summary printed at the end


def test_a_sleeping_rank_is_named_the_straggler(run_cli, tmp_path):
    # Rank 1 takes 2 ms per item (32 ms per batch of 16); rank 0 reads at full speed.
    proc = run_cli("train", *TOY, "--data", "toyjob:make_slow_data",
                   "--data.kwargs={delay = 0.002, rank = 1}", "--nproc", "2",
                   "--batch-size", "16", "--max-steps", "20", "--run-dir", "runs/strag")
    assert "rank 1 is the straggler (input-bound)" in proc.stderr + proc.stdout
    finding = _rules(tmp_path / "runs" / "strag")["straggler"]
    assert finding["message"].startswith("rank 1 spends")
    assert "they wait for it in the gradient all-reduce" in finding["message"]


def test_a_tiny_model_and_batch_is_host_bound(run_cli, tmp_path):
    proc = run_cli("train", *TOY, "--data", "toyjob:make_data", "--batch-size", "2",
                   "--max-steps", "40", "--run-dir", "runs/tiny")
    seen = proc.stderr + proc.stdout
    assert "host-bound:" in seen and "raise data.batch_size from 2" in seen
    assert "of a plain matmul on this CPU" in _rules(tmp_path / "runs" / "tiny")[
        "host-bound"]["message"]
    assert findings_for_run(tmp_path / "runs" / "tiny")[0].rule in ("host-bound",)


# -- the rules on measured-looking numbers (the GPU-only ones cannot be built here) ------
def _summary(*rows, step=0.02, tflops=None, mem=None):
    keys = ("data", "forward", "backward", "optimizer", "other")
    return Summary(steps=100, step_s=step, tflops=tflops, mem_peak_gb=mem,
                   rank_phases=[{"rank": r, **dict(zip(keys, row))}
                                for r, row in enumerate(rows)])


def test_communication_bound_when_backward_is_mostly_waiting():
    facts = RunFacts(world=2, local_world=2, cores=2, strategy="ddp", comm_hooks=True,
                     grad_accum=1, bucket_cap_mb=25)
    s = _summary((0.001, 0.002, 0.014, 0.002, 0.001), (0.001, 0.002, 0.014, 0.002, 0.001))
    (f,) = diagnose(s, facts)
    assert f.rule == "communication-bound" and "10.0 ms of each 20.0 ms step" in f.message
    assert "optim.grad_accum from 1 to 2" in f.fix and "bucket_cap_mb from 25 to 50" in f.fix
    assert "parallel.ddp.comm_hook=powersgd" in f.fix and "local_sgd" in f.fix
    assert "Find the node" not in f.fix  # one node: no link to single out


def test_communication_bound_across_nodes_points_at_finding_the_slow_node():
    facts = RunFacts(world=4, local_world=2, cores=2, strategy="fsdp", grad_accum=2,
                     bucket_cap_mb=25)
    s = _summary(*[(0.001, 0.002, 0.014, 0.002, 0.001)] * 4)
    (f,) = diagnose(s, facts)
    assert f.rule == "communication-bound" and "optim.grad_accum from 2 to 4" in f.fix
    assert "comm_hook" not in f.fix  # the hooks are ddp's alone
    assert "Find the node behind the slowest link with `gpufleet bench allreduce`" in f.fix


@pytest.mark.parametrize(("precision", "expect"), [("fp32", True), ("bf16-mixed", False)])
def test_fp32_on_a_tensor_core_gpu_suggests_bf16(precision, expect):
    facts = RunFacts(device="cuda", device_name="NVIDIA H100", precision=precision,
                     tensor_cores=True)
    rules = {f.rule for f in diagnose(_summary((0.0, 0.005, 0.01, 0.004, 0.001)), facts)}
    assert ("fp32-on-tensor-cores" in rules) is expect


def test_memory_headroom_and_dp_imbalance():
    facts = RunFacts(device="cuda", strategy="dp", copies_module_each_step=True,
                     mem_total_gb=80.0, batch_size=8)
    system = {"gpus": [{"util_pct": 95}, {"util_pct": 20}, {"util_pct": 25}]}
    found = {f.rule: f for f in diagnose(_summary((0.0, 0.005, 0.01, 0.004, 0.001),
                                                  mem=10.0), facts, system)}
    assert "10.0 of 80.0 GiB (12%)" in found["memory-headroom"].message
    assert "--nproc 3" in found["dp-imbalance"].fix


def test_host_syncs_name_the_users_lines():
    facts = RunFacts(device="cuda")
    (f,) = diagnose(_summary((0.0, 0.005, 0.01, 0.004, 0.001)), facts,
                    syncs=[("/home/me/model.py:42", 5)])
    assert f.rule == "host-syncs" and "/home/me/model.py:42 (5x)" in f.message


def test_balanced_runs_have_no_finding():
    facts = RunFacts(world=2, strategy="ddp", device_flops=1e12, device_flops_source="peak")
    s = _summary((0.0005, 0.006, 0.012, 0.001, 0.0005), (0.0005, 0.006, 0.012, 0.001, 0.0005),
                 tflops=0.5)
    assert diagnose(s, facts) == []
