"""What the GPU suite's stages measured, read back from their files, and the markdown for
benchmarks/HISTORY.md. Used by ``benchmarks/gpu_suite.py``.

Each ``_summary_<stage>`` reads what its stage wrote (a log, a run directory or a JSON
file) into a small dict of numbers; :func:`targets` checks them against the issue's
targets; :func:`render_markdown` lays everything out.
"""

from __future__ import annotations

import datetime
import json
import platform
import re
import statistics
from pathlib import Path
from typing import Any

import torch

from gpufleet.core.machine import machine_summary

MFU_TARGET = 0.50  # bf16 + compile, against the dense bf16 peak
BF16_SPEEDUP_TARGET = 2.0  # bf16 tokens/s over fp32 tokens/s
HAND_RATIO_TARGET = 1.02  # gpufleet step time / hand-written loop step time
MONITOR_RATIO_TARGET = 1.01  # step time with a monitor part on / all off
PEER_RATIO_TARGET = 1.02  # gpufleet (defaults, Fleet) step time / Lightning Fabric's
CURVE_MEAN_DIFF = 0.05  # fp32 vs bf16 loss curves: mean |diff| in nats, "within noise"


def machine_facts() -> dict[str, Any]:
    """GPU name, driver, torch / CUDA / cuDNN / NCCL versions and the host, for the header."""
    facts: dict[str, Any] = {
        "summary": machine_summary(), "torch": torch.__version__,
        "cuda_version": torch.version.cuda, "python": platform.python_version(),
        "cuda": torch.cuda.is_available(), "date_utc": datetime.datetime.now(
            datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    if facts["cuda"]:
        facts["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        facts["cudnn"] = torch.backends.cudnn.version()
        nccl = getattr(torch.cuda, "nccl", None)
        try:
            facts["nccl"] = ".".join(map(str, nccl.version())) if nccl else None
        except Exception:  # a build without NCCL
            facts["nccl"] = None
    facts["driver"] = _driver_version()
    return facts


def _driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
            return version.decode() if isinstance(version, bytes) else version
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver, no NVML: a CPU machine
        return None


def summarize(stage: str, ctx: Any, status: str) -> dict[str, Any]:
    """The numbers of one finished (or failed) stage; empty when it left nothing."""
    reader = {"tests": _summary_tests, "new_paths": lambda c: _summary_tests(c, "new_paths"),
              "default_job": _summary_default_job,
              "mfu": _summary_mfu, "monitor": _summary_monitor,
              "prefetch": _summary_prefetch, "peers": _summary_peers}.get(stage)
    return reader(ctx) if reader is not None else {}


def _read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def _summary_tests(ctx: Any, stage: str = "tests") -> dict[str, Any]:
    log = (ctx.out / f"{stage}.log").read_text(errors="replace")
    counts = {}
    tail = [line for line in log.splitlines() if re.search(r"\d+ (passed|failed|skipped|"
                                                           r"error|deselected)", line)]
    if tail:
        for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)",
                                  tail[-1]):
            counts[what.rstrip("s") if what.startswith("error") else what] = int(n)
    problems = [line for line in log.splitlines() if line.startswith(("FAILED", "ERROR"))]
    skips = [line for line in log.splitlines() if line.startswith("SKIPPED")]
    return {"counts": counts, "problems": problems[:30], "skips": skips[:10]}


def _summary_default_job(ctx: Any) -> dict[str, Any]:
    path = ctx.work / "default-job" / "metrics.jsonl"
    if not path.exists():
        return {}
    records = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    train = [r for r in records if r.get("kind") == "train" and "tokens_per_s" in r]
    late = train[1:] or train  # the first interval holds start-up
    evals = [r["eval_loss"] for r in records if r.get("kind") == "eval"]
    mfus = [r["mfu"] for r in late if r.get("mfu") is not None]
    out: dict[str, Any] = {
        "steps": train[-1]["step"] if train else 0,
        "first_loss": train[0]["loss"] if train else None,
        "final_loss": train[-1]["loss"] if train else None,
        "eval_loss": evals[-1] if evals else None,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in late) if late else None,
        "mfu": statistics.median(mfus) if mfus else None}
    config = ctx.work / "default-job" / "config.toml"
    if config.exists():
        from gpufleet.config import load_config

        cfg = load_config(config)
        out.update(device=cfg.run.device, precision=cfg.precision.mode,
                   strategy=cfg.parallel.strategy)
    return out


