"""In-memory snapshots (fault.snapshot_every): the host copy, the memory bound, the ring
of partners, and a real two-rank run (gloo on CPU) whose snapshots hold each other's
state exactly as it was at the step."""

from __future__ import annotations

import io
import os
import threading

import pytest
import torch
from torch.nn import functional as F

from gpufleet.fault.host_state import HostState, decode_layout, encode_layout
from gpufleet.fault.snapshot import Snapshotter, storage_of
from gpufleet.fault.snapshot_ring import Held, newest_complete, ring_targets, sources_of
from gpufleet.launch import launch


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def _state(scale: float = 1.0) -> dict:
    return {"model": {"w": torch.full((3, 4), scale), "b": torch.arange(4).double(),
                      "mask": torch.tensor([True, False])},
            "optimizer": {"state": {0: {"step": torch.tensor(5.0),
                                        "exp_avg": torch.ones(3, 4, dtype=torch.bfloat16)}},
                          "param_groups": [{"lr": 0.1, "params": [0]}]},
            "sampler": {"epoch": 1, "samples": 96}, "rng": (3, [torch.ones(2, dtype=torch.int64)])}


def test_a_state_goes_through_the_host_buffer_and_its_layout_unchanged():
    state = _state()
    held = HostState()
    tensors = held.fit(state, "cpu", step=7, owner=2)
    held.copy(tensors)
    held.done()
    assert (held.step, held.owner) == (7, 2) and _same(held.state(), state)
    # The layout travels as bytes that load with weights_only=True.
    step, owner, skeleton, leaves = decode_layout(encode_layout(7, 2, held.skeleton,
                                                                held.leaves))
    assert (step, owner, skeleton, leaves) == (7, 2, held.skeleton, held.leaves)
    assert all(leaf.offset % 64 == 0 for leaf in leaves)


