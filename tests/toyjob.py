"""A small regression job for tests: importable by launched ranks (tests/ is put on
PYTHONPATH by the tests that start processes)."""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from gpufleet.core.callbacks import Callback


def make_model(in_dim: int = 8, hidden: int = 16, dropout: float = 0.0) -> nn.Module:
    return nn.Sequential(nn.Linear(in_dim, hidden), nn.Tanh(), nn.Dropout(dropout),
                         nn.Linear(hidden, 1))


def make_data(n: int = 256, in_dim: int = 8, n_eval: int = 0):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n + n_eval, in_dim, generator=g)
    w = torch.randn(in_dim, 1, generator=g)
    y = torch.tanh(x @ w) + 0.05 * torch.randn(n + n_eval, 1, generator=g)
    train = TensorDataset(x[:n], y[:n])
    return (train, TensorDataset(x[n:], y[n:])) if n_eval else train


class Stream(IterableDataset):
    """Samples ``start`` to ``start + n - 1`` of :func:`make_data` as a stream (an
    IterableDataset): the same items in the same order in every process that reads it."""

    def __init__(self, n: int = 256, start: int = 0) -> None:
        assert start + n <= 256, "make_data() holds 256 samples"
        self.n, self.start = n, start

    def __iter__(self):
        x, y = make_data().tensors
        return ((x[i], y[i]) for i in range(self.start, self.start + self.n))


def make_data_failing_on_host(host: str = "n2", n: int = 256):
    """The training data, except on node ``host`` of a ``--hosts`` job (named in
    GPUFLEET_HOSTS_NODE there), where it is missing, as when one node lacks a file."""
    if os.environ.get("GPUFLEET_HOSTS_NODE") == host:
        raise FileNotFoundError(f"the training data is not on {host}")
    return make_data(n)


def make_classifier(in_dim: int = 8, classes: int = 10) -> nn.Module:
    return nn.Sequential(nn.Linear(in_dim, 32), nn.Tanh(), nn.Linear(32, classes))


def make_class_data(n: int = 256, n_eval: int = 51, in_dim: int = 8, classes: int = 10):
    """(train, eval) of points labelled by the largest of ``classes`` random projections;
    an odd eval set, so two ranks hold different numbers of samples."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n + n_eval, in_dim, generator=g)
    y = (x @ torch.randn(in_dim, classes, generator=g)).argmax(-1)
    return TensorDataset(x[:n], y[:n]), TensorDataset(x[n:], y[n:])


def true_class_prob(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """An eval metric of the user's own: the mean softmax probability of the true class."""
    return output.softmax(-1).gather(-1, target[:, None]).mean()


class _KillOnce(Dataset):
    """Wraps a dataset; on the first attempt, rank ``rank`` SIGKILLs itself after
    ``after`` items, like a node losing a process. Restarted ranks run normally."""

    def __init__(self, inner: Dataset, rank: int, after: int) -> None:
        self.inner, self.rank, self.after, self.seen = inner, rank, after, 0

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and os.environ.get("RANK") == str(self.rank):
            self.seen += 1
            if self.seen > self.after:
                os.kill(os.getpid(), signal.SIGKILL)
        return self.inner[i]


def make_data_killing_rank(rank: int = 1, after: int = 100, n: int = 256):
    return _KillOnce(make_data(n), rank, after)


class _Faulty(Dataset):
    """Wraps a dataset; on rank ``rank`` (RANK, 0 in a single process) the items from
    the ``after``-th read on are poisoned with NaN (``nan`` of them) or the ``after``-th
    read sleeps ``sleep`` seconds (a stalled rank)."""

    def __init__(self, inner: Dataset, rank: int, after: int, nan: int, sleep: float) -> None:
        self.inner, self.rank, self.after = inner, rank, after
        self.nan, self.sleep, self.seen = nan, sleep, 0

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        x, y = self.inner[i]
        if int(os.environ.get("RANK", "0")) != self.rank:
            return x, y
        self.seen += 1
        if self.sleep and self.seen == self.after:
            time.sleep(self.sleep)
        if self.after <= self.seen < self.after + self.nan:
            x = torch.full_like(x, float("nan"))
        return x, y


