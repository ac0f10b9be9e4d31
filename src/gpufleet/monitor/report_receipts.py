"""report.html's table of a run's recoveries, joins and restarts: one row per receipt of
``recoveries.jsonl`` (:mod:`gpufleet.fault.receipt`), a transfer far below its link
marked."""

from __future__ import annotations

from html import escape
from pathlib import Path

from gpufleet.fault.receipt import Receipt, read_receipts

CSS = ("table.receipts td,table.receipts th{padding:2px 10px 2px 0;text-align:left;"
       "vertical-align:top}table.receipts td.far{color:#c0392b;font-weight:600}")
_HEAD = ("event", "world", "detected by", "phases (s)", "total", "state transfer",
         "re-warm", "steps repeated", "samples replayed")


def receipts_section(run_dir: Path) -> list[str]:
    """The section's HTML (a heading and a table), or nothing when the run had no
    recovery, join or restart."""
    receipts = read_receipts(run_dir)
    if not receipts:
        return []
    head = "".join(f"<th>{escape(h)}</th>" for h in _HEAD)
    rows = "".join(receipt_row(r) for r in receipts)
    return ["<h2>Recoveries and restarts</h2>",
            f'<table class="receipts"><tr>{head}</tr>{rows}</table>']


def receipt_row(r: Receipt) -> str:
    """One receipt as a table row; a transfer far below its link's measured rate has
    the cell class ``far`` and says so."""
    who = ""
    if r.ranks:
        word = "joined" if r.kind == "join" else "lost"
        who = f"; rank(s) {', '.join(map(str, r.ranks))} {word}"
    event = r.event()
    detected = r.detection() or (f" after {r.detection_s:.2f} s"
                                 if r.detection_s is not None else "")
    phases = ", ".join(f"{name} {s:.2f}" for name, s in r.phases.items())
    sent, far = [], bool(r.far_below)
    if r.checkpoint:
        sent.append(f"read {r.checkpoint.get('bytes', 0):,} B of "
                    f"{Path(str(r.checkpoint.get('path', '?'))).name} in "
                    f"{r.checkpoint.get('seconds', 0.0):.2f} s")
    for t in r.transfers:
        sent.append(f"{t.bytes:,} B rank {t.peer} → {t.rank} over {t.interface or '?'} in "
                    f"{t.seconds:.3f} s, {t.mb_s:,.1f} MB/s: {t.verdict}"
                    + (f" ({t.why})" if t.verdict != "not judged" else ""))
    if not sent:
        sent.append("none (each rank's own copy)" if r.kind != "restart" else "-")
    rewarm = (f"{r.rewarm_s:.2f} s ({r.rewarm_steps} step(s))" if r.rewarm_s is not None
              else "not reached") + "".join(f"; {note}" for note in r.notes)
    replayed = "-" if r.samples_replayed is None else f"{r.samples_replayed:,}"
    cells = [event + who, f"{r.world_from} → {r.world_to}", detected, phases or "-",
             f"{r.total_s:.2f} s"]
    out = "".join(f"<td>{escape(c)}</td>" for c in cells)
    out += '<td class="far">' if far else "<td>"
    out += escape("; ".join(sent)) + "</td>"
    out += "".join(f"<td>{escape(c)}</td>" for c in
                   (rewarm, str(r.steps_repeated), replayed))
    return f"<tr>{out}</tr>"
