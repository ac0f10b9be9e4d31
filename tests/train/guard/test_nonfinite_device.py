"""The non-finite skip decided on the device: no host read per step in the default
configuration, and a skipped step that leaves weights and optimizer state exactly as
they were."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import gpufleet
import toyjob
from gpufleet.config import FaultConfig, ParallelConfig
from gpufleet.core.callbacks import Callback
from gpufleet.errors import TrainingStopped
from gpufleet.parallel import build_strategy
from gpufleet.precision import build_precision
from gpufleet.train.guard import nonfinite
from gpufleet.train.guard.nonfinite import NonFiniteGuard, _say_host_path


class _HostReads(TorchDispatchMode):
    """Counts reads of a tensor's value on the host: ``.item()``, ``bool()``,
    ``float()`` (all ``_local_scalar_dense``) and ``.tolist()``."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


class _ReadsPerStep(Callback):
    def __init__(self, reads: _HostReads) -> None:
        self.reads, self.seen, self.per_step = reads, 0, {}

    def on_step_end(self, trainer, step):
        self.per_step[step] = self.reads.count - self.seen
        self.seen = self.reads.count


def _reads_per_step(tmp_path, monkeypatch, overrides: dict) -> dict[int, int]:
    reads = _HostReads()
    original = torch.Tensor.tolist

    def counted_tolist(self):
        reads.count += 1
        return original(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    counter = _ReadsPerStep(reads)
    torch.manual_seed(0)
    # One epoch covers the run: a new epoch's shuffle lists its indices on the host
    # (data loading, not a device read).
    data = toyjob.make_data_nan_on_rank(rank=0, after=6 * 16 + 1, nan=1, n=512)  # step 7
    base = {"run.out_dir": str(tmp_path), "run.max_steps": 20, "log.every": 5,
            "log.progress": "off", "data.batch_size": 16, "data.num_workers": 0}
    with reads:
        result = gpufleet.fit(toyjob.make_model(), data, loss_fn=F.mse_loss,
                              overrides={**base, **overrides}, callbacks=[counter])
    assert result.skipped_steps == 1  # the NaN step was found and skipped
    return counter.per_step


def test_the_default_configuration_reads_nothing_on_the_host_between_log_intervals(
        tmp_path, monkeypatch):
    per_step = _reads_per_step(tmp_path / "a", monkeypatch, {})
    # Reads after step k's on_step_end (the log interval of step 5, 10, ...) count
    # towards step k + 1; the first step holds start-up.
    inside = {s: n for s, n in per_step.items() if s > 1 and (s - 1) % 5}
    assert len(inside) == 16 and sum(inside.values()) == 0, per_step
    assert all(per_step[s] > 0 for s in (6, 11, 16)), per_step  # the log reads count
    # The counter does see a per-step read where the host must decide (fp16's scaler).
    fp16 = _reads_per_step(tmp_path / "b", monkeypatch, {"precision.mode": "fp16-mixed"})
    assert all(fp16[s] > 0 for s in range(2, 21)), fp16


def _guarded(opt_cls, fused=True, **kwargs):
    torch.manual_seed(0)
    model = toyjob.make_model()
    precision = build_precision("fp32", "cpu")
    strategy = build_strategy("single", ParallelConfig(), torch.device("cpu"), precision)
    opt = opt_cls(model.parameters(), fused=fused, **kwargs)
    return model, opt, NonFiniteGuard(FaultConfig(), strategy, precision)


def _step(model, opt, guard, x):
    loss = F.mse_loss(model(x), torch.zeros(len(x), 1))
    loss.backward()
    guard.inspect(model, loss.detach(), opt)
    assert guard.should_skip(model, loss.detach(), None, opt) is False  # on the device
    opt.step()
    opt.zero_grad()


def _snapshot(model, opt):
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for i, s in enumerate(opt.state.values()):
        state.update({f"{i}.{k}": v.clone() for k, v in s.items() if torch.is_tensor(v)})
    return state


@pytest.mark.parametrize("opt_cls,kwargs", [
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "weight_decay": 0.1}),
])
def test_a_step_skipped_on_the_device_changes_nothing(opt_cls, kwargs):
    model, opt, guard = _guarded(opt_cls, **kwargs)
    x = torch.randn(4, 8)
    bad = x.clone()
    bad[1, 2] = float("nan")
    _step(model, opt, guard, bad)  # the very first step skipped: state stays clean
    _step(model, opt, guard, x)
    before = _snapshot(model, opt)
    _step(model, opt, guard, bad)
    after = _snapshot(model, opt)
    assert before.keys() == after.keys()
    for k in before:
        torch.testing.assert_close(after[k], before[k], rtol=0, atol=0)
    # The two good steps equal a plain run's two steps (no skipped step in it).
    ref, ref_opt, ref_guard = _guarded(opt_cls, **kwargs)
    _step(ref, ref_opt, ref_guard, x)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=0, atol=0)
    skipped = [bool(flag) for flag in guard.pending()]
    assert skipped == [True, False, True]  # the agreed flags, read at the log interval