class _Slow(Dataset):
    """Each item takes ``delay`` seconds to read, on rank ``rank`` (every rank if None)."""

    def __init__(self, inner: Dataset, delay: float, rank: int | None) -> None:
        self.inner, self.delay, self.rank = inner, delay, rank

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        if self.rank is None or int(os.environ.get("RANK", "0")) == self.rank:
            time.sleep(self.delay)
        return self.inner[i]


def make_slow_data(delay: float = 0.002, rank: int | None = None, n: int = 256):
    return _Slow(make_data(n), delay, rank)


def make_data_nan_on_rank(rank: int = 1, after: int = 100, nan: int = 1, n: int = 256):
    return _Faulty(make_data(n), rank, after, nan, 0.0)


def make_data_stalling_rank(rank: int = 1, after: int = 100, sleep: float = 5.0,
                            n: int = 256):
    return _Faulty(make_data(n), rank, after, 0, sleep)


class _Recording(Dataset):
    """Appends every index a rank asks for to ``<out>/rank<R>.txt`` (num_workers=0 reads
    exactly what training consumes); rank ``kill_rank`` SIGKILLs itself after
    ``kill_after`` items."""

    def __init__(self, inner: Dataset, out: str, kill_rank: int, kill_after: int) -> None:
        self.inner, self.out, self.kill_rank, self.kill_after = inner, out, kill_rank, kill_after
        self.seen = 0

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        if _in_preflight():  # the launcher's one batch before ranks start: not training
            return self.inner[i]
        rank = int(os.environ.get("RANK", 0))
        self.seen += 1
        if rank == self.kill_rank and self.seen > self.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        os.makedirs(self.out, exist_ok=True)
        with open(os.path.join(self.out, f"rank{rank}.txt"), "a") as f:
            f.write(f"{i}\n")
        return self.inner[i]


def _in_preflight() -> bool:
    """Whether gpufleet's preflight (gpufleet.train.preflight.preflight) is reading."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "preflight" and code.co_filename.endswith(
                os.path.join("gpufleet", "train", "preflight.py")):
            return True
        frame = frame.f_back
    return False


def make_data_recording(out: str, kill_rank: int = -1, kill_after: int = 0, n: int = 256):
    return _Recording(make_data(n), out, kill_rank, kill_after)


class VarLenData(Dataset):
    """Token sequences of log-normal lengths; the label is whether token 1 is frequent.
    Exposes ``lengths`` for token-budget batching."""

    def __init__(self, n: int = 400, vocab: int = 16, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        lengths = torch.exp(torch.randn(n, generator=g) * 0.8 + 3.0).clamp(2, 200).long()
        self.items = [torch.randint(0, vocab, (int(k),), generator=g) for k in lengths]
        self.lengths = [int(k) for k in lengths]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        x = self.items[i]
        return x, int((x == 1).float().mean() > 1 / 16)


class BagModel(nn.Module):
    def __init__(self, vocab: int = 16, dim: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=0)
        self.out = nn.Linear(dim, 2)

    def forward(self, x):
        return self.out(self.emb(x).mean(dim=1))


def make_conv_model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, 1))


def make_image_data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, 8, 8, generator=g)
    return TensorDataset(x, x.mean(dim=(1, 2, 3)).unsqueeze(1))


def sgd_two_groups(params):
    """An optimizer factory of the user's own (``--optim.factory toyjob:sgd_two_groups``):
    SGD with momentum, the first layer's weight at a higher learning rate."""
    params = list(params)
    return torch.optim.SGD([{"params": params[:1], "lr": 0.2}, {"params": params[1:]}],
                           lr=0.05, momentum=0.9)


def halve_every_3(optimizer):
    """A scheduler factory of the user's own (``--sched.factory toyjob:halve_every_3``)."""
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)


