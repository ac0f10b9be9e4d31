"""Fleet against Lightning Fabric itself: the same small loop or call under
``lightning.fabric.Fabric`` and under ``gpufleet.Fleet``, and the same results (the
differences Lightning's own Fabric tests found)."""

from __future__ import annotations

import os

import pytest
import torch
from torch.nn import functional as F

import gpufleet
from gpufleet.errors import ConfigError

fabric_module = pytest.importorskip("lightning.fabric")


@pytest.fixture(autouse=True)
def _environment_restored():
    """Fabric's launch sets MASTER_ADDR, MASTER_PORT and the rank variables in this
    process's environment and leaves them: later tests (Accelerate's state, which then
    starts a process group of its own) would take them for a job's."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


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
    on_after_optimizer_step (after each step of a set-up optimizer, with a strategy a
    callback reads the device and collectives of)."""
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
            self.heard.append(("step", type(optimizer).__name__, str(strategy.root_device),
                               strategy.reduce_boolean_decision(True)))

    ours, theirs = Hooks(), Hooks()
    fleet = _fleet(tmp_path, callbacks=[ours])
    run(fleet, ours.heard)
    run(fabric_module.Fabric(accelerator="cpu", devices=1, callbacks=[theirs]),
        theirs.heard)
    assert ours.heard == theirs.heard == [("setup", "Sequential"), ("step", "SGD", "cpu", True),
                                          ("step", "SGD", "cpu", True)]
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
    ours = fleet.launch(_one_process_loop)  # (ddp_spawn and ddp_fork take launch(fn))
    assert not dist.is_initialized()  # the group Fleet made is left at the end
    # Fabric's ddp_spawn and ddp_fork start their processes from launch(fn): in one
    # process they are its ddp
    fabric = _fabric(strategy="ddp" if strategy in ("ddp_spawn", "ddp_fork") else strategy)
    try:
        fabric.launch()
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


# The phrases Lightning's own Fabric tests match in each misuse error (and warning).
_MISUSE_PHRASES = {
    "setup twice": "A model should be passed only once to the `setup` method",
    "optimizer twice": "An optimizer should be passed only once to the `setup` method",
    "setup_module twice": "A model should be passed only once to the `setup_module` method",
    "setup_optimizers twice":
        "An optimizer should be passed only once to the `setup_optimizers` method",
    "setup_optimizers()": "`setup_optimizers` requires at least one optimizer as input",
    "setup_dataloaders()": "`setup_dataloaders` requires at least one dataloader as input",
    "loader twice":
        "A dataloader should be passed only once to the `setup_dataloaders` method",
    "not a loader": "Only PyTorch DataLoader are currently supported in `setup_dataloaders`",
    "log of several values": "it cannot be converted to a scalar",
    "launch(fn without arguments)": "needs to take at least one argument",
    "launch(not a function)": "needs to be a callable",
    "launch(None)": "needs to be a callable",
    "no_backward_sync(a model not set up)": "You need to set up the model first",
    "save(filter=not a dict)": "should be a dict",
    "save(filter={key: not a function})": "callable, given 'foo",
    "save(filter={unknown key})": "keys {'asd'} are not present in the state keys",
    "setup before launch (2 devices)": "you must call `.launch()`",
}


def _misuse_messages(f, unlaunched):
    """Each misuse's (exception type, message), run on ``f`` (and on ``unlaunched``, one
    of 2 devices whose ranks were not started)."""
    net = _net()
    model, wrapped = f.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = f.setup_dataloaders(torch.utils.data.DataLoader(range(4)))
    tries = {
        "setup twice": lambda: f.setup(model),
        "optimizer twice": lambda: f.setup(_net(), wrapped),
        "setup_module twice": lambda: f.setup_module(model),
        "setup_optimizers twice": lambda: f.setup_optimizers(wrapped),
        "setup_optimizers()": lambda: f.setup_optimizers(),
        "setup_dataloaders()": lambda: f.setup_dataloaders(),
        "loader twice": lambda: f.setup_dataloaders(loader),
        "not a loader": lambda: f.setup_dataloaders(range(2)),
        "log of several values": lambda: f.log("log", torch.tensor([3, 4])),
        "launch(fn without arguments)": lambda: f.launch(lambda: None),
        "launch(not a function)": lambda: f.launch(3),
        "launch(None)": lambda: f.launch(None),  # (what a call in its place returned)
        "no_backward_sync(a model not set up)":
            lambda: f.no_backward_sync(torch.nn.Linear(2, 2)).__enter__(),
        "save(filter=not a dict)": lambda: f.save("x.pt", {"a": 1}, filter="foo"),
        "save(filter={key: not a function})":
            lambda: f.save("x.pt", {"a": 1}, filter={"a": "foo"}),
        "save(filter={unknown key})":
            lambda: f.save("x.pt", {"a": 1}, filter={"asd": lambda *_: True}),
        "setup before launch (2 devices)": lambda: unlaunched.setup(_net()),
    }
    out = {}
    for name, attempt in tries.items():
        with pytest.raises(Exception) as caught:  # its type is compared below
            attempt()
        out[name] = (caught.type, str(caught.value))
    return out


