"""Fleet against Lightning Fabric itself: the same small loop or call under
``lightning.fabric.Fabric`` and under ``gpufleet.Fleet``, and the same results (the
differences Lightning's own Fabric tests found)."""

from __future__ import annotations

import os

import pytest
import torch
from torch.nn import functional as F

import gpufleet

fabric_module = pytest.importorskip("lightning.fabric")


def _fabric(**kwargs):
    return fabric_module.Fabric(accelerator="cpu", devices=1, **kwargs)


def _fleet(tmp_path, name="run", **kwargs):
    return gpufleet.Fleet(accelerator="cpu", devices=1, run_dir=str(tmp_path / name),
                          **kwargs)


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def _train(f, steps: int = 3):
    """A loop that keeps its own optimizer reference and steps a scheduler built on it
    before setup; returns the wrapped optimizer, the user's, and the weights."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, wrapped = f.setup(net, opt)
    for i in range(steps):
        x = torch.full((2, 4), float(i + 1))
        f.backward(F.mse_loss(model(x), torch.zeros(2, 1)))
        wrapped.step()
        wrapped.zero_grad()
        sched.step()
    return wrapped, opt, model, [p.detach().clone() for p in net.parameters()]


def test_setup_wraps_the_users_own_optimizer_as_fabric_does(tmp_path):
    """``wrapped.optimizer is opt``: the user's object trains (its state, its learning
    rate, a scheduler built on it before setup), nothing of it is patched, and the
    weights equal Fabric's."""
    f_wrapped, f_opt, f_model, f_weights = _train(_fabric())
    fleet = _fleet(tmp_path)
    wrapped, opt, model, weights = _train(fleet)
    assert f_wrapped.optimizer is f_opt and wrapped.optimizer is opt
    assert isinstance(wrapped, torch.optim.SGD) and isinstance(f_wrapped, torch.optim.SGD)
    assert opt.state and opt.param_groups[0]["lr"] == f_opt.param_groups[0]["lr"] == 0.0125
    for ours, theirs in zip(weights, f_weights, strict=True):
        assert torch.equal(ours, theirs)
    # No instance patch of step or zero_grad, no private flags set by Fleet: the only
    # wrapper of step is the user's own scheduler's, as without Fleet.
    assert "zero_grad" not in vars(opt) and "_opt_called" not in vars(wrapped)
    assert model.device == f_model.device == torch.device("cpu")
    assert fleet.step == 3
    fleet.finish()


def test_a_step_on_the_users_own_reference_still_counts(tmp_path):
    """A loop that steps its own reference (not the wrapper) still trains and ends the
    run's step, through torch's step hooks."""
    fleet = _fleet(tmp_path)
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, _ = fleet.setup(net, opt)
    before = [p.detach().clone() for p in net.parameters()]
    fleet.backward(model(torch.ones(2, 4)).sum())
    opt.step()
    assert fleet.step == 1
    assert not all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    fleet.finish()


def _misuse(f, plain_error_types: dict):
    """Each misuse Fabric refuses, as (name, exception type) or None where accepted."""
    out = {}
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, wrapped = f.setup(net, opt)

    def attempt(name, fn):
        try:
            fn()
            out[name] = None
        except Exception as e:  # the type is what is compared
            out[name] = next(t for t in plain_error_types if isinstance(e, t))

    attempt("setup twice", lambda: f.setup(model))
    attempt("optimizer twice", lambda: f.setup(_net(), wrapped))
    attempt("setup_module twice", lambda: f.setup_module(model))
    attempt("setup_optimizers()", lambda: f.setup_optimizers())
    attempt("optimizer twice (setup_optimizers)", lambda: f.setup_optimizers(wrapped))
    lone = torch.nn.Linear(2, 2)
    attempt("setup_optimizers without setup_module",
            lambda: f.setup_optimizers(torch.optim.SGD(lone.parameters(), lr=0.1)))
    attempt("no_backward_sync on a module never set up",
            lambda: f.no_backward_sync(torch.nn.Linear(2, 2)).__enter__())
    attempt("setup_dataloaders()", lambda: f.setup_dataloaders())
    attempt("setup_dataloaders(not a loader)", lambda: f.setup_dataloaders([1, 2]))
    return out


def test_setup_misuse_is_refused_as_fabric_refuses_it(tmp_path):
    types = {TypeError: 0, ValueError: 0, RuntimeError: 0}
    fleet = _fleet(tmp_path)
    ours = _misuse(fleet, types)
    theirs = _misuse(_fabric(), types)
    assert ours == theirs
    assert theirs["setup twice"] is ValueError  # a check that the comparison has teeth
    assert theirs["setup_optimizers without setup_module"] is None
    fleet.finish()