def _summary_mfu(ctx: Any) -> dict[str, Any]:
    return _read_json(ctx.work / "mfu.json") or {}


def _summary_monitor(ctx: Any) -> dict[str, Any]:
    return _read_json(ctx.work / "monitor.json") or {}


def _summary_prefetch(ctx: Any) -> dict[str, Any]:
    return _read_json(ctx.work / "prefetch.json") or {}


PEER_JOBS = ("mlp", "gpt")


def _summary_peers(ctx: Any) -> dict[str, Any]:
    """Each job's table (``mlp``, ``gpt``), the input paths' (``input_path``) and the
    guard's stand-ins' (``guard_floor``), as far as the stage wrote them."""
    found = {job: table for job in PEER_JOBS
             if (table := _read_json(ctx.work / f"peers_{job}.json"))}
    for name in ("input_path", "guard_floor"):
        if table := _read_json(ctx.work / f"{name}.json"):
            found[name] = table
    return found


# -- targets ------------------------------------------------------------------------------

def targets(stages: dict[str, dict[str, Any]]) -> list[tuple[str, str, str]]:
    """``(target, measured, verdict)`` rows; verdict is met / MISSED / not measured."""
    rows: list[tuple[str, str, str]] = []
    mfu_rows = stages.get("mfu", {}).get("rows", [])
    by_label = {(r["precision"], bool(r.get("compile"))): r for r in mfu_rows}
    compiled = by_label.get(("bf16-mixed", True))
    rows.append(_check(f"MFU bf16 + compile >= {MFU_TARGET:.0%}",
                       compiled and compiled.get("mfu"), lambda v: v >= MFU_TARGET,
                       lambda v: f"{v:.1%}"))
    fp32, bf16 = by_label.get(("fp32", False)), by_label.get(("bf16-mixed", False))
    speedup = bf16["tokens_per_s"] / fp32["tokens_per_s"] if fp32 and bf16 else None
    rows.append(_check(f"bf16 tokens/s >= {BF16_SPEEDUP_TARGET:g}x fp32", speedup,
                       lambda v: v >= BF16_SPEEDUP_TARGET, lambda v: f"{v:.2f}x"))
    ratios = [r["ratio"] for r in mfu_rows if r.get("ratio") is not None]
    rows.append(_check(f"gpufleet / hand-written step time <= {HAND_RATIO_TARGET} (worst row)",
                       max(ratios) if ratios else None, lambda v: v <= HAND_RATIO_TARGET,
                       lambda v: f"{v:.3f}"))
    curves = stages.get("mfu", {}).get("curves")
    rows.append(_check(f"fp32 vs bf16 loss curves: mean abs diff <= {CURVE_MEAN_DIFF}",
                       curves and curves.get("mean_abs_diff"),
                       lambda v: v <= CURVE_MEAN_DIFF, lambda v: f"{v:.4f}"))
    for r in stages.get("monitor", {}).get("rows", []):
        # A part turned on cannot make a step faster: a ratio well under 1 is the noise
        # of the run, and says nothing either way.
        rows.append(_check(f"monitor '{r['row']}' on / off <= {MONITOR_RATIO_TARGET}",
                           r["ratio"], lambda v: v <= MONITOR_RATIO_TARGET,
                           lambda v: f"{v:.3f}", noise_below=1 - 5 * (MONITOR_RATIO_TARGET - 1)))
    for job, table in stages.get("peers", {}).items():
        if job not in PEER_JOBS:
            continue
        loops = {r["loop"]: r["wall_us"] for r in table.get("rows", [])}
        fabric = loops.get("Lightning Fabric")
        for loop in ("gpufleet defaults", "gpufleet Fleet"):
            value = loops[loop] / fabric if fabric and loop in loops else None
            rows.append(_check(f"peers {job}: {loop} / Fabric <= {PEER_RATIO_TARGET}",
                               value, lambda v: v <= PEER_RATIO_TARGET,
                               lambda v: f"{v:.3f}"))
    return rows


def _check(name: str, value: Any, ok: Any, fmt: Any,
           noise_below: float | None = None) -> tuple[str, str, str]:
    """A target's row; a value under ``noise_below`` is read as noise, not as met."""
    if value is None or value is False:
        return name, "n/a", "not measured"
    if noise_below is not None and value < noise_below:
        return name, fmt(value), "inconclusive (noise: on faster than off)"
    return name, fmt(value), "met" if ok(value) else "MISSED"


# -- markdown -----------------------------------------------------------------------------

