"""The CUDA side of the paths merged after the last GPU check: one optimizer step for
fit and Fleet (fp16's scaler and the device-path non-finite guard through
``OptimizerStep``), Fleet's optimizer wrapper with the ``-true`` precisions and the
input casting of the mixed ones, compile caches kept with the run (Triton's too), crash
forensics on NCCL (the file-backed ring, faulthandler's file, the flight recorder), and
the kernel counters sampled beside NVML. Each checks the outcome on the GPU. Skipped
without CUDA (tests/conftest.py); run by the GPU check's ``new_paths`` stage."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import gpufleet
from conftest import _env
from gpufleet.fault import crash_forensics
from gpufleet.fault.fatal import fatal_file, ring_file
from gpufleet.fleet.wrappers import FleetOptimizer
from gpufleet.monitor.system import read_system
from gpufleet.train.checkpoint.format import load_checkpoint
from gpufleet.train.engine.step import OptimizerStep

from .helpers import tiny_gpt

pytestmark = pytest.mark.gpu


def test_fp16_fit_skips_an_inf_gradient_step_through_the_engine_and_backs_off(
        fit_cuda, monkeypatch):
    """An inf loss at one step of an fp16-mixed fit: the engine's step is told to skip
    exactly once, the weights stay finite, and the scaler's scale halves once."""
    decisions: list[bool] = []
    plain = OptimizerStep.step_or_skip

    def spy(self, optimizer, precision, skip, *args, **kwargs):
        decisions.append(bool(skip))
        return plain(self, optimizer, precision, skip, *args, **kwargs)

    monkeypatch.setattr(OptimizerStep, "step_or_skip", spy)
    guards = _spy_guards(monkeypatch)
    loss_fn = _inf_at_call(7)

    result, cap = fit_cuda({"precision.mode": "fp16-mixed", "precision.init_scale": 1024.0,
                            "run.max_steps": 20, "checkpoint.save_final": True},
                           loss_fn=loss_fn)
    assert guards and guards[0].on_device is False  # fp16: the scaler decides on the host
    assert result.skipped_steps == 1 and decisions.count(True) == 1, decisions
    assert len(decisions) == 20 and decisions[6] is True, decisions
    scaler = cap.trainer.precision.scaler
    assert scaler.get_scale() == 512.0  # one backoff, no growth in 20 steps
    model = cap.trainer.strategy.unwrap(cap.trainer.model)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    saved = load_checkpoint(result.checkpoint)
    assert saved["precision"]["scaler"]["scale"] == 512.0, saved.get("precision")


def _spy_guards(monkeypatch) -> list:
    """The non-finite guards the engine's step asks (through ``OptimizerStep.decide``)."""
    guards: list = []
    plain = OptimizerStep.decide

    def spy(self, model, optimizer, guard, *args, **kwargs):
        guards.append(guard)
        return plain(self, model, optimizer, guard, *args, **kwargs)

    monkeypatch.setattr(OptimizerStep, "decide", spy)
    return guards


def _inf_at_call(bad: int):
    """A GPT loss whose ``bad``-th call (1-based; one call a step) is inf."""
    calls = {"n": 0}

    def loss_fn(logits, y):
        calls["n"] += 1
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        return loss * float("inf") if calls["n"] == bad else loss

    return loss_fn


def test_the_device_path_guard_skips_an_inf_step_inside_the_fused_optimizer(
        fit_cuda, monkeypatch):
    """bf16-mixed with fused AdamW on cuda: the guard hands the optimizer its flag (no
    host decision: ``decide`` says False every step), the optimizer skips the inf step
    by itself (the weights after it equal those before it) and the skip is counted."""
    guards = _spy_guards(monkeypatch)
    model = tiny_gpt()
    weight = model.lm_head.weight
    after: dict[int, torch.Tensor] = {}

    class Keep(gpufleet.Callback):
        def on_step_end(self, trainer, step):
            after[step] = weight.detach().clone()

    result, cap = fit_cuda({"precision.mode": "bf16-mixed", "run.max_steps": 12,
                            "log.every": 4}, model=model, loss_fn=_inf_at_call(7),
                           callbacks=[Keep()])
    assert guards and all(g is guards[0] for g in guards) and guards[0].on_device is True
    assert cap.trainer.optimizer.defaults.get("fused") is True
    assert result.skipped_steps == 1
    assert torch.equal(after[7], after[6])  # the skipped step left the weights as they were
    assert not torch.equal(after[8], after[7])  # the next one trained
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 1))


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 32, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=32)