class _Seen(torch.nn.Module):
    """Records the dtype of each input and the default dtype inside its forward."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)
        self.seen = []

    def forward(self, x, *, mask=None):
        self.seen.append((x.dtype, mask.dtype, torch.get_default_dtype(),
                          torch.empty(1).dtype))
        return self.layer(x.to(self.layer.weight.dtype)), x.double()


@pytest.mark.parametrize("precision",
                         ["bf16-true", "16-true", "64-true", "bf16-mixed", "32-true"])
def test_precision_converts_model_inputs_and_outputs_as_fabric(tmp_path, precision):
    """The true precisions put the model and its inputs in their dtype (and the forward
    under that default dtype); the mixed ones cast the inputs to the autocast dtype;
    outputs come back in float32 (Fabric converts every floating-point output)."""
    def run(f):
        with f.init_module():
            made = torch.empty(1).dtype
        module = _Seen()
        model = f.setup(module)
        x = torch.ones(3, 4)
        out, wide = model(x, mask=torch.ones(3))
        return (made, module.layer.weight.dtype, module.seen, out.dtype, wide.dtype,
                torch.get_default_dtype())

    fleet = _fleet(tmp_path, precision=precision)
    assert run(fleet) == run(_fabric(precision=precision))
    fleet.finish()


def test_callbacks_hear_the_hooks_fabric_calls(tmp_path):
    """Fabric itself calls on_after_setup (from setup, not setup_module) and
    on_after_optimizer_step (after each step of a set-up optimizer)."""
    def run(f, heard):
        net = _net()
        model, opt = f.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        f.setup_module(torch.nn.Linear(2, 2))
        for _ in range(2):
            f.backward(model(torch.ones(2, 4)).sum())
            opt.step()
            opt.zero_grad()
        return heard

    class Hooks:
        def __init__(self):
            self.heard = []

        def on_after_setup(self, fabric, module):
            self.heard.append(("setup", type(module.module).__name__))

        def on_after_optimizer_step(self, strategy, optimizer):
            self.heard.append(("step", type(optimizer).__name__))

    ours, theirs = Hooks(), Hooks()
    fleet = _fleet(tmp_path, callbacks=[ours])
    run(fleet, ours.heard)
    run(fabric_module.Fabric(accelerator="cpu", devices=1, callbacks=[theirs]),
        theirs.heard)
    assert ours.heard == theirs.heard == [("setup", "Sequential"), ("step", "SGD"),
                                          ("step", "SGD")]
    fleet.finish()


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(torch.arange(5.0).unsqueeze(1))


class _NoLenSampler(torch.utils.data.Sampler):
    def __iter__(self):
        return iter([4, 0, 3, 1, 2])


class _NoLenData(torch.utils.data.Dataset):
    def __getitem__(self, i):
        return torch.tensor([float(i)])


def test_one_device_loaders_without_len_are_left_as_fabric_leaves_them(tmp_path):
    """On one device Fabric leaves a loader's sampling as it is: an IterableDataset, a
    sampler without len(), a dataset without len() read through one."""
    def batches(f):
        loaders = [torch.utils.data.DataLoader(_Stream(), batch_size=2),
                   torch.utils.data.DataLoader(_NoLenData(), batch_size=2,
                                               sampler=_NoLenSampler())]
        return [[b.tolist() for b in f.setup_dataloaders(loader)] for loader in loaders]

    fleet = _fleet(tmp_path)
    ours = batches(fleet)
    assert ours == batches(_fabric())
    assert ours[1][0] == [[4.0], [0.0]]
    fleet.finish()


def test_seed_everything_is_fabrics(monkeypatch):
    """Static on the class, bounds checked, PL_GLOBAL_SEED read and set, the same
    numbers drawn; gpufleet.seed_everything is the module-level one."""
    from lightning.fabric.utilities import seed as fabric_seed

    def outcome(fn, *args):
        try:
            value = fn(*args, verbose=False)
        except ValueError:
            return "ValueError"
        return value, torch.rand(1).item(), os.environ.get("PL_GLOBAL_SEED")

    monkeypatch.setenv("PL_GLOBAL_SEED", "11")
    for args in [(), (3,), (-1,), (2**32,), (2**32 - 1,), (5.0,)]:
        ours = outcome(gpufleet.Fleet.seed_everything, *args)
        assert ours == outcome(fabric_module.Fabric.seed_everything, *args), args
        assert outcome(gpufleet.seed_everything, *args) == \
            outcome(fabric_seed.seed_everything, *args), args
    monkeypatch.setenv("PL_GLOBAL_SEED", "nope")
    assert outcome(gpufleet.seed_everything) == outcome(fabric_seed.seed_everything) \
        == "ValueError"


def test_changing_the_import_line_ports_a_fabric_script(tmp_path, monkeypatch):
    """Lightning's Fabric examples begin ``import lightning as L``, then
    ``L.seed_everything(42)`` and ``L.Fabric(...)``; with ``import gpufleet as L`` the
    same lines run and train to the same weights."""
    import lightning

    def script(L):
        L.seed_everything(42)
        fabric = L.Fabric(accelerator="cpu", devices=1)
        fabric.launch()
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        model, optimizer = fabric.setup(model, optimizer)
        for _ in range(3):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        return [p.detach().clone() for p in model.parameters()], fabric

    monkeypatch.chdir(tmp_path)
    ours, fleet = script(gpufleet)
    theirs, _ = script(lightning)
    assert isinstance(fleet, gpufleet.Fleet)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
    fleet.finish()


def _one_process_loop(f):
    f.launch()
    net = _net()
    model, opt = f.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for i in range(2):
        f.backward(model(torch.full((2, 4), float(i))).sum())
        opt.step()
        opt.zero_grad()
    wrapped = getattr(model, "placed", None) or model._forward_module
    return type(wrapped).__name__, [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn", "ddp_fork", "dp"])
def test_ddp_in_one_process_runs_as_fabric_runs_it(tmp_path, strategy):
    """One process, one CPU device: Fabric wraps the model in DDP over a process group
    of one rank (``dp`` on CPU is ddp for Fabric too); so does Fleet, with the same
    weights."""
    import torch.distributed as dist

    fleet = _fleet(tmp_path, strategy=strategy)
    ours = _one_process_loop(fleet)
    fleet.finish()
    assert not dist.is_initialized()  # the group Fleet made is left at the end
    # Fabric's ddp_spawn and ddp_fork start their processes from launch(fn): in one
    # process they are its ddp
    fabric = _fabric(strategy="ddp" if strategy in ("ddp_spawn", "ddp_fork") else strategy)
    try:
        theirs = _one_process_loop(fabric)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert ours[0] == theirs[0] == "DistributedDataParallel"
    for a, b in zip(ours[1], theirs[1], strict=True):
        assert torch.equal(a, b)


def test_loggers_get_the_values_and_step_fabric_hands_them(tmp_path):
    class Seen:
        def __init__(self):
            self.seen = []

        def log_metrics(self, metrics, step):
            self.seen.append((metrics, step, [type(v) for v in metrics.values()]))

    def run(f):
        f.log("a", 1)
        f.log("b", torch.tensor(0.5), step=7)
        f.log_dict({"c": 2, "d": 1.5})

    ours, theirs = Seen(), Seen()
    fleet = _fleet(tmp_path, loggers=[ours])
    run(fleet)
    run(fabric_module.Fabric(accelerator="cpu", devices=1, loggers=[theirs]))
    assert ours.seen == theirs.seen
    assert ours.seen[0] == ({"a": 1}, None, [int])
    fleet.finish()


_LOGGING_SCRIPT = """
import logging, sys
import gpufleet
fleet = gpufleet.Fleet(accelerator="cpu", run_dir=sys.argv[1])
logging.getLogger("gpufleet.fleet").info("before the script configures logging")
logging.basicConfig(level=logging.INFO, format="%(name)s| %(message)s")
logging.getLogger("mine").info("progress line")
logging.getLogger("gpufleet.fleet").info("after")
fleet.finish()
"""


def test_a_fleet_leaves_the_scripts_logging_basicconfig_working(tmp_path):
    """An Accelerate or Fabric script calls logging.basicConfig(level=INFO) after
    building its accelerator; its INFO lines showed nowhere once a Fleet was made
    (a handler on the root logger made basicConfig do nothing)."""
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text(_LOGGING_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=120, check=True)
    lines = done.stderr.splitlines()
    assert "mine| progress line" in lines
    assert "gpufleet.fleet| after" in lines  # gpufleet's own lines, once, the script's way
    assert sum("after" in line for line in lines) == 1
    assert any(line.endswith("before the script configures logging") for line in lines)
