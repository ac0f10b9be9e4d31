"""Fleet on one rank, in this process: Fabric-style arguments, setup, the phases a loop
marks by its calls, the non-finite guard on the device path, save/load, and the errors
a user can cause."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import gpufleet
from gpufleet.core.callbacks import Callback
from gpufleet.errors import CheckpointError, ConfigError
from gpufleet.fleet.args import fleet_overrides
from gpufleet.fleet.dtypes import ForwardDtypes
from gpufleet.fleet.wrappers import FleetModule


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))


def test_fabric_arguments_map_onto_the_config():
    assert fleet_overrides("gpu", 4, "bf16-mixed", "fsdp", num_nodes=2) == {
        "run.device": "cuda", "dist.nproc": 4, "precision.mode": "bf16-mixed",
        "parallel.strategy": "fsdp", "dist.nnodes": "2"}
    assert fleet_overrides(precision="16-mixed", cuda=True)["precision.mode"] == "fp16-mixed"
    # Fabric's 16-mixed on a CPU is bf16-mixed, as Fabric decides; gpufleet's name keeps fp16
    assert fleet_overrides(precision="16-mixed")["precision.mode"] == "bf16-mixed"
    assert fleet_overrides("cpu", precision=16, cuda=True)["precision.mode"] == "bf16-mixed"
    assert fleet_overrides("cpu", precision="fp16-mixed")["precision.mode"] == "fp16-mixed"
    with pytest.raises(ConfigError, match="gpufleet has no XLA strategy"):
        fleet_overrides(strategy="xla")
    with pytest.raises(ConfigError, match="Did you mean 'ddp'"):
        fleet_overrides(strategy="ddq")
    with pytest.raises(ConfigError, match="devices = 0"):
        fleet_overrides(devices=0)


class _Phases(Callback):
    def __init__(self) -> None:
        self.seen: list[str] = []

    def on_phase(self, view, phase) -> None:
        self.seen.append(str(phase))


def test_a_loop_marks_its_phases_by_its_calls(tmp_path):
    spy = _Phases()
    fleet = gpufleet.Fleet(accelerator="cpu", run_dir=str(tmp_path / "run"), log_every=2,
                           callbacks=[spy])
    net = _net()
    model, optimizer = fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert isinstance(model, FleetModule) and model.state_dict().keys() == \
        _net().state_dict().keys()  # no wrapper prefix
    loader = fleet.setup_dataloaders(DataLoader(_data(), batch_size=8))
    for x, y in loader:
        fleet.backward(F.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    with fleet.phase("eval"):
        pass
    assert spy.seen[:5] == ["data", "forward", "backward", "optimizer", "end"]
    assert spy.seen.count("end") == fleet.step == 4
    assert spy.seen[-1] == "eval"
    with pytest.raises(ConfigError, match="unknown value 'dta'"):
        fleet.phase("dta")
    fleet.finish()
    run = tmp_path / "run"
    assert {"diagnosis.json", "report.html", "metrics.jsonl"} <= {p.name for p in run.iterdir()}
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if r.get("kind") == "train"] == [2, 4]


def test_a_batch_read_before_the_model_is_set_up_begins_nothing(tmp_path):
    """A loop that reads a batch to size its model, then builds and sets it up, trains
    a whole epoch after it (the peek's pass ended, as a DataLoader's would)."""
    fleet = gpufleet.Fleet(accelerator="cpu", run_dir=str(tmp_path / "run"), log_every=2)
    loader = fleet.setup_dataloaders(DataLoader(_data(), batch_size=8, shuffle=True))
    x, y = next(iter(loader))
    torch.manual_seed(0)
    net = torch.nn.Linear(x.shape[1], y.shape[1])
    model, optimizer = fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    seen = 0
    for x, y in loader:
        fleet.backward(F.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        seen += len(x)
    fleet.finish()
    assert seen == 32 and fleet.step == 4
    logged = [json.loads(line) for line in
              (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if r.get("kind") == "train"] == [2, 4]


def test_the_optimizer_is_rebuilt_by_name_and_stays_an_optimizer(tmp_path):
    fleet = gpufleet.Fleet(accelerator="cpu", run_dir=str(tmp_path / "run"))
    net = _net()
    groups = [{"params": net[0].parameters(), "lr": 0.5}, {"params": net[2].parameters()}]
    model, optimizer = fleet.setup(net, torch.optim.SGD(groups, lr=0.1, momentum=0.9))
    assert isinstance(optimizer, torch.optim.SGD)
    assert [g["lr"] for g in optimizer.param_groups] == [0.5, 0.1]
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    fleet.backward(model(torch.ones(2, 4)).sum())
    optimizer.step()
    scheduler.step()  # no warning about the order: the step was seen
    assert [g["lr"] for g in optimizer.param_groups] == [0.25, 0.05]
    fleet.finish()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_nonfinite_step_is_skipped_on_the_device_path(tmp_path, device):
    """A fused optimizer takes the guard's flag: the skipped step changes nothing and
    is counted at the log interval, with the parameter named."""
    fleet = gpufleet.Fleet(accelerator=device, precision="32-true",
                           run_dir=str(tmp_path / "run"), log_every=3)
    net = _net()
    model, optimizer = fleet.setup(net, torch.optim.AdamW(net.parameters(), lr=0.1,
                                                          fused=True))
    x, y = torch.randn(4, 4, device=device), torch.randn(4, 1, device=device)
    weights = []
    for step in (1, 2, 3):
        loss = F.mse_loss(model(x), y)
        fleet.backward(loss * float("nan") if step == 2 else loss)
        optimizer.step()
        optimizer.zero_grad()
        weights.append({k: v.clone() for k, v in model.state_dict().items()})
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert not all(torch.equal(weights[1][k], weights[2][k]) for k in weights[0])
    assert fleet.run.nonfinite.on_device
    assert fleet.skipped_steps == 1 and fleet.skip_records[0].step == 2
    assert fleet.skip_records[0].first_bad_param == "0.weight"
    fleet.finish()


def test_save_and_load_restore_everything(tmp_path):
    fleet = gpufleet.Fleet(accelerator="cpu", run_dir=str(tmp_path / "run"))
    net = _net()
    model, optimizer = fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.1,
                                                        momentum=0.9))
    loader = fleet.setup_dataloaders(DataLoader(_data(), batch_size=8, shuffle=True))
    batches = iter(loader)
    x, y = next(batches)
    fleet.backward(F.mse_loss(model(x), y))
    optimizer.step()
    path = fleet.save(tmp_path / "ck.pt", {"model": model, "optimizer": optimizer,
                                           "loader": loader, "note": "hello"})
    assert (tmp_path / "ck.pt.sha256").is_file()
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]  # renamed in place
    draw = torch.rand(3)
    torch.load(path, weights_only=True)  # tensors and plain data only

    other = gpufleet.Fleet(accelerator="cpu", run_dir=str(tmp_path / "run2"))
    net2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    model2, optimizer2 = other.setup(net2, torch.optim.SGD(net2.parameters(), lr=0.1,
                                                           momentum=0.9))
    loader2 = other.setup_dataloaders(DataLoader(_data(), batch_size=8, shuffle=True))
    state = {"model": model2, "optimizer": optimizer2, "loader": loader2, "note": None}
    assert other.load(path, state) == {}
    assert state["note"] == "hello"
    assert torch.equal(torch.rand(3), draw)  # the RNG continues where it was saved
    for k, v in model.state_dict().items():
        assert torch.equal(model2.state_dict()[k], v)
    assert optimizer2.state_dict()["state"].keys() == optimizer.state_dict()["state"].keys()
    assert [b[0].tolist() for b in loader2] == [b[0].tolist() for b in batches]
    with pytest.raises(CheckpointError, match="holds no 'epoch'"):
        other.load(path, {"epoch": 0})
    (tmp_path / "ck.pt").write_bytes(b"damaged")
    with pytest.raises(CheckpointError):
        other.load(path, {})
    fleet.finish()
    other.finish()


def test_a_fleet_of_several_ranks_asks_for_launch(tmp_path, monkeypatch):
    fleet = gpufleet.Fleet(accelerator="cpu", devices=2, run_dir=str(tmp_path / "run"))
    assert fleet.world_size == 2 and fleet.run is None  # the ranks are not started yet
    with pytest.raises(ConfigError, match=r"fleet.launch\(fn\)"):
        fleet.setup(_net())
    monkeypatch.setattr(sys, "argv", ["-c"])  # no script to run again on each rank
    with pytest.raises(ConfigError, match=r"gpufleet run script.py --nproc N"):
        fleet.launch()  # Fabric's form, in a process with no script


def test_clip_gradients_clips_and_returns_the_norm(tmp_path):
    fleet = gpufleet.Fleet(accelerator="cpu", run_dir=str(tmp_path / "run"))
    net = _net()
    model, optimizer = fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    fleet.backward(model(torch.full((2, 4), 100.0)).sum())
    norm = fleet.clip_gradients(model, optimizer, max_norm=1.0)
    after = torch.linalg.vector_norm(torch.stack(
        [p.grad.norm() for p in model.parameters()]))
    assert float(norm) > 1.0 and float(after) == pytest.approx(1.0, rel=1e-4)
    with pytest.raises(ConfigError, match="max_norm"):
        fleet.clip_gradients(model, optimizer)
    # Fabric's order: the third argument is clip_val (it was max_norm: a port that
    # passed it by position clipped by norm instead of by value).
    fleet.backward(model(torch.full((2, 4), 100.0)).sum())
    assert fleet.clip_gradients(model, optimizer, 0.01) is None
    assert max(float(p.grad.abs().max()) for p in model.parameters()) == pytest.approx(0.01)
    fleet.finish()


def test_all_reduce_in_one_process_is_the_value(tmp_path):
    fleet = gpufleet.Fleet(accelerator="cpu", run_dir=str(tmp_path / "run"))
    assert fleet.all_reduce(3.0) == 3.0
    assert torch.equal(fleet.all_reduce(torch.ones(2), "sum"), torch.ones(2))
    assert fleet.all_reduce(3.0, "avg") == 3.0  # Fabric's name for the mean
    with pytest.raises(ConfigError, match="reduce_op"):
        fleet.all_reduce(1.0, "prod")
    fleet.finish()


def test_an_error_in_the_loop_leaves_a_crash_report(tmp_path):
    fleet = gpufleet.Fleet(accelerator="cpu", run_dir=str(tmp_path / "run"))

    def loop(fleet):
        net = _net()
        model, optimizer = fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        fleet.backward(model(torch.ones(2, 4)).sum())
        optimizer.step()
        raise RuntimeError("the loop broke")

    with pytest.raises(RuntimeError, match="the loop broke"):
        fleet.launch(loop)
    report = (tmp_path / "run" / "crash" / "rank-0.txt").read_text()
    assert "RuntimeError: the loop broke" in report and "step: 1" in report
    fleet.finish()


def test_mixed_precision_outputs_come_back_in_float32_as_fabric_returns_them(tmp_path):
    """Under bf16-mixed the forward runs in autocast and its outputs come back as
    float32, so a loss computed in the loop, outside the forward, sees one dtype (on
    CUDA, mse_loss's backward refuses a bf16 output beside an fp32 target). The losses
    equal those of the plain loop that puts its loss inside autocast."""
    fleet = gpufleet.Fleet(accelerator="cpu", precision="bf16-mixed",
                           run_dir=str(tmp_path / "run"))
    net = _net()
    model, optimizer = fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    plain = _net()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for x, y in DataLoader(_data(), batch_size=8):
        out = model(x)
        assert out.dtype == torch.float32
        loss = F.mse_loss(out, y)
        fleet.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            plain_loss = F.mse_loss(plain(x).float(), y)
        plain_loss.backward()
        plain_opt.step()
        plain_opt.zero_grad()
        assert loss.item() == pytest.approx(plain_loss.item(), rel=1e-6)
    # Outputs that are not an autocast dtype, and containers, keep their types.
    out = FleetModule(lambda x: {"n": x.long(), "h": (x.bfloat16(),)}, net, lambda p: None,
                      fleet.run.precision,
                      dtypes=ForwardDtypes.for_run("bf16-mixed", torch.bfloat16))(torch.ones(2))
    assert out["n"].dtype == torch.int64 and out["h"][0].dtype == torch.float32
    fleet.finish()


def test_fleet_keeps_fp32_by_default_on_a_gpu_with_bf16_as_fabric_does(tmp_path):
    """Fabric's default precision is 32-true: a loop moved to Fleet with the same
    arguments computes the same numbers on a bf16 GPU too; "auto" is your own loop's
    recipe, fp32 as well, and bf16 is asked for by name. With a config, what the
    arguments leave out stays the config's."""
    from gpufleet.config import load_config
    from gpufleet.fleet.args import FABRIC_DEFAULTS
    from gpufleet.resolve import Machine, resolve

    h100 = Machine(cuda=True, gpus=1, bf16=True)

    def mode(precision):
        cfg = load_config(overrides=fleet_overrides("cuda", 1, precision))
        return resolve(cfg, h100, world_size=1, own_loop=True).precision.mode

    assert mode(FABRIC_DEFAULTS["precision"]) == "fp32"
    assert mode("auto") == "fp32"
    assert mode("bf16-mixed") == "bf16-mixed"
    cfg = load_config(overrides={"precision.mode": "bf16-mixed", "run.device": "cpu"})
    fleet = gpufleet.Fleet(config=cfg, run_dir=str(tmp_path / "run"))
    assert fleet.plan.cfg.precision.mode == "bf16-mixed"  # the config's, kept
    fleet.finish()
    fleet = gpufleet.Fleet(precision="fp32", config=cfg, run_dir=str(tmp_path / "run2"))
    assert fleet.plan.cfg.precision.mode == "fp32"  # an argument given wins
    fleet.finish()


def test_float32_outputs_reach_into_every_container_without_changing_the_models():
    """Fabric's mixed precisions give every floating-point output back in the default
    dtype (float32; a float64 one too), other dtypes as they are."""
    import collections
    import dataclasses

    float32_outputs = ForwardDtypes.for_run("bf16-mixed", torch.bfloat16).convert_output

    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor
        steps: int = 1

    class Named(dict):
        pass

    pair = collections.namedtuple("Pair", "a b")
    half = torch.ones(2, dtype=torch.bfloat16)
    kept = {"cache": half}  # a dict the model keeps and returns
    out = float32_outputs([Out(half), Named(x=half), pair(half, 2), kept,
                           torch.ones(1, dtype=torch.float64), torch.ones(1, dtype=torch.int64)])
    assert out[0].logits.dtype == torch.float32 and out[0].steps == 1
    assert type(out[1]) is Named and out[1]["x"].dtype == torch.float32
    assert type(out[2]) is pair and out[2].a.dtype == torch.float32 and out[2].b == 2
    assert out[3]["cache"].dtype == torch.float32 and kept["cache"].dtype == torch.bfloat16
    assert [t.dtype for t in out[4:]] == [torch.float32, torch.int64]


@pytest.mark.parametrize(("fused", "precision"), [
    (True, "32-true"), (False, "32-true"), (False, "fp16-mixed")],
    ids=["device path", "host path", "fp16 loss scaler"])
def test_the_guard_judges_the_gradients_the_optimizer_steps_on(tmp_path, fused, precision):
    """A loop that clips and then does not step (it drops that batch), or runs backward
    again after a clip, has the guard look at the gradients of the step as stepped (and
    under fp16, the dropped batch's unscale does not count for the next one)."""
    fleet = gpufleet.Fleet(accelerator="cpu", run_dir=str(tmp_path / "run"), log_every=2,
                           precision=precision,  # fp16: a scale that does not overflow
                           overrides={"precision.init_scale": 1.0})
    net = _net()
    model, optimizer = fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.1,
                                                        fused=fused))
    x, y = torch.randn(4, 4), torch.randn(4, 1)

    def weights():
        return [p.detach().clone() for p in model.parameters()]

    fleet.backward(F.mse_loss(model(x), y) * float("nan"))
    fleet.clip_gradients(model, optimizer, max_norm=1.0)
    optimizer.zero_grad()  # the loop drops this batch: no step
    before = weights()
    fleet.backward(F.mse_loss(model(x), y))
    optimizer.step()  # finite gradients: stepped
    optimizer.zero_grad()
    assert not all(torch.equal(a, b) for a, b in zip(before, weights()))
    fleet.backward(F.mse_loss(model(x), y))
    fleet.clip_gradients(model, optimizer, max_norm=1.0)
    fleet.backward(F.mse_loss(model(x), y) * float("nan"))  # more gradient after the clip
    before = weights()
    optimizer.step()  # not finite: skipped
    optimizer.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(before, weights()))
    fleet.finish()
    assert fleet.skipped_steps == 1 and [r.step for r in fleet.skip_records] == [2]