def test_memory_stays_one_own_copy_reused_plus_one_partner_copy():
    snap = Snapshotter(0, torch.device("cpu"))
    for step in (2, 4, 6):  # the same shapes: the buffer is allocated once
        state = _state(float(step))
        snap.take(step, state, set())
        assert snap.wait(30)
    own_bytes = snap.own.nbytes
    assert snap.own.allocations == 1 and snap.host_bytes == own_bytes > 0
    assert _same(snap.own.state(), _state(6.0))
    # The state grows (an optimizer's state appears): the old buffer goes first.
    bigger = {**_state(), "extra": torch.zeros(1000)}
    snap.take(8, bigger, set())
    assert snap.wait(30)
    assert snap.own.allocations == 2
    assert snap.own.nbytes == -(-own_bytes // 64) * 64 + 4000  # the new tensor, aligned
    assert snap.host_bytes == snap.own.nbytes
    # A partner's copy of the same size is held in a buffer of its own, once.
    snap.partner.adopt(snap.own.layout_bytes(), snap.own.nbytes)
    snap.partner.buffer.copy_(snap.own.buffer)
    snap.partner.done()
    assert snap.host_bytes == 2 * snap.own.nbytes
    assert [(h.owner, h.step) for h in snap.held()] == [(0, 8), (0, 8)]


def test_the_optimizer_step_waits_for_the_background_copy():
    """Tensors named as changed only by the optimizer are copied in the background; the
    training thread's wait_copied returns only once they are in, and the copy holds
    the values of the step it was taken at."""
    snap = Snapshotter(0, torch.device("cpu"))
    weights = torch.ones(1000)
    buffers = torch.zeros(3)
    started, release = threading.Event(), threading.Event()
    original = snap.own.copy

    def slow_copy(tensors, indices=None, non_blocking=False):
        if indices and threading.current_thread() is not threading.main_thread():
            started.set()
            release.wait(30)
        original(tensors, indices, non_blocking)

    snap.own.copy = slow_copy
    snap.take(1, {"w": weights, "buf": buffers}, {storage_of(weights)})
    assert started.wait(30)
    buffers.add_(1)  # the next forward may change a buffer: it was copied already
    done = threading.Thread(target=snap.wait_copied)
    done.start()
    done.join(0.2)
    assert done.is_alive()  # the optimizer step is held back
    release.set()
    done.join(30)
    weights.add_(1)  # the optimizer step
    assert snap.wait(30)
    assert _same(snap.own.state(), {"w": torch.ones(1000), "buf": torch.zeros(3)})


def test_partners_ring_by_node():
    two_nodes = [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert ring_targets(two_nodes) == [2, 3, 0, 1]
    assert ring_targets([(n, loc) for n in range(3) for loc in range(2)]) == [2, 3, 4, 5, 0, 1]
    assert ring_targets([(0, 0), (0, 1), (0, 2)]) == [1, 2, 0]  # one node: the next rank
    assert ring_targets([(0, 0)]) == [0]
    # Nodes of different sizes: still one target and one source each.
    targets = ring_targets([(0, 0), (0, 1), (0, 2), (1, 0)])
    assert sorted(targets) == [0, 1, 2, 3] and sources_of(targets)[targets[2]] == 2


def _held(own: dict[int, int], partner: dict[int, int], targets: list[int]) -> list[Held]:
    """What every rank reports: its own copy's step and the step of the copy it holds
    for its source (None: not complete)."""
    sources = sources_of(targets)
    held = [Held(r, r, s) for r, s in own.items() if s is not None]
    return held + [Held(r, sources[r], s) for r, s in partner.items() if s is not None]


def test_assembly_takes_a_lost_nodes_ranks_from_their_partners():
    targets = ring_targets([(0, 0), (0, 1), (1, 0), (1, 1)])  # [2, 3, 0, 1]
    everyone = _held({r: 8 for r in range(4)}, {r: 8 for r in range(4)}, targets)
    got = newest_complete(everyone, targets, survivors=[0, 1])  # node 1 lost
    assert got.step == 8 and got.sources == {0: 0, 1: 1, 2: 0, 3: 1}
    assert newest_complete(everyone, targets, range(4)).sources == {r: r for r in range(4)}
    # Node 0 lost instead: ranks 0 and 1 are held by ranks 2 and 3.
    assert newest_complete(everyone, targets, [2, 3]).sources == {0: 2, 1: 3, 2: 2, 3: 3}


def test_a_snapshot_is_complete_only_with_both_copies_of_the_same_step():
    targets = [2, 3, 0, 1]
    # Rank 3's own copy of step 8 is in, but rank 1 still holds its copy of step 4
    # (the exchange of step 8 had not reached it): step 8 is not complete.
    held = _held({0: 8, 1: 8, 2: 8, 3: 8}, {0: 8, 1: 4, 2: 8, 3: 8}, targets)
    assert newest_complete(held, targets, range(4)) is None
    # Once the copy is in, it is.
    held = _held({0: 8, 1: 8, 2: 8, 3: 8}, {0: 8, 1: 8, 2: 8, 3: 8}, targets)
    assert newest_complete(held, targets, range(4)).step == 8
    # A copy being received (not complete) does not count either...
    held = _held({0: 8, 1: 8, 2: 8, 3: 8}, {0: 8, 1: None, 2: 8, 3: 8}, targets)
    assert newest_complete(held, targets, range(4)) is None
    # ...but where its holder was lost, the owner's own copy is all there is.
    assert newest_complete(held, targets, [0, 2, 3]).step == 8
    # Ranks at different steps restore nothing.
    held = _held({0: 8, 1: 8, 2: 4, 3: 8}, {0: 8, 1: 8, 2: 8, 3: 8}, targets)
    assert newest_complete(held, targets, range(4)) is None


def test_both_copies_of_a_rank_lost_leaves_no_snapshot():
    targets = ring_targets([(0, 0), (1, 0), (2, 0)])  # [1, 2, 0]
    held = _held({r: 6 for r in range(3)}, {r: 6 for r in range(3)}, targets)
    assert newest_complete(held, targets, [0, 1]).sources == {0: 0, 1: 1, 2: 0}
    assert newest_complete(held, targets, [0]) is None  # rank 1's copies: ranks 1 and 2


STEPS, EVERY, BATCH = 7, 3, 8


def _two_rank_run(out_dir: str, strategy: str = "auto") -> bytes:
    """One rank of a 2-rank DDP run with a snapshot every 3 of 7 steps. Returns the
    state it captured at each snapshot (cloned then), the partner copy it holds, and
    what its snapshots hold in memory."""
    import toyjob
    from gpufleet.config import load_config
    from gpufleet.core.tree import map_tensors
    from gpufleet.fault.host_state import join_state, local_tensor, split_state
    from gpufleet.train.engine.build import build_run
    from gpufleet.train.loop import Trainer

    torch.manual_seed(0)
    cfg = load_config(overrides={
        "run.out_dir": out_dir, "run.max_steps": STEPS, "fault.snapshot_every": EVERY,
        "data.batch_size": BATCH, "data.num_workers": 0, "log.progress": "off",
        "log.every": 1, "checkpoint.save_final": False, "monitor.report": False,
        "monitor.diagnose": False, "fault.watchdog": False, "dist.timeout": 60,
        "parallel.strategy": strategy})
    run = build_run(cfg, toyjob.make_model(dropout=0.3), toyjob.make_data(),
                    loss_fn=F.mse_loss)
    snap = run.monitors.snapshots
    captured, capture = {}, snap.capture

    def recording_capture():
        state, storages = capture()
        tensors: list = []
        skeleton = split_state(state, tensors)
        # As it lives on this rank (a DTensor's local shard under fsdp), cloned now.
        captured[run.state.step] = join_state(skeleton,
                                              [local_tensor(t).clone() for t in tensors])
        return state, storages

    snap.capture = recording_capture
    Trainer(run).fit()
    held = snap.snapshotter
    partner = held.partner.state() if held.partner.step is not None else None
    result = {"captured": captured, "partner": map_tensors(partner, torch.clone),
            "partner_of": (held.partner.owner, held.partner.step),
            "own": (held.own.owner, held.own.step), "own_bytes": held.own.nbytes,
            "partner_bytes": held.partner.nbytes, "host_bytes": held.host_bytes,
            "allocations": (held.own.allocations, held.partner.allocations),
            "held": [(h.owner, h.step) for h in held.held()],
            "final_w": local_tensor(run.strategy.unwrap(run.model)[0].weight).detach().clone()}
    # Tensors go back as bytes: shared-memory handles die with the rank's process.
    out = io.BytesIO()
    torch.save(result, out)
    return out.getvalue()


def _ranks(tmp_path, monkeypatch, strategy: str) -> dict[int, dict]:
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [tests, os.environ.get("PYTHONPATH", "")]))
    return {rank: torch.load(io.BytesIO(data), weights_only=True) for rank, data in
            launch(_two_rank_run, (str(tmp_path / "runs"), strategy), nproc=2,
                   launcher="spawn").items()}


