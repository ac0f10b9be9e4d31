import json
import math
import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import gpufleet
import toyjob
from gpufleet.monitor import report, report_svg
from gpufleet.monitor.diagnose import Finding
from gpufleet.monitor.report import ReportError, write_report
from gpufleet.monitor.report_cli import write_at_end

from .accounted import assert_accounted

FINDING = Finding(rule="input-bound", severity="warn", title="input-bound on rank 0",
                  message="rank 0 waits 41% of each step for data.",
                  fix="raise data.num_workers from 0 to 2.", step=20)


def _system_lines(path: Path, hosts=("node-a", "node-b"), gpus=4, seconds=120):
    """Samples in the format of system.jsonl, as two 4-GPU nodes would write them."""
    t0 = 1.7e9
    with open(path, "w") as f:
        for host in hosts:
            for k in range(seconds):
                f.write(json.dumps({
                    "time": t0 + k, "host": host,
                    "gpus": [{"index": i, "name": "NVIDIA H100 80GB HBM3",
                              "util_pct": round(50 + 45 * math.sin(k / 7 + i)),
                              "mem_used_mb": 20000.0 + 300 * k + 1000 * i,
                              "mem_total_mb": 81559.0, "power_w": 300.0, "temp_c": 60,
                              "sm_clock_mhz": 1980} for i in range(gpus)],
                    "cpu_pct": [30.0 + k % 20, 50.0], "ram_used_mb": 50000.0 + 10 * k,
                    "ram_total_mb": 128000.0, "proc_rss_mb": 9000.0, "proc_cpu_pct": 150.0,
                    "procs": 9, "disk_free_gb": 500.0}) + "\n")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A real short run (loss, eval, throughput, phases), plus system samples with GPUs
    (none here) and a recorded finding."""
    root = tmp_path_factory.mktemp("report")
    torch.manual_seed(0)
    result = gpufleet.fit(
        toyjob.make_model(), toyjob.make_data(), toyjob.make_data(64), loss_fn=F.mse_loss,
        overrides={"run.dir": str(root / "run"), "run.max_steps": 60, "log.every": 5,
                   "run.eval_every": 20, "log.progress": "off", "checkpoint.save_final": False,
                   "optim.clip_norm": 1.0})  # the clip measures the gradient norm charted
    run = Path(result.run_dir)
    _system_lines(run / "system.jsonl")
    # The run's own diagnosis is kept apart; the report shows a finding of ours, with
    # the run's measured expected step.
    real = (run / "diagnosis.json").read_text()
    (run / "diagnosis.measured.json").write_text(real)
    (run / "diagnosis.json").write_text(json.dumps({**json.loads(real),
                                                    "findings": [FINDING.to_dict()]}))
    return run


def test_report_is_self_contained_and_shows_everything(run_dir):
    html = write_report(run_dir).read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", html, re.I)
    assert "http://" not in html and "https://" not in html
    assert "<script" not in html and "<link" not in html  # no code, no stylesheet to fetch
    for title in ("Loss", "Learning rate", "Gradient norm (before clipping)",
                  "Throughput (all ranks)", "Data-wait share", "Step time per rank",
                  "Rank 0 phases over the run",
                  "node-a: GPU utilisation", "node-b: GPU memory used (of 79.6 GB)",
                  "Host CPU (share of all cores)", "Where each rank"):
        assert f'aria-label="{title}' in html, title
    assert html.count("<svg") == 14
    # Evaluation every 20 steps is a part of the accounting, within 5% of the clock.
    steady = assert_accounted(run_dir, world=1)
    assert sum(rows[0]["eval_checkpoint"] > 0 for rows in steady) >= 2
    # Host overhead is measured on a CPU (the op clock sampled a step before the first
    # interval ended): a part of its own, the operators of the sample counted.
    assert all(rows[0]["host"] is not None and rows[0]["ops"]["backward"] > 0
               for rows in steady)
    assert "host overhead" in html and "outside any operator" in html
    # The expected step, against this CPU's measured rates, in diagnosis.json and here.
    measured = json.loads((run_dir / "diagnosis.measured.json").read_text())
    (got,) = measured["expected_step"]
    assert got["peaks"]["matmul_flops"] > 0 and got["peaks"]["dtype"] == "fp32"
    assert got["work"]["flops"] > 0 and got["work"]["optimizer_bytes"] > 0
    assert got["parts"]["forward"]["expected"] > 0 and got["compute_share"] > 0
    assert measured["facts"]["peaks"]["launch_s"] > 0
    assert "<h3>Expected step</h3>" in html and "GFLOP/s (fp32 matmul)" in html
    # A CPU run has no MFU (no known peak): no empty MFU line, no MFU in a title.
    assert "MFU" not in html
    assert "input-bound on rank 0" in html and "raise data.num_workers from 0 to 2." in html
    assert "<td>steps</td><td>60</td>" in html
    assert "4 per host: NVIDIA H100 80GB HBM3" in html
    assert "[run]" in html  # the config, folded away


def test_report_with_partial_data(tmp_path):
    # A run without system samples, phases or findings: notes instead of charts.
    lines = [{"kind": "train", "time": 1.0 + s, "step": s, "loss": 3.0 / s, "lr": 1e-3,
              "samples_per_s": 100.0 + s} for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n{broken")
    html = write_report(tmp_path).read_text()
    assert html.count("<svg") == 3  # loss, learning rate and throughput
    assert "Gradient norm" not in html  # not in the records
    assert "No GPU samples" in html and "No phase timings" in html
    assert "No finding recorded" in html and "No system samples" in html


def test_a_short_run_lists_its_values_instead_of_drawing_curves(tmp_path):
    lines = [{"kind": "train", "time": 1.0 + s, "step": s, "loss": 2.0 / s, "lr": 1e-3 * s,
              "grad_norm": 0.5, "samples_per_s": 100.0, "mfu": 0.41} for s in (10, 20)]
    lines.append({"kind": "eval", "time": 30.0, "step": 20, "eval_loss": 0.75,
                  "eval_samples": 64, "eval_metrics": {"accuracy": 0.625}})
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, lines)))
    html = write_report(tmp_path).read_text()
    assert "<svg" not in html  # two points make no curve
    assert "2 log interval(s): too few for curves" in html
    assert "<tr><td>20</td><td>0.1000</td><td>2.00e-02</td><td>0.5</td><td>100.0</td>" \
           "<td>41.0%</td></tr>" in html
    assert "<tr><td>20</td><td>0.7500</td><td>0.6250</td></tr>" in html
    assert "<td>eval accuracy (step 20)</td><td>0.6250</td>" in html


def test_eval_metrics_get_a_chart(tmp_path):
    lines = [{"kind": "train", "time": 1.0 + s, "step": s, "loss": 1.0, "lr": 1e-3,
              "samples_per_s": 10.0} for s in range(1, 7)]
    lines += [{"kind": "eval", "time": 9.0, "step": s, "eval_loss": 0.5,
               "eval_metrics": {"accuracy": s / 10}} for s in (3, 6)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, lines)))
    html = write_report(tmp_path).read_text()
    assert 'aria-label="Eval accuracy"' in html and "<title>accuracy: 0.6 at 6</title>" in html


def test_stacked_bars_per_rank(tmp_path):
    phases = dict(data=0.010, forward=0.020, backward=0.030, optimizer=0.005, other=0.001)
    ranks = [{"rank": r, **phases, "data": 0.010 + 0.05 * (r == 3)} for r in range(4)]
    lines = [{"kind": "train", "time": 1.0 + s, "step": s, "loss": 1.0, "lr": 1e-3,
              "samples_per_s": 10.0, "phases": phases, "rank_phases": ranks}
             for s in (10, 20)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, lines)))
    html = write_report(tmp_path).read_text()
    bars = re.findall(r"<title>rank (\d) data: ([\d.]+) ms \((\d+)%\)</title>", html)
    assert bars == [("0", "10", "15"), ("1", "10", "15"), ("2", "10", "15"), ("3", "60", "52")]
    assert "mean over 1 log interval(s)" in html  # the first interval (warm-up) left out


def test_not_a_run_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ReportError, match=r"does not exist\. Did you mean .*run-1"):
        (tmp_path / "run-1").mkdir()
        write_report(tmp_path / "run-2")
    with pytest.raises(ReportError, match=r"is not a run directory: it has no config\.toml"):
        write_report(tmp_path)


def test_a_report_that_cannot_be_written_at_a_runs_end_is_logged_not_raised(tmp_path,
                                                                            caplog):
    write_at_end(tmp_path)  # no config.toml: not a run directory
    assert "the HTML report could not be written: ReportError" in caplog.text
    assert not (tmp_path / "report.html").exists()


def test_report_command(run_dir, run_cli):
    proc = run_cli("report", str(run_dir))
    assert "[warn] input-bound on rank 0: rank 0 waits 41% of each step for data. Fix: " \
           "raise data.num_workers from 0 to 2." in proc.stdout
    assert f"report: {run_dir / 'report.html'}" in proc.stdout
    proc = run_cli("report", str(run_dir.parent / "nope"), expect=2)
    assert "gpufleet: error: run directory" in proc.stderr and "does not exist" in proc.stderr


def test_doctests():
    import doctest

    assert doctest.testmod(report).failed == 0
    assert doctest.testmod(report_svg).failed == 0


# -- in a real browser ------------------------------------------------------------------
def _chromium() -> str | None:
    return next(filter(None, map(shutil.which, ("chromium", "chromium-browser",
                                                "google-chrome"))), None)


def _decode_png(data: bytes) -> np.ndarray:
    """An 8-bit RGB(A) PNG as an array [height, width, 3] (zlib + the 5 row filters)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat = 8, b""
    while pos < len(data):
        (n,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            w, h, depth, color = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and color in (2, 6), (depth, color)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    ch = 3 if color == 2 else 4
    raw = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(h, w * ch + 1)
    out = np.zeros((h, w * ch), np.uint8)
    prev = np.zeros(w * ch, np.uint8)
    for y in range(h):
        kind, line = raw[y, 0], raw[y, 1:]
        if kind == 0:
            cur = line
        elif kind == 1:  # Sub: a running sum along each channel
            cur = np.cumsum(line.reshape(w, ch), axis=0, dtype=np.uint8).reshape(-1)
        elif kind == 2:  # Up
            cur = line + prev
        else:
            cur = np.frombuffer(_average_or_paeth(kind, line.tobytes(), prev.tobytes(), ch),
                                np.uint8)
        out[y] = prev = cur
    return out.reshape(h, w, ch)[:, :, :3]


def _average_or_paeth(kind: int, line: bytes, prev: bytes, ch: int) -> bytearray:
    """PNG filters 3 and 4, which depend on the byte just decoded: one byte at a time."""
    cur = bytearray(line)
    for i in range(len(cur)):
        a = cur[i - ch] if i >= ch else 0
        b = prev[i]
        if kind == 3:
            cur[i] = (cur[i] + ((a + b) >> 1)) & 255
            continue
        c = prev[i - ch] if i >= ch else 0
        pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
        cur[i] = (cur[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
    return cur


def test_report_renders_in_headless_chromium(run_dir, tmp_path):
    browser = _chromium()
    if browser is None:
        pytest.skip("no chromium binary on PATH (Debian: apt-get install -y chromium)")
    page = write_report(run_dir)
    shot = tmp_path / "report.png"
    width, height = 1200, 3400  # down to the second node's GPU charts
    proc = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                           "--hide-scrollbars", f"--screenshot={shot}",
                           f"--window-size={width},{height}", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert shot.is_file(), proc.stderr[-2000:]
    img = _decode_png(shot.read_bytes())
    assert img.shape == (height, width, 3)
    rgb = (img[..., 0].astype(np.int32) << 16) | (img[..., 1].astype(np.int32) << 8) \
        | img[..., 2]
    assert len(np.unique(rgb)) > 100  # text, lines and bars, anti-aliased: not blank
    # The lines and bars are drawn in the palette's exact colours; text and grid are grey.
    palette = [int(c[1:], 16) for c in report_svg.PALETTE[:5]]
    rows_with = {c: np.flatnonzero((rgb == c).any(axis=1)) for c in palette}
    for colour, rows in rows_with.items():
        assert len(rows) > 30, colour  # every phase and GPU colour is in some chart
    # GPU 3 (teal) draws a sine across ~90% of the utilisation chart's height in the
    # lower part of the page: a line plot, not just a legend key or a bar.
    teal = rows_with[palette[3]]
    assert len(teal[teal > 1800]) > 150


# Measures, in the browser, every text box of each chart (SVG labels and the legend's
# keys) and lists the pairs that overlap. Added to a copy of the page only: the report
# itself carries no script.
_OVERLAP_PROBE = """<script>
window.addEventListener("load", () => {
  const found = [];
  for (const fig of document.querySelectorAll("figure.chart")) {
    const title = fig.querySelector("svg").getAttribute("aria-label");
    const boxes = [...fig.querySelectorAll("svg text, .legend .key")]
      .map(e => [e.textContent, e.getBoundingClientRect()]).filter(([, r]) => r.width > 0);
    const page = document.body.getBoundingClientRect();
    for (let i = 0; i < boxes.length; i++) {
      const [a, r] = boxes[i];
      if (r.right > page.right + 1) found.push([title, a, "past the page's edge"]);
      for (let j = i + 1; j < boxes.length; j++) {
        const [b, q] = boxes[j];
        const w = Math.min(r.right, q.right) - Math.max(r.left, q.left);
        const h = Math.min(r.bottom, q.bottom) - Math.max(r.top, q.top);
        if (w > 1 && h > 1) found.push([title, a, b]);
      }
    }
  }
  const out = document.createElement("pre");
  out.id = "overlaps";
  out.textContent = JSON.stringify({charts: document.querySelectorAll("figure.chart").length,
                                    overlaps: found});
  document.body.appendChild(out);
});
</script>"""


def test_chart_labels_do_not_overlap_in_chromium(run_dir, tmp_path):
    browser = _chromium()
    if browser is None:
        pytest.skip("no chromium binary on PATH (Debian: apt-get install -y chromium)")
    html = write_report(run_dir).read_text()
    # Long series names, as runs on hosts with long names have them.
    html = html.replace("node-a", "gpu-node-a.cluster.example").replace(
        "node-b", "gpu-node-b.cluster.example")
    probe = tmp_path / "probe.html"
    probe.write_text(html.replace("</body>", _OVERLAP_PROBE + "</body>"))
    proc = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                           "--window-size=1200,3000", "--virtual-time-budget=5000",
                           "--dump-dom", probe.as_uri()],
                          capture_output=True, text=True, timeout=120)
    found = re.search(r'<pre id="overlaps">(.*?)</pre>', proc.stdout, re.S)
    assert found, proc.stderr[-2000:]
    result = json.loads(found.group(1).replace("&quot;", '"'))
    assert result["charts"] == 14
    assert result["overlaps"] == []
