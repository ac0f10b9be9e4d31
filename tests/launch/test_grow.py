"""A node that joins live ranks: what the agents work out from what each said, and how
the live ranks agree on the step. The whole path runs on the network bed
(tests/cluster/test_recovery.py)."""

from __future__ import annotations

import json

from gpufleet.fault.preempt import PreemptionWatch
from gpufleet.launch.grow import JOIN_ENV, Growth, joining, plan_growth


def said(live: list[int], node: int | None, nproc: int, token: str = "t") -> dict:
    return {"live": live, "node": node, "store": ["10.0.0.1", 29500] if live else None,
            "nproc": nproc, "token": token}


def test_live_ranks_keep_theirs_and_new_ranks_follow_in_group_order():
    # The rendezvous numbered the returning node 0 and the live one 1: ranks follow
    # the live ranks, not the agents' group ranks.
    growth = plan_growth({0: said([], None, 2, "x"), 1: said([0, 1], 0, 2, "ab"),
                          2: said([], None, 1, "y")})
    assert growth.live == 2 and growth.world == 5
    assert growth.new == {0: [(0, 2, 1), (1, 3, 1)], 2: [(0, 4, 2)]}
    assert growth.store == ("10.0.0.1", 29500) and growth.key == "gpufleet/grow/ab"
    assert Growth.loads(growth.dumps()) == growth


def test_a_fresh_start_or_live_ranks_that_cannot_be_joined_plan_nothing():
    assert plan_growth({0: said([], None, 1), 1: said([], None, 1)}) is None
    # Live ranks with a gap (rank 1's node did not say it is live): everyone restarts.
    assert plan_growth({0: said([0], 0, 1), 1: said([2], 2, 1), 2: said([], None, 1)}) is None


def test_a_new_rank_finds_its_rank_and_node_by_its_local_rank(monkeypatch):
    growth = plan_growth({0: said([0], 0, 1), 1: said([], None, 2)})
    ranks = {str(local): [rank, node] for local, rank, node in growth.new[1]}
    monkeypatch.setenv(JOIN_ENV, json.dumps({"growth": growth.dumps(), "ranks": ranks}))
    monkeypatch.setenv("LOCAL_RANK", "1")
    me = joining()
    assert (me.rank, me.node, me.growth) == (2, 1, growth)
    monkeypatch.delenv(JOIN_ENV)
    assert joining() is None


def test_the_ranks_agree_to_grow_only_at_a_check_and_not_when_stopping():
    watch = PreemptionWatch(check_every=10, distributed=False)
    try:
        assert not watch.should_stop(7, grow=True) and not watch.grow_agreed  # no check
        assert not watch.should_stop(10, grow=True) and watch.grow_agreed
        assert not watch.should_stop(11) and not watch.grow_agreed  # not kept after it
        assert watch.should_stop(20, requested=True, grow=True) and not watch.grow_agreed
    finally:
        watch.close()


def test_an_agent_finds_its_live_ranks_in_their_files_or_none(tmp_path):
    from gpufleet.launch.grow import GROWABLE, live_ranks

    (tmp_path / f"{GROWABLE}-0").write_text(json.dumps({"rank": 2, "world": 4}))
    assert live_ranks(tmp_path, 2) is None  # local rank 1 did not say it can grow
    (tmp_path / f"{GROWABLE}-1").write_text(json.dumps({"rank": 3, "world": 4}))
    assert live_ranks(tmp_path, 2) == [2, 3]
