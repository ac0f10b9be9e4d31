"""Receipts put together on the training side: the re-warm timed over the steps after
an event, transfers judged against the link probe's pair, a restart's receipt."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpufleet.fault.receipt import Receipt, read_receipts
from gpufleet.train.recovery import receipts as keeping
from gpufleet.train.recovery.receipts import (
    ReceiptKeeper,
    link_between,
    restart_receipt,
    transfers_of,
)
from gpufleet.train.recovery.recovery import _gist

MB = 1_000_000


def a_receipt(**kw) -> Receipt:
    fields = dict(kind="recovery", t=1.0, step=7, world_from=2, world_to=1, ranks=[1],
                  phases={"leave": 0.1, "agree": 1.0, "regroup": 0.2, "restore": 0.05},
                  total_s=1.4, median_step_s=0.1)
    fields.update(kw)
    return Receipt(**fields)


def test_transfers_are_judged_against_the_probed_pair_one_way():
    links = {"pairs": [{"nodes": [0, 1], "addr": ["10.0.0.1", "10.0.0.2"],
                        "mbit_s": 16000.0, "latency_ms": 0.2}]}
    assert link_between(links, "10.0.0.2", "10.0.0.1") == (1000.0, 0.2)  # 8 Gbit/s a way
    assert link_between(links, "10.0.0.2", "10.0.0.3") == (None, None)
    facts = [{"addr": "10.0.0.1", "interface": "eth0", "received": []},
             {"addr": "10.0.0.2", "interface": "eth1", "received": [(0, 64 * MB, 3.0)]}]
    [sent] = transfers_of(facts, links)
    assert (sent.rank, sent.peer, sent.interface, sent.link_mb_s) == (1, 0, "eth1", 1000.0)
    assert sent.verdict == "far below the link"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_re_warm_ends_at_the_first_step_within_one_and_a_half_median(tmp_path,
                                                                           monkeypatch):
    clock = Clock()
    monkeypatch.setattr(keeping.time, "perf_counter", clock)
    view = SimpleNamespace(env=SimpleNamespace(is_main=True), run_dir=tmp_path)
    keeper = ReceiptKeeper(view)
    for step in range(1, 11):  # steps of 0.1 s
        clock.now += 0.1
        keeper.on_step_end(view, step)
    median, last = keeper.begin()
    assert median == pytest.approx(0.1) and last == clock.now
    clock.now += 2.0  # the recovery
    receipt = a_receipt(median_step_s=median)
    keeper.settle(receipt, clock.now)
    for step, seconds in enumerate((0.5, 0.2, 0.14, 0.1), start=8):  # 0.14 <= 1.5 x 0.1
        clock.now += seconds
        keeper.on_step_end(view, step)
        if seconds == 0.14:
            assert keeper.pending is None  # written at the first full-speed step
    [written] = read_receipts(tmp_path)
    assert written.rewarm_steps == 3 and written.rewarm_s == pytest.approx(0.84)


def test_a_receipt_still_waiting_at_the_end_is_written_as_it_is(tmp_path, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(keeping.time, "perf_counter", clock)
    view = SimpleNamespace(env=SimpleNamespace(is_main=True), run_dir=tmp_path)
    keeper = ReceiptKeeper(view)
    keeper.settle(a_receipt(), clock.now)
    clock.now += 1.0
    keeper.on_step_end(view, 1)  # still slow when the run ends
    keeper.on_fit_end(view, None)
    [written] = read_receipts(tmp_path)
    assert written.rewarm_s is None and "re-warm not reached" in written.line()
    # Not rank 0: nothing is written.
    other = ReceiptKeeper(SimpleNamespace(env=SimpleNamespace(is_main=False),
                                          run_dir=tmp_path))
    other.settle(a_receipt(), clock.now)
    other.flush()
    assert len(read_receipts(tmp_path)) == 1


def test_a_restart_receipt_names_its_checkpoint_or_its_absence(tmp_path):
    ckpt = tmp_path / "step-0000006.pt"
    ckpt.write_bytes(b"x" * 1234)
    run = SimpleNamespace(run_dir=tmp_path, env=SimpleNamespace(world_size=2,
                                                                restart_count=1))
    receipt = restart_receipt(run, ckpt, 6, 4, 10.0, 0.25)
    assert (receipt.kind, receipt.step, receipt.world_from, receipt.world_to) == \
        ("restart", 6, 4, 2)
    assert receipt.checkpoint == {"path": str(ckpt.resolve()), "bytes": 1234,
                                  "seconds": 0.25}
    assert receipt.phases == {"read": 0.25} and receipt.samples_replayed is None
    assert "no ledger of the steps before the restart" in receipt.notes
    fresh = restart_receipt(run, None, 0, 2, 10.0, 0.0)
    assert fresh.checkpoint is None and fresh.phases == {}
    assert "no checkpoint to resume from: trained again from step 0" in fresh.line()


@pytest.mark.parametrize(("message", "gist"), [
    ("Got the following error when running the callback: RuntimeError: [/__w/pytorch/"
     "third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [10.0.0.2]:8901: "
     "Connection reset by peer. This may indicate a possible application crash",
     "Connection reset by peer, 10.0.0.2:8901"),
    ("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.1.2.12]:38031",
     "Connection closed by peer, 10.1.2.12:38031"),
    ("Broken pipe", "Broken pipe"),
    ("something else\nand more", "something else"),
])
def test_a_failed_collective_is_named_by_what_the_backend_said_of_the_peer(message, gist):
    assert _gist(message) == gist