def test_two_fsdp_ranks_hold_each_others_snapshot_as_it_was_at_the_step(tmp_path,
                                                                        monkeypatch):
    strategy = "fsdp"  # shards: a lost rank's state is only in its partner's copy
    ranks = _ranks(tmp_path, monkeypatch, strategy)
    last = STEPS - STEPS % EVERY  # step 6
    for rank, other in ((0, 1), (1, 0)):
        mine, theirs = ranks[rank], ranks[other]
        assert sorted(mine["captured"]) == [EVERY, last]
        assert mine["own"] == (rank, last) and mine["partner_of"] == (other, last)
        expected = theirs["captured"][last]
        assert _same(mine["partner"], expected)  # torch.equal, tensor by tensor
        # The data position and the RNG came along: the other rank's, at step 6.
        assert mine["partner"]["sampler"]["samples"] == last * BATCH * 2
        assert mine["partner"]["step"] == last and mine["partner"]["rank"] == other
        assert _same(mine["partner"]["rng"]["torch"], expected["rng"]["torch"])
        # Training went on after the snapshot: the weights moved on at step 7.
        assert not torch.equal(expected["model"]["0.weight"], theirs["final_w"])
        # Each rank holds its shard: half the rows of a weight.
        assert expected["model"]["0.weight"].shape == (8, 8)
        # Bounded: its own copy plus one partner's, each buffer allocated once.
        assert mine["host_bytes"] == mine["own_bytes"] + mine["partner_bytes"]
        assert mine["partner_bytes"] == theirs["own_bytes"] > 0
        assert mine["allocations"] == (1, 1)
        assert set(mine["held"]) == {(rank, last), (other, last)}


@pytest.mark.slow  # ddp snapshots: the network bed's ddp recovery keeps them in the default run
def test_ddp_ranks_keep_their_whole_snapshot_to_themselves(tmp_path, monkeypatch):
    """Every ddp rank holds the whole state, and a survivor restores its own copy: a
    partner's copy would be host memory and network for nothing, so none is sent."""
    ranks = _ranks(tmp_path, monkeypatch, "ddp")
    last = STEPS - STEPS % EVERY
    for rank in (0, 1):
        mine = ranks[rank]
        assert sorted(mine["captured"]) == [EVERY, last]
        assert mine["own"] == (rank, last) and mine["held"] == [(rank, last)]
        assert mine["partner_bytes"] == 0 and mine["host_bytes"] == mine["own_bytes"] > 0
        assert mine["allocations"] == (1, 0)


def test_snapshots_are_on_by_default_only_where_measured_and_recovered_in_process():
    from gpufleet.config import load_config
    from gpufleet.errors import ConfigError
    from gpufleet.resolve import Machine, resolve

    assert load_config().fault.snapshot_every == -1  # auto: decided when resolved
    cpu, gpu = Machine(cuda=False, gpus=0, bf16=False), Machine(cuda=True, gpus=8, bf16=True)

    def every(machine: Machine, nnodes: str, **overrides) -> int:
        cfg = load_config(overrides={"parallel.strategy": "ddp", "dist.nnodes": nnodes,
                                     **overrides})
        return resolve(cfg, machine, 4, 2).fault.snapshot_every

    # An elastic node range on CPUs, a strategy recovered in process: every 10 steps.
    assert every(cpu, "1:2") == 10
    assert every(cpu, "2:3", **{"parallel.strategy": "fsdp"}) == 10
    # A fixed node count (the ranks left cannot go on), GPUs (not measured there yet), a
    # strategy restarted from disk, or in-process recovery off: off.
    assert every(cpu, "2") == every(cpu, "1") == 0
    assert every(gpu, "1:2", **{"run.device": "cuda"}) == 0
    assert every(cpu, "1:2", **{"parallel.strategy": "zero1"}) == 0
    assert every(cpu, "1:2", **{"fault.recover_in_process": False}) == 0
    # What the user sets is kept as it is.
    assert every(cpu, "1", **{"fault.snapshot_every": 3}) == 3
    assert every(cpu, "1:2", **{"fault.snapshot_every": 0}) == 0
    with pytest.raises(ConfigError, match="snapshot_every"):
        load_config(overrides={"fault.snapshot_every": -2})
