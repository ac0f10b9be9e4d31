"""The step accounting's check on a real run's directory, for the runs' tests."""

from __future__ import annotations

import json

import pytest

from gpufleet.monitor.accounting import PARTS, TOLERANCE


def assert_accounted(run_dir, world: int) -> list[dict]:
    """Every interval after the first accounts for each rank's step within 5%, and
    report.html draws a bar per rank; returns the intervals' accounting."""
    train = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text()
                            .splitlines()) if r.get("kind") == "train"]
    steady = [r["rank_accounting"] for r in train[1:]]
    assert steady and all(len(rows) == world for rows in steady)
    for rows in steady:
        for row in rows:
            total = sum(row[p] or 0.0 for p in PARTS)
            assert row["step"] > 0 and total + row["residual"] == pytest.approx(row["step"])
            assert abs(row["residual_share"]) <= TOLERANCE, rows
    html = (run_dir / "report.html").read_text()
    assert "Where each rank" in html and html.count('class="measured"') == world
    return steady
