"""A rank that dies by a signal inside a collective is named with every rank's position:
the rings kept in files, faulthandler's stacks, the merged sentence."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import torch

from gpufleet.core.ring import CollectiveRing, call_site, read_ring_file
from gpufleet.fault import crash_forensics
from gpufleet.fault.crash import write_crash_report
from gpufleet.fault.crash_forensics import RankFiles, positions, sentence
from gpufleet.fault.fatal import FatalDump


def test_the_ring_file_holds_what_a_killed_process_entered_last(tmp_path):
    # A process that enters a collective and dies at once (no Python after it): the
    # record was written before the call, and the kernel keeps the mapped pages.
    path = tmp_path / "ring-rank-1.bin"
    code = textwrap.dedent(f"""
        import os
        from gpufleet.core.ring import CollectiveRing
        ring = CollectiveRing(4)
        ring.attach({str(path)!r}, rank=1)
        for i in range(5):
            ring.leave(ring.enter("all_reduce", 100 + i, bucket=0))
        ring.site = "train.py:42"
        ring.enter("all_reduce", 4)
        os.abort()
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert done.returncode == -6
    ring = read_ring_file(path)
    assert (ring["rank"], ring["seq"], ring["done"]) == (1, 6, 5)
    assert [e["seq"] for e in ring["entries"]] == [3, 4, 5, 6]  # the last 4 (its size)
    assert ring["entries"][-1] | {"time": 0} == {
        "seq": 6, "op": "all_reduce", "bytes": 4, "step": 0, "phase": "setup",
        "bucket": -1, "time": 0, "site": "train.py:42"}


def test_a_ring_attached_late_keeps_what_it_held_and_the_call_site_is_the_callers(tmp_path):
    ring = CollectiveRing(8)
    ring.leave(ring.enter("barrier", 0))
    ring.attach(tmp_path / "r.bin", rank=0)
    ring.enter("all_gather", 32)
    ring.detach()
    assert [e["op"] for e in read_ring_file(tmp_path / "r.bin")["entries"]] == [
        "barrier", "all_gather"]
    assert call_site() == f"{Path(__file__).name}:{sys._getframe().f_lineno}"
    assert read_ring_file(tmp_path / "missing.bin") is None


def _entry(seq, op="all_reduce", nbytes=4, step=5, phase="end", bucket=-1, site=""):
    return {"seq": seq, "op": op, "bytes": nbytes, "step": step, "phase": phase,
            "bucket": bucket, "time": 0.0, "site": site}


def test_the_sentence_names_both_sides_of_a_mismatch_and_the_dead_rank_first():
    rings = {0: {"seq": 13, "done": 12, "entries": [
                 _entry(12, phase="log"), _entry(13, nbytes=67588, phase="backward",
                                                 bucket=0)]},
             1: {"seq": 13, "done": 12, "entries": [_entry(13, site="train.py:42")]},
             2: {"seq": 13, "done": 12, "entries": [
                 _entry(13, nbytes=67588, phase="backward", bucket=0)]}}
    assert sentence(rings, died={1}) == (
        "collective mismatch: rank 1 entered all_reduce #13 (4 bytes, step 5, "
        "train.py:42) while rank 0, 2 were in all_reduce #13 (gradient bucket 0, 67588 "
        "bytes, step 6)")
    # Every rank in the same collective: no mismatch.
    same = {r: rings[0] for r in (0, 1)}
    assert sentence(same) == ("every rank entered all_reduce #13 (gradient bucket 0, "
                              "67588 bytes, step 6)")
    # One rank in a collective the others never entered.
    rings[0] = {"seq": 12, "done": 12, "entries": [_entry(12, phase="log")]}
    assert sentence({0: rings[0], 1: rings[1]}, died={1}) == (
        "rank 1 entered all_reduce #13 (4 bytes, step 5, train.py:42) while rank 0 was "
        "in no collective (last entered #12 (all_reduce, 4 bytes, step 5, log))")
    assert positions({0: RankFiles(0, rings[0])}) == []  # one ring: nothing to merge