def render_markdown(data: dict[str, Any]) -> str:
    m = data["machine"]
    gpus = ", ".join(m.get("gpus") or []) or "no CUDA GPU"
    lines = [f"## GPU check (`scripts/gpu_check.sh{' --dry-run' if data['dry_run'] else ''}`)",
             "", f"Machine: {gpus}; driver {m.get('driver') or 'n/a'}; torch {m['torch']}, "
             f"CUDA {m.get('cuda_version') or 'n/a'}, cuDNN {m.get('cudnn') or 'n/a'}, NCCL "
             f"{m.get('nccl') or 'n/a'}; {m['summary']} ({m['date_utc']}).", ""]
    if data["dry_run"]:
        lines += ["**Dry run**: tiny sizes, to check the plumbing; no number below is a "
                  "GPU measurement.", ""]
    lines += ["| stage | status | seconds | limit |", "|---|---|---|---|"]
    lines += [f"| {s['name']} | {s['status']} | {s['seconds']:.0f} | {s['timeout_s']:.0f} |"
              for s in data["stages"]]
    stages = {s["name"]: s["summary"] for s in data["stages"]}
    lines += ["", "| target | measured | verdict |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {'dry run, no verdict' if data['dry_run'] else c} |"
              for a, b, c in targets(stages)]
    for name, render in (("tests", _md_tests), ("new_paths", _md_new_paths),
                         ("default_job", _md_default_job),
                         ("mfu", _md_mfu), ("monitor", _md_monitor),
                         ("prefetch", _md_prefetch), ("peers", _md_peers)):
        if stages.get(name):
            lines += ["", *render(stages[name])]
    return "\n".join(lines) + "\n"