class _PoisonAt(Callback):
    """Makes one parameter's gradient NaN in optimizer step ``step`` (1-based)."""

    def __init__(self, param: torch.nn.Parameter, step: int) -> None:
        self.step, self.now = step, 0
        param.register_hook(lambda g: g * float("nan") if self.now == self.step else g)

    def on_fit_start(self, trainer):
        self.now = 1

    def on_step_end(self, trainer, step):
        self.now = step + 1


# The device path with the clip's norms and with its own record (each gradient's sum on
# a CPU), and the host path (fp16's scaler) with and without a clip.
@pytest.mark.parametrize(("mode", "clip"), [("fp32", 1.0), ("fp32", 0.0),
                                            ("fp16-mixed", 1.0), ("fp16-mixed", 0.0)])
def test_the_culprit_is_the_parameter_that_went_bad_before_clipping(tmp_path, caplog, mode,
                                                                    clip):
    # Clipping by norm (on here) spreads a NaN norm into every gradient; the culprit is
    # read before it, so the one bad parameter is named. fp16's loss scaler decides on
    # the host: it reads its culprit before the clip too.
    torch.manual_seed(0)
    model = toyjob.make_model()
    poison = _PoisonAt(model[3].weight, step=3)
    with caplog.at_level("INFO"):
        result = gpufleet.fit(model, toyjob.make_data(), loss_fn=F.mse_loss, overrides={
            "run.out_dir": str(tmp_path), "run.max_steps": 6, "log.every": 3,
            "log.progress": "off", "data.batch_size": 16, "data.num_workers": 0,
            "optim.clip_norm": clip, "precision.mode": mode}, callbacks=[poison])
    assert result.skipped_steps == 1
    skipped = "skipped on every rank" if mode == "fp32" else "skipped by the fp16 loss scaler"
    assert (f"step 3 {skipped}: non-finite gradients on rank 0 in 1 "
            "parameter(s), first: 3.weight") in caplog.text
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("clip_norm", [1.0, 0.0])  # the clip's norms reused, or its own
def test_an_interval_with_a_skipped_step_logs_the_mean_loss_of_the_others(tmp_path,
                                                                          clip_norm):
    def run(every: int) -> dict[int, float]:
        torch.manual_seed(0)
        data = toyjob.make_data_nan_on_rank(rank=0, after=2 * 16 + 1, nan=1)  # step 3
        result = gpufleet.fit(toyjob.make_model(), data, loss_fn=F.mse_loss, overrides={
            "run.out_dir": str(tmp_path / str(every)), "run.max_steps": 8,
            "log.every": every, "log.progress": "off", "data.batch_size": 16,
            "data.num_workers": 0, "optim.clip_norm": clip_norm})
        assert result.skipped_steps == 1
        return dict(result.losses)

    each, grouped = run(1), run(4)
    assert math.isnan(each[3])  # the skipped step alone: no finite loss
    # The first interval's mean leaves step 3 out; the second holds no skipped step.
    assert grouped[4] == pytest.approx((each[1] + each[2] + each[4]) / 3, rel=1e-6)
    assert grouped[8] == pytest.approx(sum(each[s] for s in range(5, 9)) / 4, rel=1e-6)


