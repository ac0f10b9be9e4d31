"""The ring of collectives, the merge of every rank's position into sentences, and the
NCCL flight recorder's dumps (found, not made: no NCCL here)."""

from __future__ import annotations

import doctest
import os
import threading

import torch.distributed.distributed_c10d as c10d

from gpufleet.core import ring as ring_module
from gpufleet.core.ring import CollectiveRing
from gpufleet.fault import flight_recorder, forensics, stall_report
from gpufleet.fault.forensics import capture, merge


def _entry(seq, op="all_reduce", phase="backward", bucket=0, step=4, nbytes=64, t=0.0):
    return {"seq": seq, "op": op, "bytes": nbytes, "step": step, "phase": phase,
            "bucket": bucket, "time": t}


def _rank(rank, entries, done, stack=()):
    return {"rank": rank, "ring": {"seq": entries[-1]["seq"] if entries else 0,
                                   "done": done, "entries": entries},
            "stack": [list(f) for f in stack]}


def test_the_ring_keeps_the_last_collectives_and_what_returned():
    ring = CollectiveRing(size=4)
    ring.step, ring.phase = 3, "log"
    for _ in range(5):
        ring.leave(ring.enter("all_reduce", 84))
    ring.phase = "backward"
    ring.enter("all_reduce", 644, bucket=1)
    snap = ring.snapshot()
    assert [e["seq"] for e in snap["entries"]] == [3, 4, 5, 6]  # the oldest two dropped
    assert (snap["seq"], snap["done"]) == (6, 5)
    assert snap["entries"][-1] | {"time": 0} == {**_entry(6, bucket=1, step=3, nbytes=644),
                                                 "site": ""}
    ring.leave_all()
    assert ring.snapshot()["done"] == 6


def test_a_rank_held_in_code_and_one_waiting_are_said_with_numbers_and_line():
    waits = _rank(0, [_entry(12, phase="log", bucket=-1), _entry(13, t=10.0)], done=12)
    held = _rank(1, [_entry(12, phase="log", bucket=-1)], done=12,
                 stack=[("/src/train.py", 40, "main"),
                        (f"{forensics._STDLIB}/site-packages/lib/model.py", 123, "forward"),
                        (f"{forensics._STDLIB}/threading.py", 320, "wait")])
    merged = merge([waits, held], now=12.5)
    assert merged.where == (
        "rank 0 waits in all_reduce #13 (step 5, gradient bucket 0, 64 bytes, for 2.5 s); "
        "rank 1 last entered #12 (all_reduce, step 4, log, 64 bytes) and is at "
        "model.py:123 in forward")
    assert not merged.mismatch and not merged.stuck


def test_ranks_at_the_same_place_are_said_together():
    ranks = [_rank(r, [_entry(13, t=1.0)], done=12) for r in range(3)]
    ranks.append(_rank(3, [_entry(12)], done=12, stack=[("/src/data.py", 7, "__next__")]))
    merged = merge(ranks, now=3.0)
    assert merged.where.startswith("rank 0, 1, 2 wait in all_reduce #13 (step 5, ")
    assert merged.where.endswith("; rank 3 last entered #12 (all_reduce, step 5, "
                                 "gradient bucket 0, 64 bytes) and is at data.py:7 in "
                                 "__next__")


def test_every_rank_in_the_same_collective_is_a_stuck_transfer():
    merged = merge([_rank(r, [_entry(9)], done=8) for r in range(2)], now=1.0)
    assert "the transfer itself is stuck" in merged.stuck and not merged.mismatch


def test_different_collectives_under_one_number_are_a_mismatch():
    gpufleet_log = _rank(0, [_entry(9, phase="log", bucket=-1)], done=8)
    bucket = _rank(1, [_entry(9)], done=8)
    merged = merge([gpufleet_log, bucket], now=1.0)
    assert merged.mismatch.startswith(
        "Mismatched collectives: rank 0 waits in all_reduce #9 (step 4, log, 64 bytes, "
        "for 1.0 s); rank 1 waits in all_reduce #9 (step 5, gradient bucket 0, ")
    assert merged.where == ""  # every rank is named in the mismatch


def test_ranks_waiting_in_different_numbers_are_a_mismatch():
    ahead = _rank(0, [_entry(10, op="broadcast_object", bucket=-1, nbytes=-1)], done=9)
    merged = merge([ahead, _rank(1, [_entry(9)], done=8), _rank(2, [_entry(9)], done=8)])
    assert "rank 0 waits in broadcast_object #10 (step 5, backward" in merged.mismatch
    assert "rank 1, 2 wait in all_reduce #9" in merged.mismatch