@pytest.mark.parametrize("precision,dtype", [("bf16-true", torch.bfloat16),
                                             ("16-true", torch.float16)])
def test_fleet_true_precision_on_cuda_matches_the_plain_loop_in_that_dtype(
        tmp_path, precision, dtype):
    """Under a ``-true`` precision the model and the forward's inputs are in the dtype
    on cuda; the wrapper is Fleet's (a subclass of the user's class, the user's object
    unpatched); the losses are those of the plain loop in that dtype."""
    fleet = gpufleet.Fleet(accelerator="cuda", devices=1, precision=precision,
                           run_dir=str(tmp_path / "run"), log_every=4)
    net = _net()
    user_opt = torch.optim.SGD(net.parameters(), lr=0.01)
    model, opt = fleet.setup(net, user_opt)
    assert isinstance(opt, FleetOptimizer) and isinstance(opt, torch.optim.SGD)
    assert opt.optimizer is user_opt and "step" not in vars(user_opt)  # no patching
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert next(model.parameters()).device.type == "cuda"
    seen: list[torch.dtype] = []
    net[0].register_forward_pre_hook(lambda _m, args: seen.append(args[0].dtype))
    losses = []
    for x, y in fleet.setup_dataloaders(_loader()):
        out = model(x)
        loss = F.mse_loss(out.float(), y)
        fleet.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    fleet.finish()
    assert set(seen) == {dtype}

    plain = _net().cuda().to(dtype)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.01)
    expected = []
    for x, y in _loader():
        loss = F.mse_loss(plain(x.cuda().to(dtype)).float(), y.cuda())
        loss.backward()
        plain_opt.step()
        plain_opt.zero_grad()
        expected.append(loss.item())
    assert losses == pytest.approx(expected, rel=1e-2, abs=1e-3)


@pytest.mark.parametrize("precision,dtype", [("bf16-mixed", torch.bfloat16),
                                             ("16-mixed", torch.float16)])
def test_fleet_mixed_precision_casts_inputs_to_the_autocast_dtype_on_cuda(
        tmp_path, precision, dtype):
    """Under a mixed precision the weights stay fp32 and the forward's floating inputs
    arrive in the autocast dtype; the loop's steps go through Fleet's wrapper and the
    model learns."""
    fleet = gpufleet.Fleet(accelerator="cuda", devices=1, precision=precision,
                           run_dir=str(tmp_path / "run"))
    net = _net()
    model, opt = fleet.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    seen: list[torch.dtype] = []
    net[0].register_forward_pre_hook(lambda _m, args: seen.append(args[0].dtype))
    losses = []
    for _ in range(3):
        for x, y in fleet.setup_dataloaders(_loader()):
            loss = F.mse_loss(model(x).float(), y)
            fleet.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    fleet.finish()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert set(seen) == {dtype}
    assert losses[-1] < 0.5 * losses[0], losses


# One process of a compiled run on cuda: trains (or resumes) and prints the cache counters.
CHILD = textwrap.dedent("""
    import json, sys
    import torch
    from torch._dynamo.utils import counters
    from torch.nn import functional as F
    import gpufleet, toyjob

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))
    run_dir, steps, resume = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    over = {"perf.compile": True, "run.dir": run_dir, "run.max_steps": steps,
            "run.device": "cuda", "precision.mode": "fp32", "checkpoint.every": 1,
            "log.progress": "off", "data.batch_size": 32, "data.num_workers": 0,
            "run.eval_every": 0, "monitor.diagnose": False}
    if resume:
        over["checkpoint.resume"] = "latest"
    torch.manual_seed(0)
    gpufleet.fit(Net(), toyjob.make_data(), loss_fn=F.mse_loss, overrides=over)
    print(json.dumps({"hit": counters["inductor"]["fxgraph_cache_hit"],
                      "miss": counters["inductor"]["fxgraph_cache_miss"]}))
""")


