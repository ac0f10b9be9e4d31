"""Run Lightning's own Fabric tests against gpufleet's Fleet and count the results.

    python scripts/fabric_conformance.py --lightning PATH [--timeout 60] [--json OUT]

PATH is a Lightning checkout (a clone or an unpacked archive of a tag) that holds
``tests/tests_fabric``; nothing is fetched at run time and no Lightning test file is
carried in this repository. The installed ``lightning`` package (the ``test`` extra)
provides everything else. Before collection, ``lightning.Fabric``,
``lightning.fabric.Fabric`` and ``lightning.fabric.fabric.Fabric`` are replaced by
``gpufleet.Fleet``, so every test that builds a ``Fabric`` builds a ``Fleet``.

Each failing test gets one cause:

- "Lightning internals": the failure names a private name (``fabric._strategy``,
  ``_launched``, ``_connector``, a keyword starting with ``_``, Lightning's private
  wrapper classes), the test's failing line reads or sets such a name, or a mock the test
  put into Lightning expected Lightning's internal calls.
- "deliberate refusal": gpufleet refuses on purpose (``load(weights_only=False)``,
  ``strategy="xla"``, a part of Lightning's Strategy object ``fleet.strategy`` does not
  give: its launcher, its precision plugin).
- "difference": everything else, grouped by the exception's type and first line.

Tests that never built a ``Fleet`` are counted apart (they test Lightning's own parts).
"""
from __future__ import annotations

import argparse
import atexit
import datetime
import inspect
import json
import os
import platform
import re
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from gpufleet.fleet.strategy import OFFERED

# Test files whose tests build a Fabric object and run on CPU (the rest test Lightning's
# strategies, accelerators and plugins on their own, or need GPUs, TPUs or DeepSpeed).
DEFAULT_FILES = (
    "test_fabric.py",
    "test_wrappers.py",
    "strategies/test_single_device.py",
    "strategies/test_dp.py",
    "strategies/test_ddp_integration.py",
    "strategies/launchers/test_multiprocessing_integration.py",
    "plugins/precision/test_double_integration.py",
    "plugins/precision/test_amp_integration.py",
    "utilities/test_throughput.py",
)
# 24 tests that each start ranks (about 8 minutes on 2 cores): pass them with --files
SLOW_FILES = ("utilities/test_spike.py",)

INTERNALS = "Lightning internals"
REFUSAL = "deliberate refusal"
DIFFERENCE = "difference"

_PRIVATE_NAMES = re.compile(
    r"_strategy|_launched|_connector|_precision\b|_accelerator\b|_Fabric(Module|Optimizer"
    r"|DataLoader)|_forward_module|_original_module|_wrap_and_launch|_setup_module"
    r"|_validate_|_run_with_setup|_fabric_optimizer")
# a private attribute or keyword named in an AttributeError or TypeError message
_PRIVATE_IN_MESSAGE = re.compile(r"(attribute|argument) '_[A-Za-z]\w*'")
# the test reads or sets a private name of the Fabric object, reaches into Lightning's
# Strategy object beyond what ``fleet.strategy`` gives (its facts and collectives:
# gpufleet.fleet.strategy.OFFERED), or patches inside Lightning
_STRATEGY_BEYOND = r"\bfabric\.strategy\b(?!\.(" + "|".join(OFFERED) + r")\b)"
_PRIVATE_IN_LINE = re.compile(
    _STRATEGY_BEYOND + r"|\b(fabric|Fabric|self|model|optimizer|fabric_model|fabric_optimizer"
    r"|wrapped\w*)\._[a-z]\w*|" + _PRIVATE_NAMES.pattern
    + r"|patch(\.object)?\(\s*\"lightning\.")
# the test sets the Fabric object's private state (pretends to be launched, puts in a
# mocked strategy) before its failing line: its premise is Lightning's internals
_SETS_PRIVATE = re.compile(r"\bfabric\._[a-z]\w*(\.\w+)*\s*=[^=]")
# the test (or a decorator of it) patches a name inside Lightning
_PATCHES_LIGHTNING = re.compile(r"patch(\.object)?\(\s*\"lightning\.")
_REFUSALS = re.compile(r"weights_only=False\): gpufleet reads every file"
                       r"|gpufleet has no XLA strategy|fleet\.strategy has no '")


def _normalise(line: str) -> str:
    line = re.sub(r"0x[0-9a-fA-F]+", "0x…", line)
    line = re.sub(r"/tmp/\S+", "/tmp/…", line)
    return line.strip()[:160]


