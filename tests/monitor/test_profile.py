import json
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import gpufleet
import toyjob
from gpufleet.errors import ConfigError
from gpufleet.monitor import profile
from gpufleet.monitor.profile import ProfilerCallback, parse_steps


def _fit(run_dir, cb, steps=6):
    torch.manual_seed(0)
    return gpufleet.fit(toyjob.make_model(), toyjob.make_data(), loss_fn=F.mse_loss,
                        overrides={"run.dir": str(run_dir), "run.max_steps": steps,
                                   "log.progress": "off", "checkpoint.save_final": False},
                        callbacks=[cb])


def _steps_in(trace: dict) -> list[str]:
    return sorted({e["name"] for e in trace["traceEvents"]
                   if e.get("name", "").startswith("ProfilerStep#")})


def test_a_two_step_window_is_traced_with_the_rank(tmp_path):
    cb = ProfilerCallback("2-3", tmp_path / "run", rank=0, world_size=1)
    assert cb.essential is False
    _fit(tmp_path / "run", cb)
    trace = json.loads((tmp_path / "run" / "profile" / "rank-0.json").read_text())
    assert trace["distributedInfo"] == {"backend": None, "rank": 0, "world_size": 1}
    assert trace["gpufleet"] == {"rank": 0, "world_size": 1, "steps": [2, 3]}
    assert _steps_in(trace) == ["ProfilerStep#2", "ProfilerStep#3"]
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::addmm" in names and "Optimizer.step#AdamW.step" in names


def test_torch_adds_distributed_info_with_a_process_group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        cb = ProfilerCallback("1-2", tmp_path, rank=0, world_size=1)
        trainer = SimpleNamespace(step=0)  # the callback reads only the step count
        cb.on_fit_start(trainer)
        for step in (1, 2, 3):
            dist.all_reduce(torch.ones(4))
            trainer.step = step
            cb.on_step_end(trainer, step)
    finally:
        dist.destroy_process_group()
    trace = json.loads((tmp_path / "profile" / "rank-0.json").read_text())
    assert trace["distributedInfo"]["backend"] == "gloo"
    assert (trace["distributedInfo"]["rank"], trace["distributedInfo"]["world_size"]) == (0, 1)
    assert trace["gpufleet"]["rank"] == 0
    assert _steps_in(trace) == ["ProfilerStep#1", "ProfilerStep#2"]
    assert any("all_reduce" in e.get("name", "") for e in trace["traceEvents"])


def test_a_run_that_ends_inside_the_window_still_writes_its_trace(tmp_path):
    _fit(tmp_path / "run", ProfilerCallback("3-50", tmp_path / "run", 0, 1), steps=4)
    trace = json.loads((tmp_path / "run" / "profile" / "rank-0.json").read_text())
    assert _steps_in(trace) == ["ProfilerStep#3", "ProfilerStep#4"]


def test_a_resume_after_the_window_traces_nothing(tmp_path):
    cb = ProfilerCallback("2-3", tmp_path, 0, 1)
    cb.on_fit_start(SimpleNamespace(step=5))
    cb.on_step_end(SimpleNamespace(step=6), 6)
    cb.on_fit_end(SimpleNamespace(step=6), None)
    assert not (tmp_path / "profile").exists()


@pytest.mark.parametrize("text", ["", "a-b", "0-2", "1-2-3", "-3", "2-", "10:12"])
def test_malformed_steps_are_a_clear_error(text):
    with pytest.raises(ConfigError, match=r"profile.steps = .*: not a step range. Write A-B"):
        parse_steps(text)


def test_steps_in_the_wrong_order():
    with pytest.raises(ConfigError, match="the first step comes after the last"):
        parse_steps("12-10")
    assert parse_steps(" 4 - 7 ") == (4, 7)


def test_doctests():
    import doctest

    assert doctest.testmod(profile).failed == 0
