"""Sharded state put together again for in-process recovery, piece by piece: the
skeleton a model is built from again, and the joining of FSDP2's shards (cut by real
FSDP2 over 3 gloo ranks). The whole recovery under fsdp and hsdp runs on the namespace
bed (tests/cluster/test_recovery.py)."""

from __future__ import annotations

import io

import torch
from torch import nn

from gpufleet.core.tree import map_tensors
from gpufleet.fault.host_state import PIECE, HostState
from gpufleet.fault.snapshot_ring import Held, newest_sharded
from gpufleet.launch import DistEnv, destroy_process_group, init_process_group, launch
from gpufleet.train.recovery.reshard import assemble, materialize, meta_copy, shard_position


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.embed.weight  # tied, as a GPT's
        self.register_buffer("mask", torch.arange(3.0), persistent=False)


def test_the_skeleton_holds_no_weights_keeps_ties_and_buffers():
    model = Tied()
    skeleton = meta_copy(model)
    assert all(p.is_meta for p in skeleton.parameters())
    assert skeleton.head.weight is skeleton.embed.weight
    assert torch.equal(skeleton.mask, model.mask)  # not in the state dict: kept
    assert not model.embed.weight.is_meta  # the model itself is untouched
    built = materialize(skeleton, torch.device("cpu"))
    assert not any(p.is_meta for p in built.parameters())
    assert built.head.weight is built.embed.weight
    assert len(list(built.parameters())) == 1
    built.load_state_dict(model.state_dict())
    assert torch.equal(built.head.weight, model.embed.weight)
    assert all(p.is_meta for p in skeleton.parameters())  # reusable for the next loss


def test_pieces_join_in_shard_order_and_the_rest_comes_from_the_first():
    full = torch.arange(10.0).reshape(5, 2)
    pieces = torch.chunk(full, 3)  # 2, 2 and 1 rows
    states = [{"model": {"w": {PIECE: p}}, "step": torch.tensor(4), "epoch": 1}
              for p in pieces]
    states[2]["step"] = torch.tensor(99)  # not a shard: only the first position counts
    whole = assemble(states)
    assert torch.equal(whole["model"]["w"], full)
    assert whole["step"].item() == 4 and whole["epoch"] == 1


def test_an_empty_last_piece_joins_too():
    full = torch.ones(2, 3)
    states = [{"w": {PIECE: p}} for p in (full[:1], full[1:], full[2:])]
    assert torch.equal(assemble(states)["w"], full)


def test_hsdp_positions_follow_the_shard_dimension():
    dims = type("Dims", (), {"dp_shard": 2})()
    assert [shard_position(r, dims) for r in range(4)] == [0, 1, 0, 1]


def test_newest_sharded_takes_an_older_step_when_the_newest_is_incomplete():
    held = [Held(0, 0, 8), Held(0, 1, 7), Held(0, 0, 7)]  # rank 1's copy of 8 never came
    assert newest_sharded(held, [0], [0, 1]).step == 7
    assert newest_sharded([Held(0, 0, 8)], [0], [0, 1]) is None


def _shard_and_snapshot() -> dict:
    """One rank: FSDP2 over a model, then this rank's state as a snapshot holds it, read
    back with its shards marked (cloned out of the snapshot's buffer)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    env = DistEnv.detect()
    init_process_group(env, "gloo", timeout_s=60)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 2))  # 5 rows: 2, 2 and 1
        whole = {k: v.clone() for k, v in model.state_dict().items()}
        fully_shard(model, mesh=init_device_mesh("cpu", (env.world_size,)))
        held = HostState()
        tensors = held.fit({"model": model.state_dict()}, "cpu", step=1, owner=env.rank)
        held.copy(tensors)
        held.done()
        state = held.state(pieces=True)
        # As bytes: tensors handed back through multiprocessing would be shared memory
        # that ends with the rank.
        out = io.BytesIO()
        torch.save({"whole": whole, "held": map_tensors(state, torch.clone)}, out)
        return out.getvalue()
    finally:
        destroy_process_group()


def test_fsdp2_shards_of_three_ranks_join_into_the_whole_model():
    got = {rank: torch.load(io.BytesIO(data), weights_only=True)
           for rank, data in launch(_shard_and_snapshot, nproc=3, launcher="spawn").items()}
    assert [tuple(got[r]["held"]["model"]["0.weight"][PIECE].shape) for r in range(3)] == \
        [(2, 4), (2, 4), (1, 4)]
    joined = assemble([got[r]["held"] for r in range(3)])
    for name, tensor in got[0]["whole"].items():
        assert torch.equal(joined["model"][name], tensor), name