class ConformancePlugin:
    """Records, per test, whether it built a Fleet, its outcome and the failure's cause."""

    def __init__(self) -> None:
        self.current: str | None = None
        self.fleet_tests: set[str] = set()
        self.results: dict[str, dict[str, Any]] = {}
        self.collected = 0

    def patch(self) -> None:
        """Make Lightning's Fabric names point at Fleet and note each Fleet built."""
        import lightning
        import lightning.fabric
        import lightning.fabric.fabric

        import gpufleet

        fleet_init = gpufleet.Fleet.__init__
        plugin = self

        def recording_init(fleet: Any, *args: Any, **kwargs: Any) -> None:
            if plugin.current is not None:
                plugin.fleet_tests.add(plugin.current)
            fleet_init(fleet, *args, **kwargs)

        recording_init.__wrapped__ = fleet_init  # keeps inspect.signature(Fleet) exact
        gpufleet.Fleet.__init__ = recording_init
        for module in (lightning, lightning.fabric, lightning.fabric.fabric):
            module.Fabric = gpufleet.Fleet

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.collected = len(session.items)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        self.current = item.nodeid

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo) -> Any:
        outcome = yield
        report = outcome.get_result()
        entry = self.results.setdefault(item.nodeid, {"outcome": "passed"})
        if entry["outcome"] != "passed":
            return  # the first failing phase decides
        if report.skipped:
            entry["outcome"] = "skipped"
        elif report.failed:
            if hasattr(report, "wasxfail"):
                entry["outcome"] = "failed"
                entry["cause"] = (DIFFERENCE, "XPASS(strict): an expected failure passed")
            else:
                entry["outcome"] = "failed"
                entry["phase"] = call.when
                entry["cause"] = self._cause(item, call)
        elif hasattr(report, "wasxfail") and call.when == "call":
            entry["outcome"] = "xfailed"

    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        self.current = None

    def _cause(self, item: pytest.Item, call: pytest.CallInfo) -> tuple[str, str]:
        excinfo = call.excinfo
        if excinfo is None:
            return DIFFERENCE, "failed without an exception"
        message = str(excinfo.value)
        lines = message.strip().splitlines()
        first = lines[0] if lines else ""
        for i, line in enumerate(lines[:-1]):
            if line.startswith("First failure (rank"):  # a LaunchError: the rank's own
                first = f"on a rank: {lines[i + 1].strip()}"
                break
        if first.startswith("Regex pattern did not match") and len(lines) > 2:
            first = f"{first} {lines[2].strip()}"  # the message raised instead
        key = _normalise(f"{excinfo.typename}: {first}")
        if call.when == "call" and "Timeout" in message and excinfo.typename == "Failed":
            return DIFFERENCE, "Timeout"
        if _REFUSALS.search(message):
            return REFUSAL, key
        if _PRIVATE_IN_MESSAGE.search(first) or _PRIVATE_NAMES.search(first):
            return INTERNALS, key
        test_path = Path(str(getattr(item, "path", "")))
        failing_line = ""
        for tb_entry in reversed(excinfo.traceback):
            if Path(str(tb_entry.path)) == test_path:
                try:
                    failing_line = str(tb_entry.statement)
                except Exception:  # a frame without source
                    failing_line = ""
                break
        if failing_line and _PRIVATE_IN_LINE.search(failing_line):
            return INTERNALS, key
        try:
            source = inspect.getsource(item.function)  # type: ignore[attr-defined]
        except (OSError, TypeError, AttributeError):
            source = ""
        if _SETS_PRIVATE.search(source) or _PATCHES_LIGHTNING.search(source):
            return INTERNALS, key
        last_frame = str(excinfo.traceback[-1].path) if excinfo.traceback else ""
        if last_frame.endswith("unittest/mock.py"):
            if "lightning." in source or "fabric._" in source:
                return INTERNALS, key
        return DIFFERENCE, key


def _table(plugin: ConformancePlugin) -> dict[str, Any]:
    on_fleet = {n: r for n, r in plugin.results.items() if n in plugin.fleet_tests}
    others = {n: r for n, r in plugin.results.items() if n not in plugin.fleet_tests}
    count = Counter(r["outcome"] for r in on_fleet.values())
    by_cause = Counter(r["cause"][0] for r in on_fleet.values() if r["outcome"] == "failed")
    differences = Counter(r["cause"][1] for r in on_fleet.values()
                          if r["outcome"] == "failed" and r["cause"][0] == DIFFERENCE)
    refusals = Counter(r["cause"][1] for r in on_fleet.values()
                       if r["outcome"] == "failed" and r["cause"][0] == REFUSAL)
    return {
        "collected": plugin.collected,
        "ran_on_fleet": len(on_fleet),
        "passed": count["passed"],
        "failed": count["failed"],
        "skipped": count["skipped"],
        "xfailed": count["xfailed"],
        "failed_by_cause": dict(by_cause),
        "differences": differences.most_common(),
        "refusals": refusals.most_common(),
        "without_fleet": dict(Counter(r["outcome"] for r in others.values())),
        "tests": {n: {"outcome": r["outcome"], "fleet": n in plugin.fleet_tests,
                      **({"cause": list(r["cause"])} if "cause" in r else {})}
                  for n, r in sorted(plugin.results.items())},
    }