def test_fabric_helpers_on_one_rank(tmp_path):
    """all_gather, broadcast, autocast, to_device and log_dict as a Fabric loop calls
    them, on one rank: what a one-rank job gathers, and rank 0's logged values in
    metrics.jsonl."""
    fleet = gpufleet.Fleet(accelerator="cpu", precision="bf16-mixed",
                           run_dir=str(tmp_path / "run"), log_every=2)
    gathered = fleet.all_gather({"x": torch.tensor([1.0, 2.0]), "n": [3, 4.5]})
    assert torch.equal(gathered["x"], torch.tensor([[1.0, 2.0]]))
    assert [t.tolist() for t in gathered["n"]] == [[3], [4.5]]
    with pytest.raises(ConfigError, match="all_gather got str"):
        fleet.all_gather("text")
    assert fleet.broadcast({"path": "a"}) == {"path": "a"}
    with fleet.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    assert fleet.to_device([torch.ones(1)])[0].device.type == "cpu"
    with fleet.rank_zero_first():
        pass
    fleet.log("lr_seen", 0.5)  # before the first step
    net = _net()
    model, optimizer = fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for _ in range(2):
        fleet.backward(F.mse_loss(model(torch.ones(2, 4)), torch.zeros(2, 1)))
        optimizer.step()
        optimizer.zero_grad()
    fleet.log_dict({"acc": torch.tensor(0.75), "count": 3, "f32": np.float32(0.5)}, step=7)
    with pytest.raises(ConfigError, match="'bad' is str"):
        fleet.log_dict({"bad": "x"})
    fleet.finish()
    with pytest.raises(ConfigError, match=r"after fleet\.finish"):
        fleet.log("late", 1.0)
    lines = [json.loads(line) for line in
             (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    user = [{k: v for k, v in r.items() if k != "time"} for r in lines
            if r["kind"] == "user"]
    assert user == [{"kind": "user", "step": 0, "lr_seen": 0.5},
                    {"kind": "user", "step": 7, "acc": 0.75, "count": 3.0, "f32": 0.5}]
    assert [r["step"] for r in lines if r["kind"] == "train"] == [2]


def test_setup_optimizers_takes_an_optimizer_built_after_setup_module(tmp_path):
    fleet = gpufleet.Fleet(accelerator="cpu", run_dir=str(tmp_path / "run"))
    model = fleet.setup_module(_net())
    optimizer = fleet.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    fleet.backward(F.mse_loss(model(torch.ones(2, 4)), torch.zeros(2, 1)))
    optimizer.step()
    assert fleet.step == 1 and fleet.run.nonfinite is not None
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    stranger = torch.nn.Linear(2, 2)  # Fabric wraps any optimizer, and so does Fleet
    theirs = torch.optim.SGD(stranger.parameters(), lr=0.1)
    assert fleet.setup_optimizers(theirs).optimizer is theirs
    fleet.finish()


def test_a_loop_that_only_evaluates_keeps_what_it_logged(tmp_path):
    fleet = gpufleet.Fleet(accelerator="cpu", run_dir=str(tmp_path / "run"))
    model = fleet.setup(_net())
    with torch.no_grad():
        fleet.log("val_loss", F.mse_loss(model(torch.ones(2, 4)), torch.zeros(2, 1)))
    fleet.finish()
    (line,) = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(line)["kind"] == "user" and "val_loss" in json.loads(line)


def test_a_gan_loop_clips_both_optimizers_under_fp16(tmp_path):
    """Two optimizers, each clipped, then stepped: each is unscaled once between its
    steps, whatever the order of the calls."""
    fleet = gpufleet.Fleet(accelerator="cpu", precision="fp16-mixed",  # (fp16 on a CPU)
                           run_dir=str(tmp_path / "run"))
    gen, disc = _net(), torch.nn.Linear(1, 1)
    gen, opt_g = fleet.setup(gen, torch.optim.SGD(gen.parameters(), lr=0.1))
    disc, opt_d = fleet.setup(disc, torch.optim.SGD(disc.parameters(), lr=0.1))
    for _ in range(2):
        fake = gen(torch.ones(2, 4))
        fleet.backward(disc(fake).mean())  # the generator's loss
        fleet.clip_gradients(gen, opt_g, max_norm=1.0)
        opt_d.zero_grad()
        fleet.backward(F.mse_loss(disc(fake.detach()), torch.zeros(2, 1)))
        fleet.clip_gradients(disc, opt_d, max_norm=1.0)
        opt_g.step()
        opt_d.step()
        opt_g.zero_grad()
        opt_d.zero_grad()
    assert fleet.step == 2 and fleet.skipped_steps == 0
    fleet.finish()


class _FailingSink(Callback):
    essential = False  # a metrics sink: its failure is recorded, training goes on

    def on_step_end(self, view, step) -> None:
        raise OSError("disk full")


def test_your_loop_s_result_has_the_built_in_loop_s_totals(tmp_path):
    """The run's end is the engine's for both loops: the epochs read and the callbacks
    that failed are in your loop's result as in fit's."""
    fleet = gpufleet.Fleet(accelerator="cpu", run_dir=str(tmp_path / "run"), log_every=2,
                           callbacks=[_FailingSink()])
    net = _net()
    model, optimizer = fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = fleet.setup_dataloaders(DataLoader(_data(), batch_size=8))
    for _ in range(2):
        for x, y in loader:
            fleet.backward(F.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    fleet.finish()
    result = fleet.run.result
    assert (result.steps, result.epochs) == (8, 2.0)
    assert result.callback_errors == {"_FailingSink": "on_step_end: OSError: disk full"}
    assert result.samples_per_s > 0 and result.tokens_per_s is None  # no tokens counted


def test_no_gpufleet_thread_outlives_a_fleet(tmp_path):
    """The watchdog and the system sampler run while the loop steps, and are gone once
    the Fleet ends: by finish(), and by launch(fn) whose fn fails."""
    import threading

    def ours():
        return sorted(t.name for t in threading.enumerate() if t.name.startswith("gpufleet"))

    before = ours()
    fleet = gpufleet.Fleet(accelerator="cpu", run_dir=str(tmp_path / "run"), log_every=1)
    net = _net()
    model, opt = fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    fleet.backward(model(torch.ones(2, 4)).sum())
    opt.step()
    assert "gpufleet-watchdog" in ours()  # a check with teeth: it runs while stepping
    fleet.finish()
    assert ours() == before

    def fails(f):
        m, o = f.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        f.backward(m(torch.ones(2, 4)).sum())
        o.step()
        raise RuntimeError("the loop's own error")

    failing = gpufleet.Fleet(accelerator="cpu", run_dir=str(tmp_path / "run2"))
    with pytest.raises(RuntimeError, match="own error"):
        failing.launch(fails)
    assert ours() == before
