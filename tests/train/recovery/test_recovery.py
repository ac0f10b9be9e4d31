"""In-process recovery's parts on their own: who goes on (ranks reporting to a real
store from threads), which strategies it serves, which errors it takes for a lost peer.
The whole recovery runs on the namespace bed (tests/cluster/test_recovery.py)."""

from __future__ import annotations

import socket
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from gpufleet.config import Config
from gpufleet.data.bucket import BucketBatchSampler
from gpufleet.data.sampler import ResumableDistributedSampler
from gpufleet.data.stream_shard import StreamShard
from gpufleet.fault.snapshot_ring import Held, newest_replicated
from gpufleet.launch import DistEnv
from gpufleet.parallel import build_strategy, strategy_class
from gpufleet.parallel.dims import plan_for
from gpufleet.train.recovery.disconnect import cut_connections, cut_old_group, store_endpoint
from gpufleet.train.recovery.recovery import (
    Membership,
    Recovery,
    RecoveryFailed,
    is_peer_loss,
    not_replicated,
)


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def recoveries(store, world: int, window_s: float = 0.3,
               dp_shard: int | None = None, nnodes: str = "1:4") -> list[Recovery]:
    """One Recovery per rank of ``world`` (a rank a node), each with a client of its own
    to ``store`` (the run holds only what agreeing reads); ``dp_shard``: the state is
    sharded over that many ranks (fsdp: ``world``; hsdp: ranks per node), else
    replicated; ``nnodes``: the run's node range."""
    cfg = SimpleNamespace(fault=SimpleNamespace(recover_window_s=window_s),
                          dist=SimpleNamespace(timeout=20, nnodes=nnodes))
    parts = [SimpleNamespace(source=object())] if dp_shard else []
    strategy = SimpleNamespace(dims=SimpleNamespace(dp_shard=dp_shard or 1))
    return [Recovery(SimpleNamespace(env=DistEnv(rank=r, world_size=world), cfg=cfg,
                                     monitors=SimpleNamespace(watchdog=None), parts=parts,
                                     strategy=strategy),
                     dist.TCPStore("127.0.0.1", store.port, is_master=False), "gloo")
            for r in range(world)]


def agree(ranks: list[Recovery], steps: dict[int, int | list[Held] | None]
          ) -> dict[int, object]:
    """Every rank in ``steps`` reports its own snapshot's step (or the copies it holds)
    at once, from its own thread; what each one was told (a Membership, or the
    RecoveryFailed it raised)."""
    told: dict[int, object] = {}

    def report(rank: int) -> None:
        got = steps[rank]
        held = got if isinstance(got, list) else [] if got is None else [Held(rank, rank, got)]
        try:
            told[rank] = ranks[rank]._agree(held)
        except RecoveryFailed as e:
            told[rank] = e
    threads = [threading.Thread(target=report, args=(r,)) for r in steps]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return told


def test_the_ranks_that_report_go_on_and_a_second_loss_meets_in_new_keys(store):
    ranks = recoveries(store, 3)
    told = agree(ranks, {0: 6, 1: 6})  # rank 2's node is gone
    own = {0: 0, 1: 1}  # each survivor restores its own copy
    assert told == {0: Membership((0, 1), 6, own), 1: Membership((0, 1), 6, own)}
    # The next generation: the two left, now ranks 0 and 1 of 2, lose rank 1.
    again = recoveries(store, 2)
    for rank in again:
        rank.generation = 1
    assert agree(again, {0: 9}) == {0: Membership((0,), 9, {0: 0})}


def test_sharded_ranks_go_on_from_their_own_and_the_lost_ranks_partner_copies(store):
    # fsdp over 4 ranks, 2 a node; node 1 (ranks 2, 3) lost: ranks 0 and 1 hold their
    # own copies and, from the ring, rank 2's and rank 3's.
    told = agree(recoveries(store, 4, dp_shard=4),
                 {0: [Held(0, 0, 7), Held(0, 2, 7)], 1: [Held(1, 1, 7), Held(1, 3, 7)]})
    assert told[0] == told[1] == Membership((0, 1), 7, {0: 0, 1: 1, 2: 0, 3: 1})


