import argparse
import json
import os
from io import StringIO

from rich.console import Console

from gpufleet.monitor import top
from gpufleet.monitor.nvml import Nvml

from .fake_pynvml import MB, FakeGpu, install


def _has_gpus() -> bool:
    nvml = Nvml.open()
    if nvml is not None:
        nvml.close()
    return nvml is not None


def test_top_once_shows_the_host(run_cli):
    proc = run_cli("top", "--once")
    if not _has_gpus():
        assert "No NVIDIA GPU found (NVML is not usable here); showing the host." in proc.stdout
        assert "CPU per core:" in proc.stdout
    assert "RAM" in proc.stdout and "pid" in proc.stdout and "command" in proc.stdout


def test_top_json_is_one_snapshot(run_cli):
    snap = json.loads(run_cli("top", "--once", "--json").stdout)
    assert {"time", "host", "cpu_pct", "ram_used_mb", "ram_total_mb", "gpus",
            "processes"} <= set(snap)
    assert len(snap["cpu_pct"]) == os.cpu_count()
    assert snap["processes"] and all("pid" in p and "rss_mb" in p for p in snap["processes"])
    if not _has_gpus():
        assert snap["gpus"] == [] and snap["nvml"] is False
        assert 0 < len(snap["processes"]) <= top.TOP_PROCESSES  # the biggest by memory


def test_gpus_and_their_processes_through_a_fake_pynvml(monkeypatch, capsys):
    # No GPU here: a fake pynvml module (see fake_pynvml.py) reports this test process
    # on GPU 1, as NVML would for a training rank.
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    install(monkeypatch, [FakeGpu(util=99, mem_used_mb=70000.0),
                          FakeGpu(util=5, mem_used_mb=3000.0, procs=[(os.getpid(), 2900 * MB)])])
    args = argparse.Namespace(once=True, json=True, interval=1.0)
    assert top.run(args) == 0
    snap = json.loads(capsys.readouterr().out)
    g0, g1 = snap["gpus"]
    assert (g0["util_pct"], g0["processes"]) == (99, [])
    [p] = g1["processes"]
    assert p["pid"] == os.getpid() and p["gpu_mem_mb"] == 2900.0 and p["rss_mb"] > 10
    assert [q["pid"] for q in snap["processes"]] == [os.getpid()]

    out = StringIO()
    Console(file=out, width=200).print(top.render(snap))
    text = out.getvalue()
    assert "NVIDIA H100 80GB HBM3" in text and "99%" in text and "68.4/79.6 GB" in text
    assert f"{os.getpid()} " in text and "2.8 GB" in text and "No NVIDIA GPU" not in text


def test_a_non_positive_interval_is_refused(run_cli):
    proc = run_cli("top", "--interval", "0", expect=2)
    assert "--interval 0.0: must be a positive number of seconds" in proc.stderr