@pytest.mark.parametrize("limit", [4, 5])
def test_a_run_of_skips_goes_on_across_log_intervals(tmp_path, limit):
    # Steps 5-8 go bad; intervals of 3 steps: 1-3 (none skipped), 4-6 (two), 7-9 (two
    # more): the run of four spans two intervals and stops a run whose limit is four.
    torch.manual_seed(0)
    data = toyjob.make_data_nan_on_rank(rank=0, after=4 * 16 + 1, nan=4 * 16, n=512)
    overrides = {"run.out_dir": str(tmp_path), "run.max_steps": 12, "log.every": 3,
                 "log.progress": "off", "data.batch_size": 16, "data.num_workers": 0,
                 "fault.max_skips_in_row": limit}

    def fit():
        return gpufleet.fit(toyjob.make_model(), data, loss_fn=F.mse_loss,
                            overrides=overrides)

    if limit == 4:
        with pytest.raises(TrainingStopped, match=r"4 optimizer steps in a row .*\(step 7:"):
            fit()
    else:
        result = fit()
        assert result.skipped_steps == 4 and result.steps == 12
        assert all(math.isfinite(loss) for step, loss in result.losses if step in (3, 12))


def test_a_cuda_run_with_an_unfused_optimizer_is_told_the_guard_syncs(caplog, monkeypatch):
    """On a GPU, a user's optimizer built without fused=True puts the guard's decision on
    the host every step (a sync): the run says so once, with the fix; a fused one, or an
    optimizer with no fused kernel, is not told."""
    monkeypatch.setattr(nonfinite, "_SAID_HOST_PATH", False)
    model, _, guard = _guarded(torch.optim.SGD, lr=0.1)
    unfused = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level("INFO", logger="gpufleet.train.guard.nonfinite"):
        guard.start(model, unfused, torch.device("cuda"))  # only names it: no CUDA call
    assert guard.on_device is False
    assert "SGD is not fused" in caplog.text and "fused=True" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="gpufleet.train.guard.nonfinite"):
        guard.start(model, unfused, torch.device("cuda"))  # said once a process
    assert "not fused" not in caplog.text
    monkeypatch.setattr(nonfinite, "_SAID_HOST_PATH", False)
    with caplog.at_level("INFO", logger="gpufleet.train.guard.nonfinite"):
        # no fused kernel to suggest: the host path, said nothing of
        _guarded(torch.optim.SGD, lr=0.1)[2].start(model, torch.optim.Rprop(
            model.parameters()), torch.device("cuda"))
        # a fused one decides on the device: nothing to say (start() would touch CUDA)
        _say_host_path(torch.optim.SGD(model.parameters(), lr=0.1, fused=True),
                       guard.precision)
    assert "not fused" not in caplog.text


@pytest.mark.parametrize("fused", [True, False])  # the device path, and the host path
def test_where_the_fused_check_cannot_take_the_gradients_their_norms_decide(fused):
    """CUDA's kernel of the fused check has no bfloat16 and takes one device: for
    such gradients the guard checks each one's float32 norm on the loss's device instead
    (driven here on a CPU). A good step passes; a NaN, an inf, and a NaN loss are caught
    and the culprit is named."""
    model, opt, guard = _guarded(torch.optim.SGD, fused=fused, lr=1e-2)
    x = torch.randn(4, 8)
    guard.start(model, opt, torch.device("cpu"))
    guard._direct = False  # as start() decides for bf16 or offloaded gradients on CUDA
    assert guard.on_device is fused

    def step(poison=None, loss_scale=1.0):
        loss = F.mse_loss(model(x), torch.zeros(4, 1)) * loss_scale
        loss.backward()
        if poison is not None:
            model[poison].weight.grad[0, 0] = float("nan") if poison == 0 else float("inf")
        guard.inspect(model, loss.detach(), opt)
        skip = guard.should_skip(model, loss.detach(), None, opt)
        if not skip:  # the host path skips here; the device path in the fused step
            opt.step()
        opt.zero_grad()
        return skip

    outcomes = [step(), step(poison=0), step(poison=3), step(loss_scale=float("nan")),
                step()]
    if fused:  # decided on the device: the flags tell, read at the log interval
        outcomes = [bool(flag) for flag in guard.pending()]
        names = [guard._culprit(row, 0.0)[1] for row in (1, 2)]
    else:
        names = [r.first_bad_param for r in guard.records[:2]]
        assert guard.records[2].loss_ranks == [0]
    assert outcomes == [False, True, True, True, False]
    assert names == ["0.weight", "3.weight"]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # start() takes this route where the gradients live off the loss's device (CPU
    # offload under a CUDA run); said of an unfused optimizer, which touches no CUDA.
    offloaded = NonFiniteGuard(FaultConfig(), guard.strategy, guard.precision)
    offloaded.start(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cuda"))
    assert not offloaded._direct
    guard.start(model, opt, torch.device("cpu"))
    assert guard._direct  # all on the loss's CPU: the kernel takes the gradients
