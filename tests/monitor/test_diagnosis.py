"""The diagnosis the user sees, for runs built to be slow in one known way (CPU)."""

from __future__ import annotations

import json

import pytest

from gpufleet.monitor.diagnose import RunFacts, Summary, diagnose, findings_for_run

from .accounted import assert_accounted

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
    # It cites the part of the step accounting it rests on.
    assert "Step accounting: data wait" in finding["message"]
    assert "ms measured step" in finding["message"]
    cited = finding["measurements"]["accounting"]
    assert cited["data"] > 0.5 * cited["step"] > 0
    assert "[warn] input-bound:" in proc.stdout  # the summary printed at the end


@pytest.mark.slow  # the default run names a backward straggler by arrival (below, and
# under fsdp in test_arrival_rules.py) and a data straggler from measured-looking numbers
def test_a_sleeping_rank_is_named_the_straggler(run_cli, tmp_path):
    # Rank 1 takes 2 ms per item (32 ms per batch of 16); rank 0 reads at full speed.
    proc = run_cli("train", *TOY, "--data", "toyjob:make_slow_data",
                   "--data.kwargs={delay = 0.002, rank = 1}", "--nproc", "2",
                   "--batch-size", "16", "--max-steps", "20", "--run-dir", "runs/strag")
    assert "rank 1 is the straggler (input-bound)" in proc.stderr + proc.stdout
    finding = _rules(tmp_path / "runs" / "strag")["straggler"]
    assert finding["message"].startswith("rank 1 spends")
    assert "they wait for it in the gradient all-reduce" in finding["message"]


@pytest.mark.parametrize("where", [
    "backward", pytest.param("optimizer step", marks=pytest.mark.slow)])
def test_a_rank_with_extra_work_after_forward_is_the_straggler_not_communication(
        run_cli, tmp_path, where):
    # Rank 1's backward (or optimizer step) sleeps 15 ms more per step on one node: DDP's
    # all-reduce makes every rank's backward as long, yet it is no link's fault.
    factory = {"backward": "make_model_slow_backward",
               "optimizer step": "make_model_slow_optimizer"}[where]
    run_cli("train", *TOY, "--model", f"toyjob:{factory}", "--data", "toyjob:make_data",
            "--nproc", "2", "--batch-size", "16", "--max-steps", "20", "--run-dir", "runs/s")
    rules = _rules(tmp_path / "runs" / "s")
    assert "communication-bound" not in rules
    f = rules["straggler"]
    assert f["title"] == f"rank 1 is the straggler ({where})"
    assert f["measurements"]["rank"] == 1 and f["confidence"] in ("high", "medium")
    assert f["message"].startswith("rank 1 spends")
    # The step accounting of both ranks: the parts add up to the step clock within 5%
    # in every interval after the first (start-up), rank 0's wait for rank 1 is its own
    # part, and the finding cites it.
    assert_accounted(tmp_path / "runs" / "s", world=2)
    assert f["measurements"]["accounting"]["rank"] == 0
    assert "waiting for late ranks" in f["message"]


def test_a_tiny_model_and_batch_is_host_bound(run_cli, tmp_path):
    proc = run_cli("train", *TOY, "--data", "toyjob:make_data", "--batch-size", "2",
                   "--max-steps", "40", "--run-dir", "runs/tiny")
    seen = proc.stderr + proc.stdout
    assert "host-bound:" in seen and "raise data.batch_size from 2" in seen
    assert "of a plain matmul on this CPU" in _rules(tmp_path / "runs" / "tiny")[
        "host-bound"]["message"]
    assert findings_for_run(tmp_path / "runs" / "tiny")[0].rule in ("host-bound",)
    # The expected step says how far it is from this CPU's measured rates (an info
    # after the warning), naming the part furthest from it with its figures.
    recorded = json.loads((tmp_path / "runs" / "tiny" / "diagnosis.json").read_text())
    f = _rules(tmp_path / "runs" / "tiny")["headroom"]
    assert f["severity"] == "info" and f["measurements"]["part"] in (
        "data", "forward", "backward", "optimizer", "host")
    assert "of this CPU's measured fp32 matmul rate" in f["message"]
    (got,) = recorded["expected_step"]
    assert got["host_share"] is not None and got["work"]["ops"]["forward"] > 0
    assert "<h3>Expected step</h3>" in (tmp_path / "runs" / "tiny" / "report.html").read_text()


# -- the rules on measured-looking numbers (the GPU-only ones cannot be built here) ------
def _summary(*rows, step=0.02, tflops=None, mem=None):
    keys = ("data", "forward", "backward", "optimizer", "other")
    return Summary(steps=100, step_s=step, tflops=tflops, mem_peak_gb=mem,
                   rank_phases=[{"rank": r, **dict(zip(keys, row))}
                                for r, row in enumerate(rows)])