def test_sharded_ranks_without_a_lost_ranks_copy_of_the_step_fall_back(store):
    # Rank 2's copy on rank 0 is a step behind (the exchange was cut short).
    told = agree(recoveries(store, 4, dp_shard=4),
                 {0: [Held(0, 0, 7), Held(0, 2, 6)], 1: [Held(1, 1, 7), Held(1, 3, 7)]})
    assert told[0] == told[1] == Membership((0, 1), None)


def test_hsdp_ranks_need_only_one_copy_of_each_shard(store):
    # hsdp, 2 nodes of 2 (shards 0 and 1 on each): node 1 lost, node 0 has both shards.
    told = agree(recoveries(store, 4, dp_shard=2), {0: [Held(0, 0, 5)], 1: [Held(1, 1, 5)]})
    assert told[0] == Membership((0, 1), 5, {0: 0, 1: 1})


def test_snapshots_of_different_steps_give_no_step_to_go_on_from(store):
    told = agree(recoveries(store, 3), {0: 6, 1: 5})
    assert told[0] == told[1] == Membership((0, 1), None)


def test_every_rank_reporting_is_not_a_lost_node(store):
    told = agree(recoveries(store, 2), {0: 4, 1: 4})
    assert all(isinstance(t, RecoveryFailed) and "no rank was lost" in str(t)
               for t in told.values())


def test_fewer_nodes_left_than_the_range_allows_fall_back(store):
    # 4 nodes of a 3:4 range: one lost leaves 3 (go on); two lost leave 2 (the agents
    # wait for a third).
    one = agree(recoveries(store, 4, nnodes="3:4"), {0: 5, 1: 5, 2: 5})
    assert one[0] == Membership((0, 1, 2), 5, {0: 0, 1: 1, 2: 2})
    again = recoveries(store, 4, nnodes="3:4")
    for rank in again:
        rank.generation = 1
    two = agree(again, {0: 5, 1: 5})
    assert all(isinstance(t, RecoveryFailed) and "2 node(s) left, fewer than the 3" in str(t)
               for t in two.values()), two


def test_a_rank_reporting_after_the_decision_falls_back(store):
    ranks = recoveries(store, 3, window_s=0.1)
    own = {0: 0, 1: 1}
    assert agree(ranks, {0: 3, 1: 3}) == {0: Membership((0, 1), 3, own),
                                          1: Membership((0, 1), 3, own)}
    late = agree(ranks, {2: 3})[2]
    assert isinstance(late, RecoveryFailed) and "closed the membership [0, 1]" in str(late)


def test_newest_replicated_needs_every_survivors_own_copy_of_one_step():
    held = [Held(0, 0, 6), Held(0, 2, 5), Held(1, 1, 6), Held(1, 3, 5)]
    assert newest_replicated(held, [0, 1]).sources == {0: 0, 1: 1}
    assert newest_replicated(held, [0, 1]).step == 6
    assert newest_replicated(held, [0, 1, 2]) is None  # rank 2 holds no own copy
    assert newest_replicated([Held(0, 0, 6), Held(1, 1, 5)], [0, 1]) is None


@pytest.mark.parametrize("name, why, reshards", [
    ("ddp", "", False), ("fsdp", "shards the model and optimizer", False),
    ("hsdp", "shards the model and optimizer", False), ("fsdp", "", True), ("hsdp", "", True),
    ("zero1", "shards the optimizer state", False),
    ("local_sgd", "keeps state of its own", False), ("pipeline", "splits the model", True)])
def test_whole_replicas_and_fsdp_shards_recover_in_process(name, why, reshards):
    """``reshards``: the run kept what its models are built from again (fsdp, hsdp)."""
    cfg = Config()
    dims = plan_for(cfg.parallel, strategy_class(name).traits, 4, 2)
    strategy = build_strategy(name, cfg.parallel, torch.device("cpu"), None, dims)
    reason = not_replicated(strategy, ResumableDistributedSampler(64, world_size=4), reshards)
    assert (reason == "") if not why else why in reason


def test_a_fixed_node_count_does_not_recover_in_process():
    cfg = Config()
    dims = plan_for(cfg.parallel, strategy_class("ddp").traits, 4, 2)
    strategy = build_strategy("ddp", cfg.parallel, torch.device("cpu"), None, dims)
    sampler = ResumableDistributedSampler(64, world_size=4)
    assert "fixed node count" in not_replicated(strategy, sampler, nnodes="2")
    assert not_replicated(strategy, sampler, nnodes="1:2") == ""
    assert not_replicated(strategy, sampler, nnodes="1") == ""  # torchrun's job: unknown


