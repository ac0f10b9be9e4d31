"""report.html's table of the expected step: each part of the slowest rank's step as
measured, as expected on this machine and the figures the expectation rests on
(``expected_step`` in ``diagnosis.json``, :mod:`gpufleet.monitor.expected`)."""

from __future__ import annotations

import json
from html import escape
from pathlib import Path
from typing import Any

from gpufleet.monitor.expected import MODELLED
from gpufleet.monitor.findings import DIAGNOSIS_FILE

CSS = ("table.expected td,table.expected th{padding:2px 10px 2px 0;text-align:left}"
       "table.expected td.far{color:#c0392b;font-weight:600}")
_LABELS = {"data": "data wait", "forward": "forward", "backward": "backward compute",
           "exposed_comm": "exposed communication", "late_ranks": "waiting for late ranks",
           "optimizer": "optimizer step", "host": "host overhead"}


def expected_section(run_dir: Path) -> list[str]:
    """The section's HTML (a heading, the yardsticks and a table), or nothing when the
    run recorded no expected step (a GPU run, or none diagnosed yet)."""
    path = run_dir / DIAGNOSIS_FILE
    try:
        rows = json.loads(path.read_text()).get("expected_step") or []
    except (OSError, ValueError):
        return []
    if not rows:
        return []
    got = max(rows, key=lambda r: r.get("measured_step") or 0.0)
    peaks, step = got["peaks"], got["measured_step"]
    where = f"rank {got['rank']} (the slowest), " if len(rows) > 1 else ""
    head = (f"{where}measured step {step * 1e3:.4g} ms, expected "
            f"{got['expected_step'] * 1e3:.4g} ms. This CPU's measured rates: "
            f"{peaks['matmul_flops'] / 1e9:.3g} GFLOP/s ({peaks['dtype']} matmul), "
            f"{peaks['launch_s'] * 1e6:.2g} µs per operator, "
            f"{peaks['memory_bps'] / 1e9:.3g} GB/s copied.")
    if got.get("compute_share") is not None:
        head += (f" Forward and backward run at {got['compute_share']:.1%} of the "
                 "matmul rate.")
    table = "".join(_row(part, got["parts"][part], step) for part in MODELLED
                    if part in got["parts"])
    return ["<h3>Expected step</h3>", f"<p>{escape(head)}</p>",
            '<table class="expected"><tr><th>part</th><th>measured</th><th>expected</th>'
            f"<th>share of the step</th><th>expected from</th></tr>{table}</table>"]


def _row(part: str, v: dict[str, Any], step: float) -> str:
    measured, expected = v.get("measured"), v.get("expected")
    far = measured is not None and expected is not None and step > 0 and \
        measured - expected > 0.1 * step
    cells = [_LABELS.get(part, part), _ms(measured), _ms(expected),
             f"{measured / step:.0%}" if measured is not None and step > 0 else "-",
             v.get("basis", "")]
    out = "".join(('<td class="far">' if far and i == 1 else "<td>") + escape(c) + "</td>"
                  for i, c in enumerate(cells))
    return f"<tr>{out}</tr>"


def _ms(seconds: float | None) -> str:
    return "not modelled" if seconds is None else f"{seconds * 1e3:.3g} ms"