def _compiled_run(tmp_path, steps: int, resume: bool) -> dict:
    env = _env()
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        env.pop(name, None)
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "run"), str(steps),
                          "1" if resume else "0"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_compile_on_cuda_keeps_triton_and_inductor_caches_in_the_run(tmp_path):
    """perf.compile on cuda: Triton's kernels and inductor's FX graphs land under
    RUN_DIR/compile-cache/<host>/, and a restarted run hits the FX graph cache."""
    first = _compiled_run(tmp_path, 2, resume=False)
    assert first["miss"] >= 1 and first["hit"] == 0, first
    folder = tmp_path / "run" / "compile-cache" / socket.gethostname()
    triton = [p for p in (folder / "triton").rglob("*") if p.is_file()]
    assert triton, f"no Triton artefacts under {folder / 'triton'}"
    assert any(p.suffix in (".cubin", ".json", ".ptx") for p in triton), triton[:10]
    assert any((folder / "fxgraph").rglob("*")), "no FX graph kept in the run"
    again = _compiled_run(tmp_path, 3, resume=True)
    assert again["hit"] >= first["miss"] and again["miss"] == 0, (first, again)


# One rank of an NCCL group of one: its forensics on, two all-reduces recorded, the
# flight recorder read, then the rank aborts inside a third collective.
NCCL_CHILD = textwrap.dedent("""
    import json, os, pickle, sys
    import torch
    import torch.distributed as dist
    from gpufleet.core.ring import RING
    from gpufleet.fault.fatal import FatalDump
    from gpufleet.fault.flight_recorder import report_note
    from gpufleet.fault.ncclenv import apply_nccl_defaults

    run_dir = sys.argv[1]
    apply_nccl_defaults(run_dir)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    FatalDump(run_dir, 0).start()
    x = torch.ones(1024, device="cuda")
    for _ in range(2):
        n = RING.enter("all_reduce", x.numel() * 4)
        dist.all_reduce(x)
        RING.leave(n)
    torch.cuda.synchronize()
    c10d = torch._C._distributed_c10d  # NCCL's recorder (the generic one: gloo's)
    trace = pickle.loads(getattr(c10d, "_dump_nccl_trace", c10d._dump_fr_trace)())
    names = [e.get("profiling_name", "") for e in trace.get("entries", [])]
    print(json.dumps({"sum": x[0].item(), "recorded": names,
                      "note": report_note("nccl", [0])}), flush=True)
    RING.enter("all_reduce", 4)
    os.abort()
""")


def test_an_nccl_rank_that_aborts_leaves_its_ring_and_stacks(tmp_path):
    """A 1-rank NCCL group: the flight recorder (on by gpufleet's NCCL defaults) holds
    the all-reduces; after an abort inside the next collective the ring file names it
    and faulthandler's file names the line."""
    run_dir = tmp_path / "run"
    env = _env()
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    for name in ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
                 "TORCH_FR_DUMP_TEMP_FILE"):
        env.pop(name, None)
    script = tmp_path / "nccl_rank.py"
    script.write_text(NCCL_CHILD)
    done = subprocess.run([sys.executable, str(script), str(run_dir)], env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == -6, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["sum"] == 1.0  # a group of one: the sum is the rank's own
    assert seen["recorded"].count("nccl:all_reduce") >= 2, seen["recorded"]
    assert "NCCL flight recorder" in seen["note"], seen["note"]
    assert fatal_file(run_dir, 0).is_file() and ring_file(run_dir, 0).is_file()
    ranks = crash_forensics.read_folder(run_dir / "crash")
    ring = ranks[0].ring
    assert (ring["seq"], ring["done"]) == (3, 2), ring
    assert ring["entries"][-1]["op"] == "all_reduce" and ring["entries"][-1]["bytes"] == 4
    assert ranks[0].at == f"nccl_rank.py:{_abort_line()} in <module>", ranks[0].at


def _abort_line() -> int:
    return next(i for i, line in enumerate(NCCL_CHILD.splitlines(), 1)
                if line.startswith("os.abort()"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_cuda_run_samples_kernel_counters_beside_nvml(fit_cuda):
    """The system sampler of a cuda fit writes, in the same samples, NVML's view of the
    GPU and the kernel's counters of the rank."""
    result, _ = fit_cuda({"monitor.system_interval_s": 0.2, "run.max_steps": 60})
    samples = read_system(result.run_dir)
    both = [s for s in samples if s.get("gpus") and s.get("kernel")]
    assert both, samples[:2]
    last = both[-1]
    assert max(g["mem_used_mb"] for g in last["gpus"]) > 0
    counters = last["kernel"]["0"]
    assert counters["own_cpu_s"] > 0 and "cores_busy_s" in counters, counters