class StopOnOneRank(Callback):
    """A callback (importable by launched ranks) with which only rank ``rank`` asks the
    run to stop after ``step``."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_step_end(self, view, step):
        if view.env.rank == self.rank and step == self.step:
            view.request_stop(f"rank {self.rank} asked")


def plain_sgd(params):
    """Plain SGD at lr 0.2: an update that is linear in the gradient."""
    return torch.optim.SGD(params, lr=0.2)


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps ``delay`` seconds (extra work in backward)."""

    @staticmethod
    def forward(ctx, x, delay):
        ctx.delay = delay
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.delay)
        return grad, None


class _BackwardStraggler(nn.Module):
    def __init__(self, inner: nn.Module, delay: float, after: int = 0) -> None:
        super().__init__()
        self.inner, self.delay, self.after, self.calls = inner, delay, after, 0

    def forward(self, x):
        out = self.inner(x)
        self.calls += 1
        slow = self.delay and self.calls > self.after
        return _SlowBackward.apply(out, self.delay) if slow else out


def make_model_slow_backward(rank: int = 1, delay: float = 0.015, after: int = 0
                             ) -> nn.Module:
    """The toy model; on rank ``rank`` its backward does ``delay`` s of extra work (from
    its ``after + 1``-th forward on)."""
    mine = int(os.environ.get("RANK", "0")) == rank
    return _BackwardStraggler(make_model(), delay if mine else 0.0, after)


class _ForwardStraggler(nn.Module):
    def __init__(self, inner: nn.Module, delay: float) -> None:
        super().__init__()
        self.inner, self.delay = inner, delay

    def forward(self, x):
        if self.delay:
            time.sleep(self.delay)
        return self.inner(x)


def make_model_slow_forward(rank: int = 1, delay: float = 0.015) -> nn.Module:
    """The toy model; on rank ``rank`` its forward does ``delay`` s of extra work."""
    mine = int(os.environ.get("RANK", "0")) == rank
    return _ForwardStraggler(make_model(), delay if mine else 0.0)


def make_model_slow_optimizer(rank: int = 1, delay: float = 0.015) -> nn.Module:
    """The toy model; on rank ``rank`` every optimizer step takes ``delay`` s longer."""
    if int(os.environ.get("RANK", "0")) == rank:
        register_optimizer_step_post_hook(
            lambda *_: time.sleep(delay))
    return make_model()


class _HeldForward(nn.Module):
    """The toy model; its ``at``-th forward on rank ``rank`` sleeps ``sleep`` s."""

    def __init__(self, rank: int, at: int, sleep: float) -> None:
        super().__init__()
        self.inner = make_model()
        self.mine = int(os.environ.get("RANK", "-1")) == rank  # -1: the preflight
        self.at, self.sleep, self.calls = at, sleep, 0

    def forward(self, x):
        self.calls += self.mine
        if self.mine and self.calls == self.at:
            time.sleep(self.sleep)  # held here: the hang report names this line
        return self.inner(x)