def test_misuse_errors_say_what_fabrics_say(tmp_path, monkeypatch):
    """Fabric's misuse errors, of its types, hold the words its own tests match (a
    Fabric loop's tests of its error handling keep passing); ours go on to name the
    fix."""
    monkeypatch.chdir(tmp_path)  # (where a save that was not refused would write)
    fleet = _fleet(tmp_path, loggers=[])
    ours = _misuse_messages(fleet, gpufleet.Fleet(accelerator="cpu", devices=2,
                                                  run_dir=str(tmp_path / "two")))
    theirs = _misuse_messages(_fabric(loggers=[]), fabric_module.Fabric(
        accelerator="cpu", devices=2, strategy="ddp"))
    for name, phrase in _MISUSE_PHRASES.items():
        assert phrase in theirs[name][1], name  # the phrase is Fabric's own
        assert issubclass(ours[name][0], theirs[name][0]), (name, ours[name])
        assert phrase in ours[name][1], (name, ours[name][1])
    assert not (tmp_path / "x.pt").exists()  # every refused save wrote nothing
    fleet.finish()


def test_call_warns_of_a_callback_attribute_that_is_not_a_method(tmp_path):
    class Holder:
        not_a_method = 1

    for f in (_fleet(tmp_path, callbacks=[Holder()]), _fabric(callbacks=[Holder()])):
        with pytest.warns(UserWarning, match="Skipping the callback `Holder.not_a_method`"):
            f.call("not_a_method")
        if isinstance(f, gpufleet.Fleet):
            f.finish()


def test_launch_under_lightnings_cli_is_refused_as_fabric_refuses_it(tmp_path, monkeypatch):
    """``fabric run`` (LT_CLI_USED=1) started the processes: launch() and a subclass's own
    run() are refused, in Fabric's words; ``launch()`` under a strategy that spawns
    its processes needs a function."""
    class WithRun(gpufleet.Fleet):
        def run(self):
            pass

    class FabricWithRun(fabric_module.Fabric):
        def run(self):
            pass

    monkeypatch.setenv("LT_CLI_USED", "1")
    fleet = _fleet(tmp_path)
    for f in (fleet, _fabric()):
        with pytest.raises(RuntimeError, match=r"Calling  `\.launch\(\)` again is not allowed"):
            f.launch()
    fleet.finish()
    for cls, kwargs in ((WithRun, {"run_dir": str(tmp_path / "sub")}), (FabricWithRun, {})):
        with pytest.raises(TypeError, match=r"Overriding `Fabric\.run\(\)` and launching "
                                            "from the CLI is not allowed"):
            cls(accelerator="cpu", devices=1, **kwargs)
    monkeypatch.delenv("LT_CLI_USED")
    spawning = _fleet(tmp_path, "spawn", strategy="ddp_spawn")
    try:
        for f in (spawning, fabric_module.Fabric(accelerator="cpu", strategy="ddp_spawn")):
            with pytest.raises(TypeError, match=r"launch\(\)` needs to be called with a "
                                                "function"):
                f.launch()
    finally:
        spawning.finish()  # (it made a process group of one rank)


def test_a_subclass_with_its_own_run_is_launched_by_calling_it(tmp_path):
    """Fabric's older form: ``class Train(Fabric): def run(self, ...)``; calling
    ``run(...)`` runs it (on every rank) with the arguments given and returns rank 0's
    result. On Fleet it was "'FleetRun' object is not callable"; the run ends after it."""
    def subclass(base):
        class Train(base):
            def run(self, *args, **kwargs):
                self.got = (args, kwargs, self.world_size)
                return "result"
        return Train

    ours = subclass(gpufleet.Fleet)(accelerator="cpu", devices=1, run_dir=str(tmp_path / "r"))
    theirs = subclass(fabric_module.Fabric)(accelerator="cpu", devices=1)
    assert ours.run(1, 2, three=3) == theirs.run(1, 2, three=3) == "result"
    assert ours.got == theirs.got == ((1, 2), {"three": 3}, 1)
    assert ours.result.run_dir == str(tmp_path / "r")
    with pytest.raises(ConfigError, match=r"after fleet\.finish"):
        ours.log("x", 1)  # run() ended the run, as launch(fn) does