def _arrival(*waits, gc=(), grad_bytes=4e6):
    return [{"rank": r, "wait": w, "gc": gc[r] if gc else 0.0, "grad_bytes": grad_bytes}
            for r, w in enumerate(waits)]


def test_communication_bound_on_one_node_only_when_the_all_reduce_is_measured_slow():
    facts = RunFacts(world=2, local_world=2, cores=2, strategy="ddp", comm_hooks=True,
                     grad_accum=1, bucket_cap_mb=25)
    s = _summary((0.001, 0.002, 0.014, 0.002, 0.001), (0.001, 0.002, 0.014, 0.002, 0.001))
    # Backward three times the forward, nothing measured: no link to blame on one node.
    assert diagnose(s, facts) == []
    # Both ranks arrive together and still wait 10 ms for the all-reduce: measured.
    s.rank_arrival = _arrival(0.010, 0.0101)
    (f,) = diagnose(s, facts)
    assert f.rule == "communication-bound" and "waits 10.0 ms of each 20.0 ms step" in f.message
    assert "optim.grad_accum from 1 to 2" in f.fix and "bucket_cap_mb from 25 to 50" in f.fix
    # Nothing to measure the all-reduce against on one node: said, but unsure.
    assert (f.severity, f.confidence) == ("info", "low") and f.measurements["comm_s"] == 0.010
    # One node, no link measured slow: no compression, no cross-node advice.
    assert "powersgd" not in f.fix and "local_sgd" not in f.fix and "node" not in f.fix


def test_a_backward_straggler_is_named_by_its_arrival_not_as_communication():
    # The issue's case: rank 1's backward does 12 ms of extra work; DDP's all-reduce
    # makes rank 0's backward as long (it waits 12.5 ms at its end, rank 1 0.5 ms).
    facts = RunFacts(world=2, local_world=2, cores=2, strategy="ddp", comm_hooks=True)
    s = _summary((0.001, 0.002, 0.0165, 0.001, 0.0005), (0.001, 0.002, 0.0165, 0.001, 0.0005),
                 step=0.021)
    s.rank_arrival = _arrival(0.0125, 0.0005)
    (f,) = diagnose(s, facts)
    assert (f.rule, f.title) == ("straggler", "rank 1 is the straggler (backward)")
    assert f.measurements["rank"] == 1 and f.measurements["phase"] == "backward"
    assert "Its extra 12.0 ms goes to backward" in f.message and f.confidence == "high"


def test_an_optimizer_straggler_and_gc_pauses_are_named_with_their_phase():
    facts = RunFacts(world=3, local_world=3, cores=3, strategy="ddp")
    # Rank 2's optimizer step takes 8 ms more: the others wait for it in the next backward.
    rows = [(0.001, 0.003, 0.014, 0.001, 0.001)] * 2 + [(0.001, 0.003, 0.006, 0.009, 0.001)]
    s = _summary(*rows)
    s.rank_arrival = _arrival(0.0085, 0.0085, 0.0005)
    (f,) = diagnose(s, facts)
    assert f.title == "rank 2 is the straggler (optimizer step)"
    assert "goes to the optimizer step" in f.message
    # Rank 0's forward holds 6 ms of GC pauses: named as GC, not as forward.
    rows = [(0.001, 0.009, 0.006, 0.001, 0.001)] + [(0.001, 0.003, 0.012, 0.001, 0.001)] * 2
    s = _summary(*rows, step=0.018)
    s.rank_arrival = _arrival(0.0005, 0.0065, 0.0065, gc=(0.006, 0.0, 0.0))
    (f,) = diagnose(s, facts)
    assert f.title == "rank 0 is the straggler (GC pauses)" and "gc.freeze()" in f.fix


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


def test_fp32_with_tf32_on_is_not_told_to_turn_tf32_on():
    facts = RunFacts(device="cuda", device_name="NVIDIA H100", precision="fp32",
                     tensor_cores=True, tf32=True)
    (f,) = [f for f in diagnose(_summary((0.0, 0.005, 0.01, 0.004, 0.001)), facts)
            if f.rule == "fp32-on-tensor-cores"]
    assert "tf32" not in f.fix and "bf16-mixed" in f.fix and "TF32" in f.title
    off = RunFacts(device="cuda", device_name="NVIDIA H100", precision="fp32",
                   tensor_cores=True)
    (g,) = [f for f in diagnose(_summary((0.0, 0.005, 0.01, 0.004, 0.001)), off)
            if f.rule == "fp32-on-tensor-cores"]
    assert "perf.tf32=true" in g.fix


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
