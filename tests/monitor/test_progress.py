import logging
import re
import time
from io import StringIO

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console

import gpufleet
import toyjob
from gpufleet.monitor import progress
from gpufleet.monitor.progress import Progress, gpu_summary
from gpufleet.monitor.system import SystemSampler

from .fake_pynvml import FakeGpu, install

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _fit(tmp_path, view, steps=20, extra=()):
    torch.manual_seed(0)
    return gpufleet.fit(
        toyjob.make_model(), toyjob.make_data(), toyjob.make_data(32), loss_fn=F.mse_loss,
        overrides={"run.dir": str(tmp_path / "run"), "run.max_steps": steps, "log.every": 5,
                   "run.eval_every": 10, "log.progress": "off", "checkpoint.save_final": False,
                   # The test's own sampler (fake GPUs) stands in for the trainer's.
                   "monitor.system_interval_s": 0.0},
        callbacks=[view, *extra])


@pytest.fixture
def gpu_sampler(tmp_path, monkeypatch):
    # No GPU here: a fake pynvml module (see fake_pynvml.py) stands in for the driver.
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    install(monkeypatch, [FakeGpu(util=87, mem_used_mb=40960.0, temp_c=61),
                          FakeGpu(util=12, mem_used_mb=2048.0, power_mw=None)])
    sampler = SystemSampler(tmp_path / "sys", interval_s=0.05)
    sampler.start()
    deadline = time.monotonic() + 10
    while sampler.latest() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # the first reading, before the run's first log line wants it
    yield sampler
    sampler.stop()


def test_live_view_on_a_terminal_shows_progress_and_gpu_bars(tmp_path, gpu_sampler):
    out = StringIO()
    console = Console(file=out, force_terminal=True, width=120, color_system="truecolor")
    view = Progress("auto", sampler=gpu_sampler, console=console)
    assert view.mode == "bar"  # auto picks the live view on a terminal
    _fit(tmp_path, view)
    text = ANSI.sub("", out.getvalue())
    final = text[text.rindex("train "):]  # the last frame the view drew
    assert "20/20" in final and "eta" in final
    assert re.search(r"loss \d\.\d{4} \| lr [\d.e+-]+ \| [\d.k]+ samples/s", final)
    assert re.search(r"data wait \d+%", final)
    assert re.search(r"GPU 0 util [━╸╺]+ +87% mem [━╸╺]+ +40\.0/79\.6 GB 300 W 61°C", final)
    # GPU 1 reports no power: the row leaves it out.
    assert re.search(r"GPU 1 util [━╸╺]+ +12% mem [━╸╺]+ +2\.0/79\.6 GB 50°C", final)
    assert "step 10: eval loss" in text  # printed above the view


def test_plain_lines_when_not_a_terminal(tmp_path, gpu_sampler, caplog):
    caplog.set_level(logging.INFO, logger="gpufleet.progress")
    view = Progress("auto", console=Console(file=StringIO()))
    assert view.mode == "lines"
    _fit(tmp_path, view, extra=[gpu_sampler])  # the view finds the trainer's sampler
    assert view.sampler is gpu_sampler
    lines = [r.getMessage() for r in caplog.records if r.name == "gpufleet.progress"]
    steps = [m for m in lines if m.startswith("step ") and "/20" in m]
    assert [m.split(" |")[0] for m in steps] == [f"step {s}/20" for s in (5, 10, 15, 20)]
    assert all(re.search(r"\| loss \d\.\d{4} \|.* samples/s \| data wait \d+% \| gpu util 50% "
                         r"\(min 12%\) \| gpu mem 40\.0/79\.6 GB \| eta \d+s$", m) for m in steps)
    assert any(m.startswith("step 10: eval loss") for m in lines)


def test_lines_without_a_sampler_have_no_gpu_part(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="gpufleet.progress")
    _fit(tmp_path, Progress("lines"), steps=5)
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step 5/5")]
    assert "gpu" not in line and "loss" in line


def test_gpu_summary_without_gpus_is_empty():
    assert gpu_summary(None) == "" and gpu_summary({"gpus": []}) == ""


def test_doctests():
    import doctest

    assert doctest.testmod(progress).failed == 0