def test_faulthandlers_stacks_of_an_aborted_rank_name_the_programs_line(tmp_path):
    run_dir = tmp_path / "run"
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import os, threading
        from gpufleet.fault.fatal import FatalDump
        FatalDump({str(run_dir)!r}, 1).start()
        threading.Thread(target=threading.Event().wait, daemon=True).start()
        os.abort()  # line 6
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, timeout=60,
                          env={**os.environ, "GPUFLEET_FORENSICS_DIR": str(tmp_path)})
    assert done.returncode == -6
    ranks = crash_forensics.read_folder(run_dir / "crash")
    assert ranks[1].stacks == run_dir / "crash" / "fatal-rank-1.txt"
    assert ranks[1].at == "train.py:6 in <module>"
    # The launcher finds the folder through the link the rank made.
    assert crash_forensics.read_folders([tmp_path / "rank-1"])[1].at == ranks[1].at


def test_a_rank_that_ends_well_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.delattr(sys, "last_value", raising=False)  # pytest's, after a failure
    dump = FatalDump(tmp_path, 0)
    assert dump.start() and dump.ring_path.is_file()
    dump.stop()
    assert not (tmp_path / "crash").exists()
    # A script ending on an uncaught exception (Fleet's end at exit) keeps them.
    monkeypatch.setattr(sys, "last_value", RuntimeError("the loop failed"), raising=False)
    assert dump.start()
    dump.stop()
    assert dump.ring_path.is_file() and dump.path.is_file()
    monkeypatch.delattr(sys, "last_value")
    dump.stop()


def test_a_mismatched_collective_that_aborts_is_named_with_both_ranks_positions(tmp_path):
    script = Path(__file__).with_name("mismatched_loop.py")
    line = next(i for i, text in enumerate(script.read_text().splitlines(), 1)
                if "MISMATCH" in text)
    done = subprocess.run([sys.executable, "-m", "gpufleet", "run", str(script), "--nproc",
                           "2", "--", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode != 0
    # Rank 1 made its 4-byte all-reduce after its 3rd step while rank 0 was in step 4's
    # gradient bucket: the same number, another collective.
    assert ("collective mismatch: rank 1 entered all_reduce #" in done.stderr and
            f"(4 bytes, step 3, mismatched_loop.py:{line}) while rank 0 was in all_reduce #"
            in done.stderr and "(gradient bucket 0, 16640 bytes, step 4)" in done.stderr
            ), done.stderr[-3000:]
    assert f"(your code: mismatched_loop.py:{line} in <module>)" in done.stderr


def test_rank_0s_crash_report_merges_a_dead_peers_ring(tmp_path, monkeypatch):
    (tmp_path / "crash").mkdir()
    peer = CollectiveRing(8)  # rank 1, dead inside its own 4-byte all-reduce
    peer.attach(tmp_path / "crash" / "ring-rank-1.bin", rank=1)
    peer.step, peer.phase, peer.site = 6, "end", "train.py:17"
    peer.enter("all_reduce", 4)
    peer.detach()
    mine = CollectiveRing(8)  # rank 0, in the gradient bucket of its 7th step
    mine.step, mine.phase = 6, "backward"
    mine.enter("all_reduce", 66304, bucket=0)
    monkeypatch.setattr("gpufleet.fault.crash.RING", mine)  # this rank's live ring
    view = SimpleNamespace(env=SimpleNamespace(rank=0, world_size=2), run_dir=tmp_path,
                           step=6, epoch=0, phase="backward", device=torch.device("cpu"))
    path = write_crash_report(view, RuntimeError("gloo: Connection reset by peer"))
    assert ("collective mismatch: rank 0 entered all_reduce #1 (gradient bucket 0, 66304 "
            "bytes, step 7) while rank 1 was in all_reduce #1 (4 bytes, step 6, "
            "train.py:17)") in path.read_text()