def test_a_collective_gpufleet_did_not_record_is_named_with_its_caller():
    stack = [("/src/train.py", 40, "main"), ("/src/model.py", 31, "forward"),
             (c10d.__file__.replace("distributed_c10d.py", "c10d_logger.py"), 81,
              "wrapper"), (c10d.__file__, 2800, "all_reduce")]
    user = _rank(0, [_entry(8)], done=8, stack=stack)
    merged = merge([user, _rank(1, [_entry(8), _entry(9)], done=8)], now=0.0)
    assert merged.mismatch.startswith(
        "Mismatched collectives: rank 0 is blocked in all_reduce called at model.py:31 "
        "in forward, a collective gpufleet did not record (last recorded: #8); rank 1 "
        "waits in all_reduce #9")
    # Alone (the other rank computes), it is where that rank waits, not a mismatch.
    alone = merge([user, _rank(1, [_entry(8)], done=8, stack=[("/src/m.py", 3, "f")])])
    assert not alone.mismatch and "rank 0 is blocked in all_reduce" in alone.where


def test_a_capture_holds_the_main_threads_stack_and_the_ring():
    ring = CollectiveRing(size=8)
    ring.enter("barrier", 0)
    found = []
    taker = threading.Thread(target=lambda: found.append(capture(3, ring)))
    taker.start()
    taker.join()  # the main thread waits (in start or here) while its stack is taken
    data = found[0]
    assert data["rank"] == 3 and data["pid"] == os.getpid() and data["ring"]["seq"] == 1
    where = merge([data]).where
    assert where.startswith("rank 3 waits in barrier #1 (setup, 0 bytes, for ")
    data["ring"]["done"] = 1  # returned: now said by the line the main thread is at
    lines = [i for i, text in enumerate(open(__file__), 1)  # where the main thread may be
             if text.strip().startswith(("taker.start()", "taker.join()"))]
    assert any(merge([data]).where.endswith(
        f"and is at test_forensics.py:{n} in test_a_capture_holds_the_main_threads_stack_"
        "and_the_ring") for n in lines), (merge([data]).where, lines)


def test_flight_recorder_dumps_are_found_on_nccl_only(tmp_path):
    prefix = str(tmp_path / "hangs" / "nccl-trace-rank-")
    (tmp_path / "hangs").mkdir()
    (tmp_path / "hangs" / "nccl-trace-rank-1").write_bytes(b"\x80")
    env = {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix, "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}
    assert flight_recorder.dump_files([0, 1], env) == [tmp_path / "hangs" /
                                                       "nccl-trace-rank-1"]
    assert str(tmp_path / "hangs" / "nccl-trace-rank-1") in \
        flight_recorder.report_note("nccl", [0, 1], env)
    assert flight_recorder.report_note("gloo", [0, 1], env) == ""
    # The newer variable wins; before the timeout the report says where dumps will be.
    newer = {**env, "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "fr-")}
    assert flight_recorder.dump_files([0, 1], newer) == []
    assert f"writes {tmp_path / 'fr-'}<rank>" in flight_recorder.report_note("nccl", [0],
                                                                            newer)
    assert flight_recorder.dump_prefix({}) == "/tmp/nccl_trace_rank_"


def test_doctests():
    for module in (ring_module, forensics, flight_recorder, stall_report):
        assert doctest.testmod(module).failed == 0, module.__name__


def test_a_crash_report_lists_the_last_collectives(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import torch

    from gpufleet.fault import crash

    ring = CollectiveRing(size=8)
    ring.leave(ring.enter("all_reduce", 84))
    ring.enter("all_reduce", 644, bucket=0)  # the one that failed
    monkeypatch.setattr(crash, "RING", ring)
    view = SimpleNamespace(env=SimpleNamespace(rank=1, world_size=2), run_dir=tmp_path,
                           step=7, epoch=0, phase="backward", device=torch.device("cpu"))
    path = crash.write_crash_report(view, RuntimeError("Connection reset by peer"))
    text = path.read_text()
    assert "collectives: #2 entered, up to #1 returned\n" in text
    assert "#2 all_reduce (setup, gradient bucket 0, 644 bytes): not returned" in text
