"""The HTML report of a run: one self-contained ``report.html`` (inline SVG, no network).

Built from what the run directory holds, whatever subset of it exists:

* ``metrics.jsonl``: loss and eval curves, throughput, data-wait share and MFU, the
  step accounting per rank (``rank_accounting``: a stacked bar each, with the
  measured step and the residual), the step-time breakdown per rank (``rank_phases``,
  else rank 0's ``phases``);
* ``system.jsonl`` (:mod:`gpufleet.monitor.system`): per-GPU utilisation and memory
  timelines for every host, host CPU and memory;
* ``diagnosis.json`` (:func:`~gpufleet.monitor.diagnose.findings_for_run`): the findings;
* ``config.toml``: the resolved config, folded away at the end.

Example:
    >>> import tempfile, pathlib
    >>> run = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (run / "metrics.jsonl").write_text('{"kind": "train", "time": 0, "step": 1, '
    ...     '"loss": 2.0, "lr": 0.1, "samples_per_s": 10.0}\\n')
    >>> write_report(run).name
    'report.html'
"""

from __future__ import annotations

import json
import logging
import time
from html import escape
from pathlib import Path
from statistics import median
from typing import Any

from gpufleet.errors import GpufleetError
from gpufleet.monitor.accounting import PARTS, TOLERANCE, mean_accounting
from gpufleet.monitor.diagnose import Finding, findings_for_run
from gpufleet.monitor.report_expected import CSS as EXPECTED_CSS
from gpufleet.monitor.report_expected import expected_section
from gpufleet.monitor.report_receipts import CSS as RECEIPTS_CSS
from gpufleet.monitor.report_receipts import receipts_section
from gpufleet.monitor.report_svg import Series, line_chart, stacked_bars
from gpufleet.monitor.system import read_system

log = logging.getLogger(__name__)

