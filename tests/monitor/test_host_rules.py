"""The rules about what surrounds the step: other processes, threads beyond cores, time
between steps and slow log callbacks; and the sampler naming a real busy process."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from gpufleet.monitor.diagnose import RunFacts, Summary, diagnose
from gpufleet.monitor.host_rules import host_view
from gpufleet.monitor.system import busiest_others

_ROW = {"rank": 0, "data": 0.0, "forward": 0.004, "backward": 0.008, "optimizer": 0.002,
        "other": 0.001}


def _summary(**kw) -> Summary:
    base = {"steps": 100, "step_s": 0.015, "rank_phases": [dict(_ROW)], "train_s": 1.5}
    return Summary(**{**base, **kw})


def _sample(busy: list[float], ours: float, others: list[tuple[str, float]]) -> dict:
    return {"cpu_pct": busy, "proc_cpu_pct": ours, "gpus": [],
            "others": [{"pid": 100 + i, "name": n, "cpu_pct": c}
                       for i, (n, c) in enumerate(others)]}


def test_other_processes_taking_the_cpu_are_named_first_with_their_share():
    facts = RunFacts(cores=4, torch_threads=4)
    system = _sample([100.0] * 4, 150.0, [("stress-ng", 230.0), ("ffmpeg", 20.0)])
    found = diagnose(_summary(), facts, system)
    assert found[0].rule == "cpu-contention"
    assert "stress-ng (pid 100): 2.3 core(s)" in found[0].message
    assert "2.5 of this node's 4 cores (62%)" in found[0].message
    assert "OMP_NUM_THREADS=1" in found[0].fix  # 4 - 2.5 cores left, rounded down
    assert found[0].severity == "warn" and found[0].changes == {"env.OMP_NUM_THREADS": 1}
    # With no more threads than the cores left, nothing in the run is to change: info.
    calm = diagnose(_summary(), RunFacts(cores=4, torch_threads=1), system)
    assert [(f.rule, f.severity, f.changes) for f in calm] == [("cpu-contention", "info", {})]
    # A node whose other processes are idle, or which is not busy, has no such finding.
    assert not [f for f in diagnose(_summary(), facts, _sample([100.0] * 4, 390.0, []))
                if f.rule == "cpu-contention"]
    idle = _sample([40.0] * 4, 80.0, [("stress-ng", 90.0)])
    assert not [f for f in diagnose(_summary(), facts, idle) if f.rule == "cpu-contention"]


def test_host_view_averages_the_samples_after_the_first():
    first = _sample([0.0, 0.0], 0.0, [])
    later = [_sample([100.0, 100.0], 60.0, [("hog", 140.0)]),
             _sample([100.0, 80.0], 40.0, [("hog", 120.0)])]
    view = host_view([first, *later])
    assert view == {"cores": 2, "samples": 2, "busy": 1.9, "ours": 0.5,
                    "others": [{"pid": 100, "name": "hog", "cores": 1.3}]}


def test_more_threads_than_cores_is_named_with_the_thread_count_to_set():
    found = diagnose(_summary(), RunFacts(cores=2, local_world=2, torch_threads=4))
    assert found[0].rule == "thread-oversubscription"
    assert "2 rank(s) x 4 torch thread(s) = 8 threads on 2 usable core(s)" in found[0].message
    assert found[0].fix.startswith("set OMP_NUM_THREADS=1")
    assert not diagnose(_summary(), RunFacts(cores=2, local_world=2, torch_threads=1))


def test_frequent_checkpoints_eating_the_run_get_a_larger_interval():
    # 0.3 s per write every 5 steps of 15 ms: 0.3 / (0.3 + 0.075) = 80% of the time.
    s = _summary(outside={"checkpoint": (6.0, 20)})
    found = diagnose(s, RunFacts(checkpoint_every=5))
    assert found[0].rule == "time-outside-steps"
    assert "checkpoint writes take 0.30 s each, 20 so far, every 5 step(s)" in found[0].message
    assert found[0].fix.startswith("raise checkpoint.every from 5 to 500")  # 19 x 0.3 / 0.015
    assert "checkpoint.async_save=true" in found[0].fix
    written_behind = diagnose(s, RunFacts(checkpoint_every=5, checkpoint_async=True))
    assert "async_save" not in written_behind[0].fix  # on already: nothing more to turn on
    assert not diagnose(_summary(outside={"checkpoint": (0.1, 2)}), RunFacts(checkpoint_every=50))


def test_a_slow_log_callback_is_named_with_a_log_interval_that_hides_it():
    # 50 ms per log interval of 1 step of 15 ms: 333% of the step.
    found = diagnose(_summary(log_callbacks={"SlowSink": 5.0, "MetricsFile": 0.01}),
                     RunFacts(log_every=1))
    assert found[0].rule == "slow-logging" and found[0].title.endswith("SlowSink")
    assert found[0].fix.startswith("raise log.every from 1 to 200")
    assert not diagnose(_summary(log_callbacks={"MetricsFile": 0.01}), RunFacts(log_every=1))


def test_a_long_step_with_almost_no_arithmetic_is_host_bound():
    # 200 ms steps at 2% of the matmul yardstick: host-bound, even though the step is long.
    facts = RunFacts(device_flops=1e11, device_flops_source="measured matmul")
    slow = _summary(step_s=0.2, tflops=2e-3)
    assert [f.rule for f in diagnose(slow, facts)] == ["host-bound"]
    busy = _summary(step_s=0.2, tflops=1e-2)  # 10%: a long step doing real arithmetic
    assert diagnose(busy, facts) == []


def test_host_bound_on_a_cpu_whose_other_processes_went_unmeasured_is_unsure():
    # A short run: one system sample, which cannot show other processes' CPU (a
    # process's share needs two reads). Other processes could have taken the cores.
    facts = RunFacts(device="cpu", device_flops=1e11, device_flops_source="measured matmul",
                     cores=2, torch_threads=2)
    s = _summary(step_s=0.015, tflops=1e-2)  # 10% of the yardstick
    one = {"host_view": {"cores": 2, "samples": 1, "busy": 1.0, "ours": 1.0, "others": []}}
    found = {f.rule: f for f in diagnose(s, facts, one)}["host-bound"]
    assert found.confidence == "low" and "was not measured" in found.message
    many = {"host_view": {**one["host_view"], "samples": 12, "busy": 2.0, "ours": 2.0}}
    found = {f.rule: f for f in diagnose(s, facts, many)}["host-bound"]
    assert found.confidence != "low" and "was not measured" not in found.message


def test_host_bound_counts_neither_the_all_reduce_wait_nor_cores_others_take():
    # 7% of the yardstick over the whole step, but 36% of the step waits in the gradient
    # all-reduce and another process takes 0.9 of the 2 cores the 2 ranks ask for: their
    # own work runs at about 24% of what the cores left to them can do.
    facts = RunFacts(device_flops=1e11, device_flops_source="measured matmul",
                     world=2, local_world=2, cores=2, torch_threads=1)
    rows = [dict(_ROW, rank=0), dict(_ROW, rank=1)]
    arrival = [{"rank": 0, "wait": 0.0064, "gc": 0.0, "grad_bytes": 2.6e6},
               {"rank": 1, "wait": 0.0070, "gc": 0.0, "grad_bytes": 2.6e6}]
    s = _summary(step_s=0.0177, tflops=7.4e-3, rank_phases=rows, rank_arrival=arrival)
    system = {"host_view": {"cores": 2, "busy": 1.96, "ours": 1.0,
                            "others": [{"pid": 9, "name": "python", "cores": 0.9}]}}
    assert "host-bound" not in [f.rule for f in diagnose(s, facts, system)]
    # Alone on the node the same step still does too little arithmetic for its time.
    tiny = _summary(step_s=0.0177, tflops=7.4e-4, rank_phases=rows, rank_arrival=arrival)
    found = [f for f in diagnose(tiny, facts, system) if f.rule == "host-bound"]
    assert found and "outside the gradient all-reduce" in found[0].message
    assert found[0].measurements["cpu_share"] == pytest.approx(0.55)


@pytest.fixture
def busy_process():
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_the_sampler_names_a_real_busy_process(busy_process):
    ours = [psutil.Process()]
    busiest_others(ours)  # primes psutil's counters
    time.sleep(1.0)
    found = {p["pid"]: p for p in busiest_others(ours, keep=50)}
    # In the list (>= 5% of a core; a shared machine may give it little more).
    assert busy_process.pid in found and found[busy_process.pid]["name"].startswith("python")
    assert psutil.Process().pid not in found


def test_the_samples_after_the_priming_one_see_other_processes(tmp_path, monkeypatch):
    # The first reading of the process table only primes psutil (every process reads 0);
    # the next sample reads it again rather than repeating nothing for SCAN_EVERY samples.
    from gpufleet.monitor import system
    from gpufleet.monitor.system import SystemSampler

    # Every other process, not the 5 busiest: on a machine busy with other tests' ranks
    # the loop below need not be among the top 5, and which are is not what is tested.
    monkeypatch.setattr(system, "busiest_others",
                        functools.partial(system.busiest_others, keep=100_000))

    # A busy process outside the run: started through a shell that exits, so that it is
    # no descendant of this process (the sampler counts those as the run's own).
    pid = int(subprocess.check_output(
        ["sh", "-c", f"{sys.executable} -c 'while True: pass' >/dev/null 2>&1 & echo $!"],
        text=True))
    try:
        sampler = SystemSampler(tmp_path, interval_s=1.0, gpu_indices=[])
        sampler._measure()
        time.sleep(1.0)
        second = sampler._measure()
        assert pid in {p["pid"] for p in second["others"]}
    finally:
        os.kill(pid, signal.SIGKILL)


def test_a_small_straggler_on_a_node_others_load_is_a_low_confidence_info_with_both_causes():
    # Rank 0's own work is 8 ms (17%) longer, split over forward and backward, on a node
    # where another process takes 0.7 of 2 cores: unequal CPU shares are as plausible.
    facts = RunFacts(world=2, local_world=2, cores=2, torch_threads=1)
    rows = [dict(_ROW, rank=0, forward=0.017, backward=0.031),
            dict(_ROW, rank=1, forward=0.013, backward=0.035)]
    arrival = [{"rank": 0, "wait": 0.003, "gc": 0.0, "grad_bytes": 1e6},
               {"rank": 1, "wait": 0.0115, "gc": 0.0, "grad_bytes": 1e6}]
    s = _summary(step_s=0.05, rank_phases=rows, rank_arrival=arrival)
    loaded = {"host_view": {"cores": 2, "busy": 2.0, "ours": 1.3,
                            "others": [{"pid": 9, "name": "python", "cores": 0.7}]}}
    alone = {"host_view": {"cores": 2, "busy": 1.9, "ours": 1.9, "others": []}}
    found = {f.rule: f for f in diagnose(s, facts, loaded)}["straggler"]
    assert (found.severity, found.confidence) == ("info", "low")
    assert "scheduler can share that out" in found.message
    named = {f.rule: f for f in diagnose(s, facts, alone)}["straggler"]
    assert (named.severity, named.confidence) == ("warn", "medium")


def test_a_straggler_of_a_few_percent_is_named_as_an_info_and_noise_below_it_is_not():
    # Rank 1's optimizer step takes 3.5 ms more (7% of a 50 ms step) on a quiet node: the
    # others wait for it in the next step's all-reduce, inside their backward. Named, with
    # its phase, as an info.
    facts = RunFacts(world=2, local_world=2, cores=2, torch_threads=1)
    alone = {"host_view": {"cores": 2, "busy": 1.9, "ours": 1.9, "others": []}}
    rows = [dict(_ROW, rank=0, forward=0.015, backward=0.0335, optimizer=0.002),
            dict(_ROW, rank=1, forward=0.015, backward=0.030, optimizer=0.0055)]
    arrival = [{"rank": 0, "wait": 0.0035, "gc": 0.0, "grad_bytes": 1e6},
               {"rank": 1, "wait": 0.0, "gc": 0.0, "grad_bytes": 1e6}]
    s = _summary(step_s=0.05, rank_phases=rows, rank_arrival=arrival)
    found = {f.rule: f for f in diagnose(s, facts, alone)}["straggler"]
    assert (found.severity, found.confidence) == ("info", "low")
    assert found.measurements["rank"] == 1 and found.measurements["phase"] == "optimizer"
    assert "7% of the step" in found.message
    # 1 ms (2%) apart: within what a clean run shows, nothing is said.
    rows[1]["optimizer"] = 0.003
    rows[0]["backward"], arrival[0]["wait"] = 0.031, 0.001
    s = _summary(step_s=0.05, rank_phases=rows, rank_arrival=arrival)
    assert "straggler" not in {f.rule for f in diagnose(s, facts, alone)}