def _fmt(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _md_tests(s: dict[str, Any]) -> list[str]:
    counts = ", ".join(f"{n} {what}" for what, n in s.get("counts", {}).items()) or "no summary"
    out = [f"`pytest -m gpu`: {counts}."]
    out += [f"- {line}" for line in s.get("problems", [])]
    out += [f"- {line}" for line in s.get("skips", [])]
    return out


def _md_new_paths(s: dict[str, Any]) -> list[str]:
    first, *rest = _md_tests(s)
    return [first.replace("`pytest -m gpu`", "This turn's CUDA paths (`new_paths`, "
                          "`pytest -m gpu tests/gpu/test_cuda_new_paths.py`)"), *rest]


def _md_default_job(s: dict[str, Any]) -> list[str]:
    return [f"Default job (`gpufleet train`, {s.get('device')}, {s.get('precision')}, "
            f"{s.get('strategy')}): {s.get('steps')} steps, loss {_fmt(s.get('first_loss'), '.4f')}"
            f" -> {_fmt(s.get('final_loss'), '.4f')}, eval {_fmt(s.get('eval_loss'), '.4f')}, "
            f"{_fmt(s.get('tokens_per_s'), ',.0f')} tokens/s, MFU {_fmt(s.get('mfu'), '.1%')} "
            "(medians over the log intervals after the first)."]


def _md_mfu(s: dict[str, Any]) -> list[str]:
    shape = s.get("shape", {})
    out = [f"`benchmarks/mfu.py` on {s.get('device')}: GPT {shape.get('n_layer')} layers, "
           f"{shape.get('n_embd')} wide, seq {shape.get('seq')}, batch {shape.get('batch')}, "
           f"vocab {shape.get('vocab')}; {s.get('steps')} steps per row, first "
           f"{s.get('warmup')} not timed; FLOPs/step {_fmt(s.get('flops_analytic'), '.3e')}"
           f" (formula; counted {_fmt(s.get('flops_counted'), '.3e')}).", "",
           "| config | ms/step | tokens/s | MFU | peak | hand ms/step | gpufleet/hand |",
           "|---|---|---|---|---|---|---|"]
    for r in s.get("rows", []):
        hand = r.get("hand_step_s")
        peak = (f"{r['peak_flops'] / 1e12:.0f} TFLOP/s {r.get('peak_precision')}"
                if r.get("peak_flops") else "n/a")
        out.append(f"| {r['config']} | {r['step_s'] * 1e3:.2f} | {r['tokens_per_s']:,.0f} | "
                   f"{_fmt(r.get('mfu'), '.1%')} | {peak} | "
                   f"{_fmt(hand and hand * 1e3, '.2f')} | {_fmt(r.get('ratio'), '.3f')} |")
    curves = s.get("curves")
    if curves:
        out += ["", f"Loss curves fp32 vs bf16 over {len(curves['fp32'])} steps: max abs diff "
                f"{curves['max_abs_diff']:.4f}, mean abs diff {curves['mean_abs_diff']:.4f}; "
                f"final {curves['fp32'][-1]:.4f} vs {curves['bf16-mixed'][-1]:.4f}."]
    return out


def _md_monitor(s: dict[str, Any]) -> list[str]:
    out = [f"`benchmarks/monitor_overhead.py` ({s.get('model')} on {s.get('device')}, "
           f"{s.get('steps')} interleaved steps, batch {s.get('batch')}):", "",
           "| part on vs all off | width | off ms/step | on ms/step | ratio |",
           "|---|---|---|---|---|"]
    out += [f"| {r['row']} | {r['width']} | {r['off_s'] * 1e3:.3f} | {r['on_s'] * 1e3:.3f} | "
            f"{r['ratio']:.3f} |" for r in s.get("rows", [])]
    return out


def _md_prefetch(s: dict[str, Any]) -> list[str]:
    out = ["`benchmarks/prefetch.py` (medians):", "",
           "| prefetch | ms/step | host data wait ms | GPU data phase ms |", "|---|---|---|---|"]
    for name, r in s.get("summary", {}).items():
        out.append(f"| {name} | {_fmt(r['step_s'] and r['step_s'] * 1e3, '.3f')} | "
                   f"{_fmt(r['data_wait_s'] and r['data_wait_s'] * 1e3, '.3f')} | "
                   f"{_fmt(r['device_data_s'] and r['device_data_s'] * 1e3, '.3f')} |")
    out += ["", f"Step time off / on: {_fmt(s.get('off_over_on'), '.3f')}."]
    return out


def _md_peers(tables: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for job in PEER_JOBS:
        if job in tables:
            out += [*([""] if out else []), *_md_peer_table(tables[job])]
    if "input_path" in tables:
        out += [*([""] if out else []), *_md_input_paths(tables["input_path"])]
    if "guard_floor" in tables:
        out += [*([""] if out else []), *_md_guard_floor(tables["guard_floor"])]
    return out


def _md_guard_floor(s: dict[str, Any]) -> list[str]:
    rows = s.get("rows", [])
    fabric = next((r for r in rows if r["loop"] == "Lightning Fabric" and not r.get("error")),
                  None)
    out = [f"`benchmarks/guard_floor.py` ({s.get('device')}; {s.get('steps')} steps each, "
           f"turns of {s.get('turn_steps')}; block medians):", "",
           "| loop | wall µs/step | CPU µs/step | wall vs Fabric |", "|---|---|---|---|"]
    return out + [f"| {r['loop']} | {r['wall_us']:.1f} | {r['cpu_us']:.1f} | "
                  f"{_fmt(fabric and r['wall_us'] / fabric['wall_us'], '.3f')} |"
                  if not r.get("error") else f"| {r['loop']} | failed: {r['error']} | | |"
                  for r in rows]


def _md_input_paths(s: dict[str, Any]) -> list[str]:
    out = [f"`benchmarks/input_path.py` ({s.get('device')}; batches of {s.get('batch')} x "
           f"{s.get('features')}; host µs a batch, medians of turns):", "",
           "| path | wall µs | CPU µs | vs Fabric's |", "|---|---|---|---|"]
    return out + [f"| {r['path']} | {r['wall_us']:.1f} | {r['cpu_us']:.1f} | "
                  f"{r['ratio']:.3f} |" for r in s.get("rows", [])]


def _md_peer_table(s: dict[str, Any]) -> list[str]:
    rows = s.get("rows", [])
    fabric = next((r["wall_us"] for r in rows if r["loop"] == "Lightning Fabric"), None)
    out = [f"`benchmarks/peers.py` ({s.get('job')}; {s.get('device')}, {s.get('precision')}; "
           f"{s.get('steps')} steps each, turns of {s.get('turn_steps')}; block medians):", "",
           "| loop | wall µs/step | CPU µs/step | vs Fabric | first step s |",
           "|---|---|---|---|---|"]
    out += [f"| {r['loop']} | {r['wall_us']:.1f} | {r['cpu_us']:.1f} | "
            f"{_fmt(fabric and r['wall_us'] / fabric, '.3f')} | {r['first_s']:.3f} |"
            if not r.get("error") else f"| {r['loop']} | failed: {r['error']} | | | |"
            for r in rows]
    return out