REPORT_FILE = "report.html"
PHASES = ("data", "forward", "backward", "optimizer", "other")
RUN_MARKERS = ("config.toml", "metrics.jsonl")  # a directory with one of these is a run

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px auto;
max-width:1120px;color:#222;background:#fff}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid
#ddd;padding-bottom:4px}.sub{color:#666;margin:0 0 12px}
table.kv td{padding:2px 14px 2px 0;vertical-align:top}table.kv td:first-child{color:#666}
.finding{border-left:5px solid #999;padding:6px 12px;margin:8px 0;background:#f7f7f7}
.finding.warn{border-color:#e15759;background:#fdf0f0}.finding.info{border-color:#4e79a7;
background:#eef3f9}.finding .fix{margin-top:4px}.note{color:#777;font-style:italic}
figure.chart{margin:8px 0 18px}svg.chart{display:block;max-width:100%;height:auto}
.legend{display:flex;flex-wrap:wrap;gap:4px 18px;padding-left:70px;font-size:12px;color:#333}
.legend .key{white-space:nowrap}.legend i{display:inline-block;width:18px;height:0;
border-top:4px solid;margin-right:6px;vertical-align:middle}.legend i.dashed{border-top-style:
dashed}table.values td,table.values th{padding:2px 12px 2px 0;text-align:right}
svg .grid{stroke:#e5e5e5}svg .frame{fill:none;stroke:#bbb}svg text{font-family:inherit}
svg .tick{font-size:11px;fill:#555}svg .axis{font-size:12px;fill:#333}
svg .title{font-size:14px;font-weight:600;fill:#222}
pre{background:#f6f6f6;padding:10px;overflow:auto;font-size:12px}
"""


class ReportError(GpufleetError, ValueError):
    """A report was asked for a directory that is not a run directory."""


def check_run_dir(run_dir: str | Path) -> Path:
    """``run_dir`` as a Path; ReportError naming the fix when it is not a run directory."""
    path = Path(run_dir)
    if not path.exists():
        siblings = sorted(p.name for p in path.parent.glob("*") if p.is_dir()) \
            if path.parent.is_dir() else []
        from gpufleet.errors import did_you_mean

        guess = did_you_mean(path.name, siblings)
        hint = f" Did you mean {str(path.parent / guess)!r}?" if guess else ""
        raise ReportError(f"run directory {str(path)!r} does not exist.{hint} Pass the "
                          "directory a run wrote, e.g. runs/<name>-<date>-<time>.")
    if not path.is_dir() or not any((path / m).is_file() for m in RUN_MARKERS):
        raise ReportError(f"{str(path)!r} is not a run directory: it has no "
                          f"{' or '.join(RUN_MARKERS)}. Pass the directory a run wrote "
                          "(its path is printed at the end of `gpufleet train`).")
    return path


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every record of ``metrics.jsonl`` (lines that do not parse are skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    records = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def write_report(run_dir: str | Path) -> Path:
    """Write ``<run_dir>/report.html`` from what the run recorded; returns its path.

    Raises:
        ReportError: ``run_dir`` does not exist or is not a run directory.
    """
    path = check_run_dir(run_dir)
    html = render_report(path, read_metrics(path), read_system(path), findings_for_run(path))
    out = path / REPORT_FILE
    tmp = out.with_suffix(".html.tmp")
    tmp.write_text(html, encoding="utf-8")
    tmp.replace(out)  # a reader never sees half a report
    log.info("report written: %s", out)
    return out


def render_report(run_dir: Path, metrics: list[dict[str, Any]], system: list[dict[str, Any]],
                  findings: list[Finding]) -> str:
    """The report page as one HTML string."""
    train = [r for r in metrics if r.get("kind") == "train" and "step" in r]
    evals = [r for r in metrics if r.get("kind") == "eval" and "eval_loss" in r]
    body = [f"<h1>{escape(run_dir.name)}</h1>",
            f'<p class="sub">{escape(str(run_dir.resolve()))} · report written '
            f'{time.strftime("%Y-%m-%d %H:%M:%S")}</p>',
            _summary(train, evals, system),
            "<h2>Diagnosis</h2>", _diagnosis(findings),
            "<h2>Training</h2>", *_training(train, evals),
            *receipts_section(run_dir),
            "<h2>Step accounting</h2>", *_accounting(train), *expected_section(run_dir),
            "<h2>Step time by phase</h2>", *_phases(train),
            "<h2>GPUs</h2>", *_gpus(system),
            "<h2>Host</h2>", *_host(system), _config(run_dir)]
    return ("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>gpufleet report: {escape(run_dir.name)}</title>"
            f"<style>{_CSS}{RECEIPTS_CSS}{EXPECTED_CSS}</style></head><body>\n" + "\n".join(body)
            + "\n</body></html>\n")


def _note(text: str) -> str:
    return f'<p class="note">{escape(text)}</p>'


def _summary(train: list[dict], evals: list[dict], system: list[dict]) -> str:
    rows: list[tuple[str, str]] = []
    if train:
        last = train[-1]
        rows.append(("steps", str(last["step"])))
        rows.append(("loss", f"{train[0]['loss']:.4f} (step {train[0]['step']}) → "
                             f"{last['loss']:.4f} (step {last['step']})"))
        steady = train[1:] or train
        for key, unit in (("samples_per_s", "samples/s"), ("tokens_per_s", "tokens/s")):
            values = [r[key] for r in steady if r.get(key)]
            if values:
                rows.append((f"throughput (median, {unit})", f"{median(values):,.1f}"))
        if last.get("mfu") is not None:
            rows.append(("MFU (last interval)", f"{last['mfu']:.1%}"))
    if evals:
        best = min(evals, key=lambda r: r["eval_loss"])
        rows.append(("best eval loss", f"{best['eval_loss']:.4f} (step {best.get('step')})"))
        last_metrics = evals[-1].get("eval_metrics") or {}
        rows += [(f"eval {name} (step {evals[-1].get('step')})", f"{value:.4f}")
                 for name, value in last_metrics.items()]
    if system:
        hosts = sorted({s.get("host", "?") for s in system})
        names = sorted({g.get("name", "?") for s in system for g in s.get("gpus", [])})
        per_host = max(len(s.get("gpus", [])) for s in system)
        rows.append(("hosts", ", ".join(hosts)))
        rows.append(("GPUs", f"{per_host} per host: {', '.join(names)}" if names else "none"))
        span = max(s["time"] for s in system) - min(s["time"] for s in system)
        rows.append(("sampled", f"{len(system)} samples over {span:.0f} s"))
    if not rows:
        return _note("This run recorded no metrics yet.")
    cells = "".join(f"<tr><td>{escape(k)}</td><td>{escape(v)}</td></tr>" for k, v in rows)
    return f'<table class="kv">{cells}</table>'


def _diagnosis(findings: list[Finding]) -> str:
    if not findings:
        return _note("No finding recorded: either nothing limits the run, or the run "
                     "ended before the first diagnosis.")
    return "\n".join(
        f'<div class="finding {escape(f.severity)}"><b>[{escape(f.severity)}] '
        f"{escape(f.title)}</b> <span class=\"note\">(step {f.step}, {escape(f.rule)})</span>"
        f"<div>{escape(f.message)}</div><div class=\"fix\"><b>Fix:</b> {escape(f.fix)}</div>"
        "</div>" for f in findings)


def _curve(records: list[dict], key: str, scale: float = 1.0) -> list[tuple[float, float]]:
    return [(r["step"], r[key] * scale) for r in records if r.get(key) is not None]


MIN_CURVE_POINTS = 3  # fewer log intervals than this: a table of values, not curves


def _training(train: list[dict], evals: list[dict]) -> list[str]:
    if not train and not evals:
        return [_note("No training metrics in metrics.jsonl.")]
    if len(train) < MIN_CURVE_POINTS:
        return _values_table(train, evals)
    out = [line_chart("Loss", [Series("train loss", _curve(train, "loss")),
                               Series("eval loss", _curve(evals, "eval_loss"), dots=True)],
                      "optimizer step", "loss", y_min=None)]
    for name in _eval_metric_names(evals):
        out.append(line_chart(f"Eval {name}", [Series(name, _eval_curve(evals, name),
                                                      dots=True)],
                              "optimizer step", name, y_min=None))
    out.append(line_chart("Learning rate", [Series("lr", _curve(train, "lr"))],
                          "optimizer step", "learning rate"))
    if any(r.get("grad_norm") for r in train):  # absent: nothing measured it (no clip)
        out.append(line_chart("Gradient norm (before clipping)",
                              [Series("grad norm", _curve(train, "grad_norm"))],
                              "optimizer step", "L2 norm"))
    tokens = _curve(train, "tokens_per_s")
    rate = Series("tokens/s", tokens) if tokens else Series("samples/s",
                                                           _curve(train, "samples_per_s"))
    if rate.points:
        out.append(line_chart("Throughput (all ranks)", [rate], "optimizer step", rate.name))
    # MFU needs a known peak (a GPU in the table, or monitor.peak_tflops): no line when
    # the run has none, and no word of it in the title.
    shares = [s for s in (Series("data wait", _curve(train, "data_wait_share", 100)),
                          Series("MFU", _curve(train, "mfu", 100))) if s.points]
    if shares:
        title = " and ".join("MFU" if s.name == "MFU" else "Data-wait share" for s in shares)
        out.append(line_chart(title, shares, "optimizer step", "%", y_max=100))
    return out


def _eval_metric_names(evals: list[dict]) -> list[str]:
    return list(dict.fromkeys(k for r in evals for k in (r.get("eval_metrics") or {})))


def _eval_curve(evals: list[dict], name: str) -> list[tuple[float, float]]:
    return [(r["step"], r["eval_metrics"][name]) for r in evals
            if (r.get("eval_metrics") or {}).get(name) is not None]


_COLUMNS = (("loss", "loss", "{:.4f}"), ("lr", "lr", "{:.2e}"), ("grad norm", "grad_norm",
            "{:.3g}"), ("samples/s", "samples_per_s", "{:,.1f}"), ("tokens/s", "tokens_per_s",
            "{:,.0f}"), ("data wait", "data_wait_share", "{:.0%}"), ("MFU", "mfu", "{:.1%}"))


def _values_table(train: list[dict], evals: list[dict]) -> list[str]:
    """The numbers of a run too short for curves, one row per log interval/evaluation."""
    out = [_note(f"{len(train)} log interval(s): too few for curves, so the values are "
                 "listed. A smaller log.every gives more points.")]
    cols = [c for c in _COLUMNS if any(r.get(c[1]) is not None for r in train)]
    if train:
        head = "".join(f"<th>{escape(name)}</th>" for name, _, _ in cols)
        rows = "".join("<tr><td>" + str(r["step"]) + "</td>" + "".join(
            f"<td>{fmt.format(r[key]) if r.get(key) is not None else '-'}</td>"
            for _, key, fmt in cols) + "</tr>" for r in train)
        out.append(f'<table class="values"><tr><th>step</th>{head}</tr>{rows}</table>')
    if evals:
        names = _eval_metric_names(evals)
        head = "".join(f"<th>{escape(n)}</th>" for n in names)
        rows = "".join(f"<tr><td>{r['step']}</td><td>{r['eval_loss']:.4f}</td>" + "".join(
            f"<td>{(r.get('eval_metrics') or {}).get(n, float('nan')):.4f}</td>"
            for n in names) + "</tr>" for r in evals)
        out.append(f'<table class="values"><tr><th>step</th><th>eval loss</th>{head}</tr>'
                   f"{rows}</table>")
    return out


def _phases(train: list[dict]) -> list[str]:
    """Stacked bars per rank (mean per step over the intervals after the first, which
    holds the warm-up), and rank 0's phases over the run."""
    with_ranks = [r for r in train if r.get("rank_phases")]
    with_phases = [r for r in train if r.get("phases")]
    if not with_ranks and not with_phases:
        return [_note("No phase timings in metrics.jsonl (monitor.phases = false, or a "
                      "run from before they were recorded).")]
    out = []
    if with_ranks:
        steady = with_ranks[1:] or with_ranks
        sums: dict[int, dict[str, float]] = {}
        for rec in steady:
            for rp in rec["rank_phases"]:
                acc = sums.setdefault(int(rp["rank"]), dict.fromkeys(PHASES, 0.0))
                for p in PHASES:
                    acc[p] += rp.get(p, 0.0) * 1000 / len(steady)
        rows = [(f"rank {r}", sums[r]) for r in sorted(sums)]
        out.append(stacked_bars(f"Step time per rank (mean over {len(steady)} log "
                                "interval(s))", rows, PHASES, "ms"))
    elif with_phases:
        steady = with_phases[1:] or with_phases
        mean = {p: sum(r["phases"].get(p, 0.0) for r in steady) * 1000 / len(steady)
                for p in PHASES}
        out.append(stacked_bars("Step time, rank 0 (mean)", [("rank 0", mean)], PHASES, "ms"))
    if len(with_phases) >= MIN_CURVE_POINTS:
        out.append(line_chart("Rank 0 phases over the run", [
            Series(p, [(r["step"], r["phases"].get(p, 0.0) * 1000) for r in with_phases])
            for p in PHASES], "optimizer step", "ms per step"))
    return out


# The accounting's parts as the report's legend names them (host overhead is not
# measured: it stays inside its phase, and is left out of the bars).
_PART_NAMES = {"data": "data wait", "forward": "forward", "backward": "backward compute",
               "exposed_comm": "exposed communication", "late_ranks": "waiting for late ranks",
               "optimizer": "optimizer", "host": "host overhead",
               "eval_checkpoint": "checkpoint and evaluation", "other": "other"}


def _accounting(train: list[dict]) -> list[str]:
    """One stacked bar per rank: the parts of its step (mean over the intervals after
    the first), the step clock as a tick across it, and the residual beside it."""
    with_acc = [r for r in train if r.get("rank_accounting")]
    if not with_acc:
        return [_note("No step accounting in metrics.jsonl (monitor.phases = false, or a "
                      "run from before it was recorded).")]
    steady = with_acc[1:] or with_acc
    # Each interval weighs as many steps as it holds.
    steps = [max(1, r["step"] - p["step"]) for p, r in zip(with_acc, steady)] \
        if len(with_acc) > 1 else [1]
    mean = mean_accounting([r["rank_accounting"] for r in steady], steps)
    names = [_PART_NAMES[p] for p in PARTS if p in _PART_NAMES]
    rows, measured, notes = [], [], []
    for row in mean:
        rows.append((f"rank {row['rank']}", {_PART_NAMES[p]: (row.get(p) or 0.0) * 1000
                                             for p in _PART_NAMES}))
        measured.append(row.get("step", 0.0) * 1000)
        share = row.get("residual_share", 0.0)
        flag = "" if abs(share) <= TOLERANCE else " (over 5%)"
        notes.append(f"measured {row.get('step', 0.0) * 1000:.4g} ms, residual "
                     f"{row.get('residual', 0.0) * 1000:+.2f} ms ({share:+.1%}){flag}")
    out = [stacked_bars(f"Where each rank's step went (mean over {len(steady)} log "
                        "interval(s); the black tick is the measured step)", rows, names,
                        "ms", measured=measured, notes=notes)]
    unmeasured = [f"rank {r['rank']}" for r in mean if not r.get("comm_measured", True)]
    if any(r.get("host") is not None for r in mean):
        text = ("Host overhead: the time of forward, backward and the optimizer step "
                "spent outside any operator (Python, the dispatcher, hooks), from a "
                "sampled step's time inside operators; those three parts are then their "
                "operators' time.")
    else:
        text = ("Host overhead (Python between operators and launches) is not measured "
                "here (CUDA, torch.compile, or no sampled step yet): it stays inside the "
                "phase it ran in.")
    if unmeasured:
        text += (f" The collectives' time of {', '.join(unmeasured)} was not measured "
                 "apart (a communication hook of your own, or one process): it stays "
                 "inside forward and backward.")
    out.append(_note(text))
    return out


def _timeline(system: list[dict]) -> tuple[float, dict[str, list[dict]]]:
    t0 = min(s["time"] for s in system)
    hosts: dict[str, list[dict]] = {}
    for s in system:
        hosts.setdefault(s.get("host", "?"), []).append(s)
    return t0, hosts


def _gpus(system: list[dict]) -> list[str]:
    if not any(s.get("gpus") for s in system):
        return [_note("No GPU samples: system.jsonl has no GPU readings (no NVIDIA GPU or "
                      "driver on the machine, or monitor.system_interval_s = 0).")]
    t0, hosts = _timeline(system)
    out = []
    for host, samples in sorted(hosts.items()):
        util: dict[int, list] = {}
        mem: dict[int, list] = {}
        total = 0.0
        for s in samples:
            for g in s.get("gpus", []):
                t = s["time"] - t0
                if g.get("util_pct") is not None:
                    util.setdefault(g["index"], []).append((t, g["util_pct"]))
                if g.get("mem_used_mb") is not None:
                    mem.setdefault(g["index"], []).append((t, g["mem_used_mb"] / 1024))
                    total = max(total, (g.get("mem_total_mb") or 0) / 1024)
        out.append(line_chart(f"{host}: GPU utilisation", [
            Series(f"GPU {i}", pts) for i, pts in sorted(util.items())],
            "seconds since the first sample", "utilisation %", y_max=100))
        out.append(line_chart(f"{host}: GPU memory used (of {total:.1f} GB)", [
            Series(f"GPU {i}", pts) for i, pts in sorted(mem.items())],
            "seconds since the first sample", "GB", y_max=total or None))
    return out


def _host(system: list[dict]) -> list[str]:
    if not system:
        return [_note("No system samples (system.jsonl is missing: "
                      "monitor.system_interval_s = 0, or the run predates it).")]
    t0, hosts = _timeline(system)
    cpu, ram = [], []
    for host, samples in sorted(hosts.items()):
        cpu.append(Series(f"{host} all cores", [
            (s["time"] - t0, sum(s["cpu_pct"]) / len(s["cpu_pct"]))
            for s in samples if s.get("cpu_pct")]))
        cpu.append(Series(f"{host} training", [
            (s["time"] - t0, s["proc_cpu_pct"] / max(1, len(s.get("cpu_pct") or [1])))
            for s in samples if s.get("proc_cpu_pct") is not None], dashed=True))
        ram.append(Series(f"{host} RAM used", [(s["time"] - t0, s["ram_used_mb"] / 1024)
                                               for s in samples if "ram_used_mb" in s]))
        ram.append(Series(f"{host} training RSS", [
            (s["time"] - t0, s["proc_rss_mb"] / 1024) for s in samples
            if s.get("proc_rss_mb") is not None], dashed=True))
    return [line_chart("Host CPU (share of all cores)", cpu, "seconds since the first sample",
                       "%", y_max=100),
            line_chart("Host memory", ram, "seconds since the first sample", "GB")]


def _config(run_dir: Path) -> str:
    path = run_dir / "config.toml"
    if not path.is_file():
        return ""
    return (f"<h2>Config</h2><details><summary>config.toml</summary><pre>"
            f"{escape(path.read_text())}</pre></details>")
