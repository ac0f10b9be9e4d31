"""The user guide: the MkDocs site builds strictly, and the commands it shows run.

Every fenced ``bash`` block of the README and of ``docs/*.md`` is a command a user may
copy. Each runs here in a temporary folder unless the line above it says why it cannot
(``<!-- docs-test: skip (REASON) -->``: GPUs, other nodes, root, an install). A
``gpufleet train`` command gets ``--max-steps=2`` and ``--run.eval_batches=2`` appended
(the default job's final evaluation of 50 batches would take most of a short run's time)
so it finishes quickly while every flag it shows is still parsed and used. A block
whose first commands are those an earlier block began with, in an empty folder as well,
starts from the folder those commands left (copied) instead of running them again:
several pages show a run and then a command on it (`report`, `cleanup`, `--config`).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP = re.compile(r"<!--\s*docs-test:\s*skip\s*\((?P<reason>[^)]+)\)\s*-->")
FENCE = re.compile(r"^\s*(?P<fence>```+|~~~+)\s*(?P<info>\S*)")
TRAIN_STEPS = "--max-steps=2"
EVAL_BATCHES = "--run.eval_batches=2"
COMMAND_TIMEOUT_S = 240
#: The folder each run sequence of commands left, by the commands (this test process's
#: blocks: one file, one worker).
_LEFT: dict[tuple[str, ...], Path] = {}


@dataclass(frozen=True)
class Block:
    """One ``bash`` block of a page: where it is, its commands, and a skip reason."""

    page: str
    line: int
    commands: tuple[str, ...]
    skip: str | None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def _commands(body: list[str]) -> tuple[str, ...]:
    """Logical command lines of a block: continuations joined, comments dropped."""
    commands: list[str] = []
    pending = ""
    for raw in body:
        line = re.sub(r"\s+#\s.*$", "", raw).rstrip()
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        commands.append((pending + line.strip()).strip())
        pending = ""
    if pending.strip():
        commands.append(pending.strip())
    return tuple(commands)


def parse_blocks(text: str, page: str) -> list[Block]:
    """The ``bash`` blocks of one Markdown text, each with its skip reason if any."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        fence, start = opened["fence"], i
        end = start + 1
        while end < len(lines) and not lines[end].lstrip().startswith(fence):
            end += 1
        if opened["info"] in ("bash", "sh", "shell"):
            above = next((s for s in reversed(lines[:start]) if s.strip()), "")
            marker = SKIP.search(above)
            blocks.append(Block(page, start + 1, _commands(lines[start + 1:end]),
                                marker["reason"] if marker else None))
        i = end + 1
    return blocks


def all_blocks() -> list[Block]:
    return [b for p in PAGES for b in parse_blocks(p.read_text(), p.relative_to(ROOT).as_posix())]


def test_parser_reads_blocks_skips_and_continuations() -> None:
    text = (
        "intro\n\n```bash\ngpufleet train --nproc 2 \\\n    --max-steps 5   # two ranks\n```\n"
        "<!-- docs-test: skip (needs 8 GPUs) -->\n```bash\ngpufleet train --nproc 8\n```\n"
        "```python\nprint('not a shell command')\n```\n"
        "```\n$ gpufleet train   # a transcript, not run\n```\n"
    )
    blocks = parse_blocks(text, "x.md")
    assert [b.commands for b in blocks] == [
        ("gpufleet train --nproc 2 --max-steps 5",), ("gpufleet train --nproc 8",)]
    assert [b.skip for b in blocks] == [None, "needs 8 GPUs"]
    assert blocks[0].line == 3


def test_every_page_shows_commands_and_most_run() -> None:
    blocks = all_blocks()
    runnable = [b for b in blocks if b.skip is None]
    assert runnable, "no bash block of the docs runs in the test"
    for b in blocks:
        assert b.commands, f"{b.id}: an empty bash block"


def _with_short_training(command: str) -> str:
    if re.match(r"^(gpufleet|python -m gpufleet) train\b", command) and "--help" not in command:
        short = "" if "eval_batches" in command else f" {EVAL_BATCHES}"
        return f"{command} {TRAIN_STEPS}{short}"
    return command


@pytest.mark.parametrize("block", [b for b in all_blocks() if b.skip is None],
                         ids=lambda b: b.id)
def test_docs_command_runs(block: Block, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)}
    work = tmp_path / "work"
    done_before = _restore_longest_run(block.commands, work)
    for i, command in enumerate(block.commands[done_before:], start=done_before):
        shown = _with_short_training(command)
        done = subprocess.run(["bash", "-o", "pipefail", "-c", shown], cwd=work, env=env,
                              capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
        assert done.returncode == 0, (
            f"{block.id}: `{shown}` exited {done.returncode}\n"
            f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}")
        if i < len(block.commands) - 1:  # a later block may begin with these commands
            kept = tmp_path / f"after-{i}"
            shutil.copytree(work, kept, symlinks=True)
            _LEFT.setdefault(block.commands[:i + 1], kept)


def _restore_longest_run(commands: tuple[str, ...], work: Path) -> int:
    """Fill ``work`` with what the longest run of ``commands``' first commands left in an
    earlier block (an empty folder, else); returns how many commands that covers."""
    for n in range(len(commands) - 1, 0, -1):
        left = _LEFT.get(commands[:n])
        if left is not None and left.is_dir():
            shutil.copytree(left, work, symlinks=True)
            return n
    work.mkdir()
    return 0


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None
                    or importlib.util.find_spec("material") is None,
                    reason="mkdocs and mkdocs-material are not installed "
                           "(pip install -e '.[test]')")
def test_site_builds_strictly(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
         str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    site = tmp_path / "site"
    built = {p.relative_to(site).as_posix() for p in site.rglob("*.html")}
    for page in (ROOT / "docs").glob("*.md"):
        name = "index.html" if page.stem == "index" else f"{page.stem}/index.html"
        assert name in built, f"docs/{page.name} was not built into the site"
