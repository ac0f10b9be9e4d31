"""The receipt record: its JSON line and log line, the "far below the link" rule, and
report.html's row."""

from __future__ import annotations

import json

import pytest

from gpufleet.fault.receipt import (
    FAR_BELOW_SHARE,
    MIN_JUDGED_BYTES,
    RECEIPTS_FILE,
    Receipt,
    Transfer,
    append_receipt,
    judge_transfer,
    read_receipts,
)
from gpufleet.monitor.report_receipts import receipt_row, receipts_section

MB = 1_000_000


def a_receipt(**kw) -> Receipt:
    fields = dict(kind="recovery", t=1.0, step=7, world_from=3, world_to=2, ranks=[2],
                  detected_by="a failed collective (RuntimeError: Connection reset by peer)",
                  detection_s=0.4, phases={"leave": 0.1, "agree": 1.0, "regroup": 0.2,
                                           "transfer": 0.5, "restore": 0.05},
                  total_s=1.9, steps_repeated=1, samples_replayed=32, median_step_s=0.1,
                  rewarm_s=0.3, rewarm_steps=2)
    fields.update(kw)
    return Receipt(**fields)


def test_a_receipt_goes_to_one_json_line_and_back(tmp_path):
    far = Transfer(1, 0, 64 * MB, 4.0, "eth1", link_mb_s=1000.0, latency_ms=0.3).judged()
    receipt = a_receipt(transfers=[far])
    append_receipt(tmp_path, receipt)
    append_receipt(tmp_path, a_receipt(kind="join", step=9, ranks=[2], world_from=2,
                                       world_to=3, steps_repeated=0, samples_replayed=0))
    lines = (tmp_path / RECEIPTS_FILE).read_text().splitlines()
    assert len(lines) == 2
    assert json.loads(lines[0])["transfers"][0]["mb_s"] == 16.0  # 64 MB in 4 s
    (tmp_path / RECEIPTS_FILE).write_text("\n".join(lines) + '\n{"kind": "recov')  # cut
    first, second = read_receipts(tmp_path)
    assert first == receipt and second.kind == "join"
    assert first.far_below == [far] and far.verdict == "far below the link"


def test_an_unknown_kind_or_phase_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="'rescue' is not one of recovery, join, restart"):
        a_receipt(kind="rescue")
    with pytest.raises(ValueError, match=r"\['wait'\] not among leave, agree"):
        a_receipt(phases={"wait": 1.0})


def test_the_log_line_says_where_the_time_went():
    line = a_receipt(transfers=[Transfer(1, 0, 2 * MB, 0.5, "eth1").judged()]).line()
    assert line.startswith("receipt: recovery at step 7, world 3 -> 2; rank 2 lost "
                           "(detected by a failed collective")
    assert "after 0.40 s" in line
    assert "leave 0.10 s, agree 1.00 s, regroup 0.20 s, transfer 0.50 s, restore 0.05 s " \
           "of 1.90 s" in line
    assert "2,000,000 bytes rank 0 -> 1 over eth1 in 0.500 s (4.0 MB/s; not judged)" in line
    assert "re-warm 0.30 s (2 step(s)); 1 step(s) repeated, 32 sample(s) replayed" in line
    restart = a_receipt(kind="restart", ranks=[], phases={"read": 0.7}, total_s=0.7,
                        checkpoint={"path": "/r/step-0000040.pt", "bytes": 5000,
                                    "seconds": 0.7}, rewarm_s=None)
    assert "read 5,000 bytes of step-0000040.pt in 0.70 s" in restart.line()
    assert "re-warm not reached" in restart.line()


@pytest.mark.parametrize(("nbytes", "seconds", "link", "verdict"), [
    (64 * MB, 0.07, 1000.0, "at link speed"),       # 64 MB at ~1 GB/s
    (64 * MB, 0.064 / FAR_BELOW_SHARE * 0.98, 1000.0, "at link speed"),  # just inside
    (64 * MB, 0.0643 / FAR_BELOW_SHARE * 1.05, 1000.0, "far below the link"),
    (64 * MB, 948.0, 1000.0, "far below the link"),  # the wrong network
    (MIN_JUDGED_BYTES - 1, 10.0, 1000.0, "not judged"),  # too small to tell
    (64 * MB, 10.0, None, "not judged"),  # no probe of the pair
])
def test_far_below_the_link_is_under_a_quarter_of_what_the_probe_predicts(
        nbytes, seconds, link, verdict):
    got, why = judge_transfer(nbytes, seconds, link, 0.3 if link else None)
    assert got == verdict, why
    if verdict == "far below the link":
        assert "MB/s the link probe measured (under 25%)" in why


def test_the_report_row_marks_a_transfer_far_below_its_link(tmp_path):
    far = Transfer(1, 0, 64 * MB, 4.0, "eth1", 1000.0, 0.3).judged()
    row = receipt_row(a_receipt(transfers=[far]))
    assert '<td class="far">' in row and "far below the link (16.0 MB/s, 2% of the" in row
    assert "<td>recovery at step 7; rank(s) 2 lost</td><td>3 → 2</td>" in row
    assert "<td>0.30 s (2 step(s))</td><td>1</td><td>32</td>" in row
    waiting = receipt_row(a_receipt(rewarm_s=None, notes=["the next event began first"]))
    assert "<td>not reached; the next event began first</td>" in waiting
    plain = receipt_row(a_receipt())
    assert 'class="far"' not in plain and "none (each rank&#x27;s own copy)" in plain
    assert receipts_section(tmp_path) == []  # no receipt: no section
    append_receipt(tmp_path, a_receipt(transfers=[far]))
    html = "".join(receipts_section(tmp_path))
    assert html.startswith("<h2>Recoveries and restarts</h2>") and html.count("<tr>") == 2