class _RankZeroCollective(nn.Module):
    """The toy model with a user's bug: its ``at``-th forward makes an all-reduce on
    rank 0 only. It goes over a gloo group of its own, so that the ranks hang as they
    would on NCCL (on one gloo group the sizes would not match and gloo would fail at
    once)."""

    def __init__(self, at: int, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.at, self.calls, self.group = at, 0, None

    def forward(self, x):
        if torch.distributed.is_initialized():  # not in the single-process preflight
            self.calls += 1
            if self.group is None:  # every rank, in its first forward
                self.group = torch.distributed.new_group(backend="gloo")
            if self.calls == self.at and torch.distributed.get_rank() == 0:
                torch.distributed.all_reduce(torch.ones(1), group=self.group)  # the bug
        return self.inner(x)


def make_model_held_then_rank0_collective(held_at: int = 5, sleep: float = 6.0,
                                          lone_at: int = 8) -> nn.Module:
    """The toy model with two hangs: rank 1 sleeps ``sleep`` s in its ``held_at``-th
    forward; rank 0's ``lone_at``-th forward makes an all-reduce on rank 0 only (a hang
    that does not end)."""
    return _RankZeroCollective(lone_at, _HeldForward(1, held_at, sleep))


class _StuckInNative(nn.Module):
    """The toy model; its ``at``-th forward on rank ``rank`` sleeps ``sleep`` s in libc
    while holding the interpreter lock (no Python thread of the rank runs meanwhile)."""

    def __init__(self, rank: int, at: int, sleep: int) -> None:
        super().__init__()
        self.inner = make_model()
        self.mine = int(os.environ.get("RANK", "-1")) == rank
        self.at, self.sleep, self.calls = at, sleep, 0

    def forward(self, x):
        self.calls += self.mine
        if self.mine and self.calls == self.at:
            import ctypes

            ctypes.PyDLL(None).sleep(self.sleep)  # stuck in native code, lock held
        return self.inner(x)


def make_model_stuck_in_native(rank: int = 1, at: int = 5, sleep: int = 60) -> nn.Module:
    """The toy model; rank ``rank``'s ``at``-th forward is stuck in native code."""
    return _StuckInNative(rank, at, sleep)


class _SleepOnRank(nn.Module):
    """Identity; on rank ``rank`` each forward also sleeps ``delay`` seconds."""

    def __init__(self, rank: int, delay: float) -> None:
        super().__init__()
        self.delay = delay if int(os.environ.get("RANK", "-1")) == rank else 0.0

    def forward(self, x):
        if self.delay:
            time.sleep(self.delay)
        return x


def make_model_slow_stage(rank: int = 1, delay: float = 0.003) -> nn.Module:
    """The toy model as a plain sequence (a pipeline can cut it); the stage on rank
    ``rank`` sleeps ``delay`` s more per micro-batch forward (twice, if it holds both
    sleeping layers). ``delay = 0``: a clean pipeline."""
    return nn.Sequential(nn.Linear(8, 16), _SleepOnRank(rank, delay), nn.Tanh(),
                         nn.Linear(16, 16), _SleepOnRank(rank, delay), nn.Tanh(),
                         nn.Linear(16, 1))


class _ReadLog(Dataset):
    """Appends ``<index> <world size>`` for every item read to ``<out>/<pid>.txt`` (the
    world size as this process sees it when it reads: WORLD_SIZE, which an in-process
    recovery updates), each read taking ``delay`` seconds (``alone_delay`` while the world
    is one rank, when given: a survivor that waits for a node's return does not finish
    first on a loaded machine). ``die_at``: rank 1 kills its
    launcher (the node's elastic agent) and itself with no cleanup when it is about to
    read its ``die_at``-th item: the loss of its node at a chosen point of the run."""

    def __init__(self, inner: Dataset, out: str, delay: float, die_at: int = 0,
                 alone_delay: float | None = None) -> None:
        self.inner, self.out, self.delay, self.die_at = inner, out, delay, die_at
        self.alone_delay = delay if alone_delay is None else alone_delay
        self.reads = 0

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        if _in_preflight():
            return self.inner[i]
        self.reads += 1
        if self.die_at and self.reads == self.die_at and os.environ.get("RANK") == "1":
            os.kill(os.getppid(), signal.SIGKILL)
            os._exit(1)
        alone = os.environ.get("WORLD_SIZE", "1") == "1"
        time.sleep(self.alone_delay if alone else self.delay)
        os.makedirs(self.out, exist_ok=True)
        with open(os.path.join(self.out, f"{os.getpid()}.txt"), "a") as f:
            f.write(f"{i} {os.environ.get('WORLD_SIZE', '1')}\n")
        return self.inner[i]


def make_data_read_log(out: str, delay: float = 0.0, n: int = 256, die_at: int = 0,
                       alone_delay: float | None = None):
    return _ReadLog(make_data(n), out, delay, die_at, alone_delay)
