"""The link probe of a multi-node run and what the communication-bound finding says with
it: the node behind a slow link by rank and address, with its rate against the others'."""

from __future__ import annotations

import os

from gpufleet.launch import DistEnv, launch
from gpufleet.monitor.diagnose import RunFacts, Summary, diagnose
from gpufleet.monitor.links import ENOUGH_S, SIZES, probe_node_links, probe_pairs


def _links(*rates: float) -> dict:
    """A probe result for len(rates) nodes, node i reaching the others at rates[i]."""
    nodes = [{"node": i, "addr": f"10.0.0.{i + 1}", "mbit_s": r, "latency_ms": 0.2}
             for i, r in enumerate(rates)]
    pairs = [{"nodes": [a, b], "addr": [f"10.0.0.{a + 1}", f"10.0.0.{b + 1}"],
              "mbit_s": min(rates[a], rates[b]), "latency_ms": 0.2, "bytes": 1 << 20}
             for a, b in probe_pairs(list(range(len(rates))))]
    return {"nodes": nodes, "pairs": pairs, "seconds": 0.3}


def _comm_bound(links: dict):
    """The communication-bound finding of a 3-node ddp run that waits 10 of 20 ms."""
    facts = RunFacts(world=len(links.get("nodes", [])) or 3, local_world=1, strategy="ddp",
                     comm_hooks=True, links=links)
    row = dict(data=0.001, forward=0.002, backward=0.014, optimizer=0.002, other=0.001)
    s = Summary(steps=100, step_s=0.02,
                rank_phases=[{"rank": r, **row} for r in range(facts.world)])
    (f,) = [f for f in diagnose(s, facts) if f.rule == "communication-bound"]
    return f


def test_the_finding_names_the_node_behind_the_slow_link_with_its_rate():
    f = _comm_bound(_links(9400.0, 19.46, 9800.0))
    assert ("node 1 (10.0.0.2) reaches the others at 19.5 Mbit/s at best; node 0 at "
            "9.4 Gbit/s, node 2 at 9.8 Gbit/s.") in f.message
    assert "check node 1 (10.0.0.2): its interface speed" in f.fix
    assert "powersgd" in f.fix and "Find the node" not in f.fix  # named, not to be found


def test_alike_links_name_no_node():
    f = _comm_bound(_links(19.0, 21.0, 20.0))
    assert "found the 3 nodes alike" in f.message and "19.0 Mbit/s to 21.0 Mbit/s" in f.message
    assert "node 0 (" not in f.message + f.fix and "node 1 (" not in f.message + f.fix
    assert "check node" not in f.fix


def test_two_nodes_give_the_one_link_without_blaming_an_end():
    f = _comm_bound(_links(19.5, 19.5))
    assert ("the link between node 0 (10.0.0.1) and node 1 (10.0.0.2) at 19.5 Mbit/s, "
            "0.20 ms round trip (with two nodes it cannot tell which end is slow)") in f.message
    assert "check node" not in f.fix


def test_without_a_probe_the_finding_says_how_to_find_the_node():
    f = _comm_bound({})
    assert "link probe" not in f.message
    assert "Find the node behind the slowest link" in f.fix


def test_a_slow_node_is_its_own_finding_while_communication_is_not_the_limit():
    facts = RunFacts(world=3, local_world=1, strategy="ddp", links=_links(9400.0, 19.5, 9800.0))
    row = dict(data=0.001, forward=0.005, backward=0.011, optimizer=0.002, other=0.001)
    s = Summary(steps=100, step_s=0.02, rank_phases=[{"rank": r, **row} for r in range(3)])
    (f,) = diagnose(s, facts)
    assert (f.rule, f.severity, f.title) == ("slow-link", "info", "slow link: node 1")
    assert "node 1 (10.0.0.2) reaches the others at 19.5 Mbit/s" in f.message
    assert f.fix.startswith("check node 1 (10.0.0.2)")
    alike = RunFacts(world=3, local_world=1, strategy="ddp", links=_links(19.0, 21.0, 20.0))
    assert diagnose(s, alike) == []  # alike links: nothing to say
    # Once communication is the limit, that finding names the node; no second one.
    waiting = Summary(steps=100, step_s=0.02, rank_phases=[
        {"rank": r, **row, "forward": 0.002, "backward": 0.014} for r in range(3)])
    assert [f.rule for f in diagnose(waiting, facts)] == ["communication-bound"]


def test_many_nodes_pair_each_with_the_first_three_only():
    pairs = probe_pairs(list(range(6)))
    assert len(pairs) == 12 and (3, 4) not in pairs and (2, 5) in pairs
    for node in range(6):  # every node in at least three pairs: a slow one shows
        assert sum(node in p for p in pairs) >= 3


def _probe_rank(cases: list[tuple[bool, bool]]) -> list[dict]:
    """The probe for each (enabled, one node) case; each rank poses as a node of its own
    (one rank a node) unless the case says one node. gloo on CPU."""
    import dataclasses

    import torch

    from gpufleet.launch import destroy_process_group, init_process_group

    os.environ.update(LOCAL_WORLD_SIZE="1", LOCAL_RANK="0", GROUP_RANK=os.environ["RANK"])
    env = DistEnv.detect()
    init_process_group(env, "gloo", timeout_s=60)
    try:
        return [probe_node_links(dataclasses.replace(env, local_world_size=env.world_size,
                                                     local_rank=env.rank, node_rank=0)
                                 if one_node else env, enabled, torch.device("cpu"))
                for enabled, one_node in cases]
    finally:
        destroy_process_group()


def test_three_ranks_as_three_nodes_probe_every_pair_and_agree():
    results = {r: out[0] for r, out in launch(_probe_rank, ([(True, False)],), nproc=3,
                                               launcher="spawn").items()}
    links = results[0]
    same = [{k: v for k, v in r.items() if k != "seconds"} for r in results.values()]
    assert same[0] == same[1] == same[2]  # every rank holds the same measurements
    assert [p["nodes"] for p in links["pairs"]] == [[0, 1], [0, 2], [1, 2]]
    for p in links["pairs"]:  # sizes grow until a swap is long enough, or the largest
        seconds = 2 * p["bytes"] * 8 / (p["mbit_s"] * 1e6)
        assert p["bytes"] == SIZES[-1] or (p["bytes"] in SIZES and seconds >= ENOUGH_S)
        assert p["mbit_s"] > 0 and p["latency_ms"] > 0 and p["addr"] == ["127.0.0.1"] * 2
    assert [n["node"] for n in links["nodes"]] == [0, 1, 2]
    assert links["nodes"][0]["mbit_s"] == max(p["mbit_s"] for p in links["pairs"][:2])
    assert 0 < links["seconds"] < 30


def test_the_probe_is_off_on_one_node_and_when_disabled():
    # Two nodes with the probe off, then one node with it on: nothing measured, and no
    # rank left waiting in a collective (the run would hang to the timeout).
    cases = [(False, False), (True, True)]
    assert launch(_probe_rank, (cases,), nproc=2, launcher="spawn") == {0: [{}, {}],
                                                                        1: [{}, {}]}
