import json
import os
import subprocess
import sys
import time

import pytest

from gpufleet.monitor import nvml, system
from gpufleet.monitor.nvml import Nvml
from gpufleet.monitor.system import SYSTEM_FILE, SystemSampler, read_system

from .fake_pynvml import FakeGpu, install

HOST_KEYS = {"time", "host", "gpus", "cpu_pct", "ram_used_mb", "ram_total_mb", "proc_rss_mb",
             "proc_cpu_pct", "procs", "disk_free_gb", "others", "kernel"}
GPU_KEYS = {"index", "name", "util_pct", "mem_used_mb", "mem_total_mb", "power_w", "temp_c",
            "sm_clock_mhz"}


def _wait_for(sampler, n, timeout=10.0):
    deadline = time.monotonic() + timeout
    while len(sampler.window(3600)) < n and time.monotonic() < deadline:
        time.sleep(0.02)


def test_host_only_sampler_writes_valid_lines(tmp_path, monkeypatch):
    # The real NVML library: on a machine without a driver it cannot load, and the
    # sampler goes on with the host only.
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    sampler = SystemSampler(tmp_path, interval_s=0.05)
    sampler.start()
    _wait_for(sampler, 3)
    sampler.stop()
    lines = (tmp_path / SYSTEM_FILE).read_text().splitlines()
    assert len(lines) >= 3
    samples = [json.loads(line) for line in lines]
    for s in samples:
        assert set(s) == HOST_KEYS
        assert len(s["cpu_pct"]) == os.cpu_count()
        assert all(0.0 <= c <= 100.0 for c in s["cpu_pct"])
        assert 0 < s["ram_used_mb"] < s["ram_total_mb"]
        assert s["proc_rss_mb"] > 10  # this Python process, with torch loaded
        assert s["procs"] >= 1 and s["disk_free_gb"] > 0
    if sampler.gpus is None and Nvml.open() is None:
        assert all(s["gpus"] == [] for s in samples)
    times = [s["time"] for s in samples]
    assert times == sorted(times)
    assert sampler.latest() == samples[-1]
    assert read_system(tmp_path) == samples


def test_children_count_in_process_memory(tmp_path):
    # A child that holds 200 MB, like a data-loader worker: it is part of the run's RSS.
    child = subprocess.Popen([sys.executable, "-c",
                              "import time; b = b'x' * (200 * 2**20); time.sleep(60)"])
    try:
        only_child = SystemSampler(tmp_path, interval_s=1.0, pids=[child.pid])
        deadline = time.monotonic() + 30
        while (alone := only_child.sample_now())["proc_rss_mb"] < 190 \
                and time.monotonic() < deadline:
            time.sleep(0.05)  # until the child has allocated
        assert alone["procs"] == 1 and alone["proc_rss_mb"] >= 190
        family = SystemSampler(tmp_path, interval_s=1.0, pids=[os.getpid()]).sample_now()
        assert family["procs"] >= 2
        assert family["proc_rss_mb"] > alone["proc_rss_mb"] + 10  # the child and this one
    finally:
        child.kill()
        child.wait()


def test_recorded_ranks_are_measured(tmp_path):
    from gpufleet.procs import record_process

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record_process(tmp_path, "rank", 1, pid=child.pid)
        sampler = SystemSampler(tmp_path, interval_s=1.0)  # pids=None: the recorded ranks
        sample = sampler.sample_now()
        assert child.pid in sampler._roots and os.getpid() in sampler._roots
        assert sample["procs"] >= 2
    finally:
        child.kill()
        child.wait()


def test_nvml_readings_through_a_fake_pynvml(tmp_path, monkeypatch):
    # No GPU here: a fake pynvml module (see fake_pynvml.py) answers as NVML would.
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake = install(monkeypatch, [
        FakeGpu(util=87, mem_used_mb=40960.0, temp_c=61),
        FakeGpu(name="NVIDIA A100-SXM4-40GB", util=3, mem_used_mb=512.0,
                mem_total_mb=40960.0, power_mw=None)])
    sampler = SystemSampler(tmp_path, interval_s=0.05)
    sampler.start()
    _wait_for(sampler, 2)
    sampler.stop()
    assert fake.calls == {"init": 1, "shutdown": 1}
    s = read_system(tmp_path)[-1]
    assert [set(g) for g in s["gpus"]] == [GPU_KEYS, GPU_KEYS]
    g0, g1 = s["gpus"]
    assert g0 == {"index": 0, "name": "NVIDIA H100 80GB HBM3", "util_pct": 87,
                  "mem_used_mb": 40960.0, "mem_total_mb": 81559.0, "power_w": 300.0,
                  "temp_c": 61, "sm_clock_mhz": 1980}
    assert g1["power_w"] is None  # not supported by that board: null, not a crash
    assert g1["util_pct"] == 3 and g1["mem_total_mb"] == 40960.0


def test_cuda_visible_devices_narrows_the_gpus(tmp_path, monkeypatch):
    install(monkeypatch, [FakeGpu(util=10), FakeGpu(util=20), FakeGpu(util=30)])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    sampler = SystemSampler(tmp_path, interval_s=1.0)
    sampler.start()
    sampler.stop()
    assert sorted((g["index"], g["util_pct"]) for g in sampler.latest()["gpus"]) == \
        [(0, 10), (2, 30)]


def test_window_keeps_recent_samples_only(tmp_path):
    sampler = SystemSampler(tmp_path, interval_s=1.0)
    first = sampler.sample_now()
    first["time"] -= 100  # pretend it is old
    second = sampler.sample_now()
    assert sampler.window(10) == [second]
    assert sampler.window(1000) == [first, second]


def test_interval_zero_is_off(tmp_path):
    sampler = SystemSampler(tmp_path, interval_s=0)
    sampler.start()
    sampler.stop()
    assert sampler.latest() is None and not (tmp_path / SYSTEM_FILE).exists()
    with pytest.raises(ValueError, match="interval_s"):
        SystemSampler(tmp_path, interval_s=-1)


def test_a_broken_line_is_skipped(tmp_path):
    (tmp_path / SYSTEM_FILE).write_text('{"time": 1, "host": "a", "gpus": []}\n{"time": 2, "ho')
    assert read_system(tmp_path) == [{"time": 1, "host": "a", "gpus": []}]


def test_doctests():
    import doctest

    for module in (system, nvml):
        assert doctest.testmod(module).failed == 0, module.__name__