def test_strategy_gives_the_facts_and_collectives_a_loop_reads(tmp_path):
    """``fabric.strategy.root_device``, ``.barrier()``, ``.reduce_boolean_decision``:
    what loops and Lightning's SpikeDetection read; the rest of Lightning's Strategy
    object is refused, naming what there is."""
    def facts(f):
        s = f.strategy
        s.barrier()
        return (s.root_device, s.is_global_zero, s.world_size, s.global_rank,
                s.local_rank, s.reduce_boolean_decision(True),
                s.reduce_boolean_decision(False, all=False),
                s.all_reduce(torch.tensor(2.0), reduce_op="sum").item(),
                s.broadcast({"a": 1}))

    fleet = _fleet(tmp_path, strategy="ddp")  # (a process group of one rank, as Fabric's)
    fabric = _fabric(strategy="ddp")
    try:
        fabric.launch()
        assert facts(fleet) == facts(fabric)
    finally:
        fleet.finish()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    single = _fleet(tmp_path, "single")
    assert facts(single)[:2] == (torch.device("cpu"), True) and single.strategy.name == "single"
    with pytest.raises(AttributeError, match=r"fleet\.strategy has no .launcher.*root_device"):
        single.strategy.launcher  # noqa: B018 (the read is the test)
    with pytest.raises(AttributeError, match="read-only"):
        single.strategy.load_checkpoint = None  # the strategy is decided once
    single.finish()


def test_64_true_leaves_complex_buffers_as_fabric_does(tmp_path):
    """Fabric converts a model to ``64-true`` with ``module.double()``: a complex buffer
    built under ``init_module`` stays complex128 (one built outside stays complex64);
    ``module.to(float64)`` dropped its imaginary part."""
    class WithComplex(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 2)
            self.register_buffer("c", torch.complex(torch.rand(3), torch.rand(3)))

    def dtypes(f):
        with f.init_module():
            inside = WithComplex()
        outside = WithComplex()
        return [(m.layer.weight.dtype, m.c.dtype) for m in (f.setup(inside),
                                                           f.setup(outside))]

    fleet = _fleet(tmp_path, precision="64-true")
    ours = dtypes(fleet)
    assert ours == dtypes(_fabric(precision="64-true"))
    assert ours == [(torch.float64, torch.complex128), (torch.float64, torch.complex64)]
    fleet.finish()


def test_16_mixed_on_cpu_is_bf16_mixed_as_fabric_decides(tmp_path):
    """Fabric turns ``precision="16-mixed"`` on a CPU into bf16-mixed, with a warning:
    the forward gets bfloat16 inputs and runs under CPU autocast to bfloat16."""
    def forward_dtypes(f):
        seen = []

        class Seen(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.Linear(4, 2)

            def forward(self, x):
                out = self.layer(x)
                seen.append((x.dtype, torch.is_autocast_cpu_enabled(), out.dtype))
                return out

        out = f.setup(Seen())(torch.ones(2, 4))
        return seen, out.dtype

    with pytest.warns(UserWarning, match="bf16-mixed"):
        fleet = _fleet(tmp_path, precision="16-mixed")
    with pytest.warns(UserWarning, match="bf16-mixed"):
        fabric = _fabric(precision="16-mixed")
    ours = forward_dtypes(fleet)
    assert ours == forward_dtypes(fabric)
    assert ours == ([(torch.bfloat16, True, torch.bfloat16)], torch.float32)
    assert fleet.plan.precision == "bf16-mixed"
    fleet.finish()


def test_a_set_up_loader_shows_the_loaders_own_attributes(tmp_path, monkeypatch):
    """``fabric_loader.worker_init_fn`` (set by seed_everything), ``num_workers``...:
    Fabric's loader shows the DataLoader's attributes, and ``device`` (where its batches
    go; None with move_to_device=False); Fleet's did not have them."""
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")  # (restored after the test)
    monkeypatch.setenv("PL_SEED_WORKERS", "0")
    gpufleet.Fleet.seed_everything(3, verbose=False)  # workers=True, Fabric's default
    fleet = _fleet(tmp_path)
    ours = fleet.setup_dataloaders(torch.utils.data.DataLoader(range(4), num_workers=0))
    theirs = _fabric().setup_dataloaders(torch.utils.data.DataLoader(range(4)))
    assert ours.worker_init_fn.keywords == {"rank": 0}  # our per-rank worker seeding
    assert callable(theirs.worker_init_fn)
    assert ours.num_workers == theirs.num_workers == 0
    assert ours.device == theirs.device == torch.device("cpu")  # where batches are for
    kept = [f.setup_dataloaders(torch.utils.data.DataLoader(range(4)), move_to_device=False)
            for f in (fleet, _fabric())]
    assert kept[0].device is None and kept[1].device is None
    with pytest.raises(AttributeError, match="no attribute '_private'"):
        ours._private  # noqa: B018 (the read is the test)
    fleet.finish()