def _print(table: dict[str, Any], header: str) -> None:
    out = sys.stdout
    out.write(f"\n{header}\n")
    out.write(f"collected {table['collected']}; ran on a Fleet {table['ran_on_fleet']}: "
              f"passed {table['passed']}, failed {table['failed']}, skipped "
              f"{table['skipped']}, xfailed {table['xfailed']}\n")
    for cause in (INTERNALS, REFUSAL, DIFFERENCE):
        out.write(f"  failed, {cause}: {table['failed_by_cause'].get(cause, 0)}\n")
    out.write(f"never built a Fleet: {table['without_fleet']}\n")
    if table["refusals"]:
        out.write("deliberate refusals:\n")
        for key, n in table["refusals"]:
            out.write(f"  {n:3d}  {key}\n")
    out.write(f"differences ({len(table['differences'])} causes):\n")
    for key, n in table["differences"]:
        out.write(f"  {n:3d}  {key}\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lightning", required=True, type=Path,
                        help="a Lightning checkout holding tests/tests_fabric")
    parser.add_argument("--timeout", type=int, default=60, help="seconds per test")
    parser.add_argument("--files", nargs="*", default=list(DEFAULT_FILES),
                        help="test files under tests/tests_fabric (default: the CPU "
                             "files that build a Fabric, less the slow "
                             f"{', '.join(SLOW_FILES)})")
    parser.add_argument("--json", type=Path, help="also write the table and every "
                                                  "test's outcome here")
    parser.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments")
    args = parser.parse_args(argv)
    tests_root = args.lightning.resolve() / "tests"
    fabric_tests = tests_root / "tests_fabric"
    if not fabric_tests.is_dir():
        parser.error(f"--lightning {args.lightning}: no tests/tests_fabric there; pass "
                     "the root of a Lightning checkout (git clone of "
                     "Lightning-AI/pytorch-lightning, or an unpacked tag archive)")
    missing = [f for f in args.files if not (fabric_tests / f).is_file()]
    if missing:
        parser.error(f"--files: not in {fabric_tests}: {missing}")

    import lightning

    plugin = ConformancePlugin()
    plugin.patch()
    # Fleets a test left unfinished end when the interpreter exits and write into their
    # run folders: the folder stays until then (atexit runs this last, being registered
    # before any Fleet is made), and the caller's folder gets none
    tmp = tempfile.mkdtemp(prefix="fabric-conformance-")
    atexit.register(shutil.rmtree, tmp, True)
    json_path = args.json.resolve() if args.json else None
    # Lightning's own pytest settings (their pyproject), without doctests
    ini = Path(tmp) / "pytest.ini"
    ini.write_text("[pytest]\nxfail_strict = true\nfilterwarnings =\n"
                   "    error::FutureWarning\n"
                   "    ignore:You are using `torch.load` with `weights_only=False`"
                   ".*:FutureWarning\n")
    pytest_args = ["-c", str(ini), "--rootdir", str(tests_root), "-p", "no:cacheprovider",
                   "-p", "no:xdist", "-p", "no:randomly", "-q", "--no-header", "-rN",
                   f"--timeout={args.timeout}", "--timeout-method=signal",
                   *[str(fabric_tests / f) for f in args.files], *args.pytest_args]
    sys.path.insert(0, str(tests_root))
    os.chdir(tmp)
    rc = pytest.main(pytest_args, plugins=[plugin])
    table = _table(plugin)
    table.update({"lightning": lightning.__version__,
                  "date": datetime.date.today().isoformat(),
                  "machine": f"{platform.machine()}, {platform.python_version()}, "
                             f"torch {__import__('torch').__version__}",
                  "files": list(args.files)})
    _print(table, f"Lightning {table['lightning']} tests/tests_fabric on gpufleet.Fleet "
                  f"({table['date']}, {table['machine']})")
    if json_path:
        json_path.write_text(json.dumps(table, indent=1))
    return 0 if rc in (0, 1) else int(rc)


if __name__ == "__main__":
    raise SystemExit(main())