def test_token_batches_do_not_recover_in_process_and_a_stream_does():
    """A stream's share keeps a global position (the items every rank read): the ranks
    left regroup and read on from it."""
    cfg = Config()
    dims = plan_for(cfg.parallel, strategy_class("ddp").traits, 2)
    strategy = build_strategy("ddp", cfg.parallel, torch.device("cpu"), None, dims)
    sampler = BucketBatchSampler([5] * 64, token_budget=40, world_size=2)
    assert "tokens" in not_replicated(strategy, sampler)
    share = StreamShard(None, unit=4, rank=1, world_size=2)
    assert not_replicated(strategy, share) == ""


def test_what_counts_as_a_lost_peer():
    closed = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [10.0.0.2]:61145: "
                          "Connection reset by peer")
    assert is_peer_loss(closed)
    assert is_peer_loss(dist.DistNetworkError("store gone"))
    assert not is_peer_loss(ValueError("bad batch"))
    assert not is_peer_loss(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def test_cutting_connections_fails_a_receive_under_way_at_once():
    server = socket.create_server(("127.0.0.2", 0))
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    got: list[bytes] = []
    waiting = threading.Thread(target=lambda: got.append(client.recv(10)))
    waiting.start()
    try:
        assert cut_connections({"127.0.0.2"}) == 1  # the client's, to the server
        waiting.join(10)
        assert got == [b""]  # the receive ended as on a closed connection
    finally:
        for s in (client, accepted, server):
            s.close()


def test_leaving_the_old_group_cuts_the_peers_connections_and_keeps_the_stores():
    """A survivor entering recovery shuts down its connections to the old group's nodes
    (a gloo pair stands in for them) so a peer blocked on it fails at once; its
    connection to the job's store stays, both ends."""
    from types import SimpleNamespace

    job = dist.TCPStore("127.0.0.2", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.2", job.port, is_master=False)
    prefixed = dist.PrefixStore("gpufleet", client)
    assert store_endpoint(prefixed) == frozenset({("127.0.0.2", job.port)})
    peer = socket.create_server(("127.0.0.2", 0))
    # The pair leaves from 127.0.0.3 (the store's connection from 127.0.0.1): this process
    # is both ends of the pair and of the store's connection (as rank 0 is when it serves
    # the store). Not 127.0.0.1 as a node's address: connections that earlier tests of
    # this worker process left to it would be cut and counted too.
    pair = socket.create_connection(peer.getsockname(), source_address=("127.0.0.3", 0))
    accepted, _ = peer.accept()
    accepted.settimeout(10)  # a connection left open fails the test, not hangs it
    watchdog = SimpleNamespace(heartbeats=lambda: [{"rank": 0, "addr": "127.0.0.2"},
                                                   {"rank": 1, "addr": "127.0.0.3"},
                                                   None, {"rank": 3, "addr": ""}])
    try:
        assert cut_old_group(watchdog, prefixed) == 2  # the pair's two ends; no store's
        assert accepted.recv(10) == b""  # the peer sees the connection closed
        prefixed.set("still", "here")  # the store connection works on
        assert client.get("gpufleet/still") == b"here"
        assert cut_old_group(None, prefixed) == 0  # no watchdog: nothing known, nothing cut
    finally:
        for s in (pair, accepted, peer):
            s.close()


def test_hsdp_regrouped_keeps_sharding_within_a_node():
    """After a loss or a join, hsdp's mesh is planned again with the node's rank count:
    shards within a node, whole replicas across nodes (planned from the world size
    alone, it sharded across the nodes)."""
    cfg = Config()
    traits = strategy_class("hsdp").traits
    strategy = build_strategy("hsdp", cfg.parallel, torch.device("cpu"), None,
                              plan_for(cfg.parallel, traits, 4, 2))
    strategy.regroup(2, 1)  # one rank on each of two nodes
    assert (strategy.dims.dp_replicate, strategy.dims.dp_shard) == (2, 1)
    strategy.regroup(4, 2)  # two nodes of two again
    assert (strategy.dims.dp_replicate, strategy.dims.dp_shard) == (2, 2)
