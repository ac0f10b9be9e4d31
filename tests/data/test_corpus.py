import os
import re
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from gpufleet.data import corpus
from gpufleet.data.corpus import build_stdlib_corpus, stdlib_sources
from gpufleet.errors import ConfigError

SIZE = 200_000


def test_corpus_has_the_requested_size_and_name(tmp_path):
    path = build_stdlib_corpus(max_bytes=SIZE, cache_dir=tmp_path)
    v = sys.version_info
    assert path == tmp_path / "corpus" / f"stdlib-py{v.major}{v.minor}-{SIZE}.bin"
    assert path.stat().st_size == SIZE
    tokens = np.fromfile(path, dtype=np.uint8)
    assert len(tokens) == SIZE
    assert b"def " in path.read_bytes()  # real Python source
    assert list(path.parent.glob("*.tmp")) == []  # no temporary file left behind


def test_corpus_is_the_sorted_sources_joined(tmp_path):
    path = build_stdlib_corpus(max_bytes=SIZE, cache_dir=tmp_path)
    files = stdlib_sources(sysconfig.get_paths()["stdlib"])
    expected = b"\n".join(f.read_bytes() for f in files[:200])[:SIZE]
    assert len(expected) == SIZE  # the first 200 files are enough to fill it
    assert path.read_bytes() == expected


def test_corpus_is_deterministic(tmp_path):
    a = build_stdlib_corpus(max_bytes=SIZE, cache_dir=tmp_path / "a")
    b = build_stdlib_corpus(max_bytes=SIZE, cache_dir=tmp_path / "b")
    assert a != b
    assert a.read_bytes() == b.read_bytes()


def test_corpus_is_reused(tmp_path):
    path = build_stdlib_corpus(max_bytes=SIZE, cache_dir=tmp_path)
    old = path.stat().st_mtime_ns - 10_000_000_000
    os.utime(path, ns=(old, old))  # a rewrite would set the mtime to now
    again = build_stdlib_corpus(max_bytes=SIZE, cache_dir=tmp_path)
    assert again == path
    assert path.stat().st_mtime_ns == old


def test_wrong_sized_cache_file_is_rebuilt(tmp_path):
    path = build_stdlib_corpus(max_bytes=SIZE, cache_dir=tmp_path)
    good = path.read_bytes()
    path.write_bytes(b"truncated")
    assert build_stdlib_corpus(max_bytes=SIZE, cache_dir=tmp_path).read_bytes() == good


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUFLEET_CACHE", str(tmp_path / "env"))
    path = build_stdlib_corpus(max_bytes=2048)
    assert path.parent == tmp_path / "env" / "corpus"


def fake_stdlib(root: Path) -> None:
    for rel, text in {"b.py": "B", "a.py": "A", "pkg/c.py": "C", "notes.txt": "X",
                      "site-packages/d.py": "D", "dist-packages/e.py": "E"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_small_stdlib_skips_installed_packages(tmp_path, monkeypatch):
    root = tmp_path / "lib"
    fake_stdlib(root)
    monkeypatch.setattr(corpus.sysconfig, "get_paths", lambda: {"stdlib": str(root)})
    path = build_stdlib_corpus(max_bytes=1000, cache_dir=tmp_path / "cache")
    assert path.read_bytes() == b"A\nB\nC"  # sorted; no .txt, site- or dist-packages
    mtime = path.stat().st_mtime_ns
    assert build_stdlib_corpus(max_bytes=1000, cache_dir=tmp_path / "cache") == path
    assert path.stat().st_mtime_ns == mtime  # smaller than the cap, and still reused


def test_cap_can_fall_on_a_separator(tmp_path, monkeypatch):
    root = tmp_path / "lib"
    fake_stdlib(root)
    monkeypatch.setattr(corpus.sysconfig, "get_paths", lambda: {"stdlib": str(root)})
    assert build_stdlib_corpus(max_bytes=2, cache_dir=tmp_path).read_bytes() == b"A\n"


def test_stripped_interpreter_gives_a_clear_error(tmp_path, monkeypatch):
    (tmp_path / "lib").mkdir()
    monkeypatch.setattr(corpus.sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path / "lib")})
    with pytest.raises(ConfigError, match=re.escape("--data package.module:factory")):
        build_stdlib_corpus(cache_dir=tmp_path)


@pytest.mark.parametrize("bad", [0, -5, 1.5])
def test_bad_max_bytes(tmp_path, bad):
    with pytest.raises(ValueError, match="max_bytes"):
        build_stdlib_corpus(max_bytes=bad, cache_dir=tmp_path)
