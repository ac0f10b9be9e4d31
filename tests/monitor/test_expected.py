"""The expected step: each part against what this machine should do, the headroom
finding's words and levers (fit's keys, an own loop's words), the probes it rests on
and the report's table."""

from __future__ import annotations

import json

import pytest
import torch

from gpufleet.monitor.advisor import optimizer_traffic
from gpufleet.monitor.diagnose import RunFacts, Summary, diagnose
from gpufleet.monitor.expected import StepWork, expected_step, headroom
from gpufleet.monitor.peaks import Peaks, cpu_peaks
from gpufleet.monitor.report_expected import expected_section

# Round yardsticks: 100 GFLOP/s, 2 µs an operator, 10 GB/s copied.
PEAKS = {"matmul_flops": 100e9, "dtype": "fp32", "launch_s": 2e-6, "memory_bps": 10e9}


def _row(**parts):
    row = {"rank": 0, "data": 0.0, "forward": 0.0, "backward": 0.0, "exposed_comm": 0.0,
           "late_ranks": 0.0, "optimizer": 0.0, "host": 0.0, "eval_checkpoint": 0.0,
           "other": 0.0, "ops": {"forward": 10.0, "backward": 20.0, "optimizer": 5.0}}
    row.update(parts)
    row["step"] = sum(v for k, v in row.items() if k not in ("rank", "ops") and v)
    return row


def test_each_part_expected_from_flops_operators_and_bytes():
    row = _row(forward=0.002, backward=0.004, optimizer=0.001, host=0.001, other=0.0005)
    got = expected_step(row, StepWork(flops=0.3e9, optimizer_bytes=5e6),
                        Peaks(**PEAKS, seconds=0.0))
    parts = got["parts"]
    # 0.1 GFLOP forward at 100 GFLOP/s = 1 ms, plus 10 operators at 2 µs.
    assert parts["forward"]["expected"] == pytest.approx(1e-3 + 20e-6)
    assert parts["backward"]["expected"] == pytest.approx(2e-3 + 40e-6)
    # 5 MB at 10 GB/s = 0.5 ms, plus 5 operators.
    assert parts["optimizer"]["expected"] == pytest.approx(0.5e-3 + 10e-6)
    assert parts["host"]["expected"] == 0.0 and parts["data"]["expected"] == 0.0
    assert parts["exposed_comm"]["expected"] == 0.0  # one rank: nothing to send
    assert got["compute_share"] == pytest.approx(0.5)  # 3 ms of matmul work in 6 ms
    assert got["host_share"] == pytest.approx(0.001 / 0.0085)
    assert got["launch_share"] == pytest.approx(35 * 2e-6 / 0.0085)
    # The expected step: the modelled parts expected, "other" as measured.
    assert got["expected_step"] == pytest.approx(3.06e-3 + 0.51e-3 + 0.5e-3)
    assert "0.1 GFLOP at 100 GFLOP/s (fp32 matmul) + 10 operators at 2 µs" == \
        parts["forward"]["basis"]


def test_what_is_not_known_is_not_modelled_and_a_probed_link_sets_communication():
    row = _row(forward=0.002, backward=0.004, exposed_comm=0.01, host=None)
    got = expected_step(row, StepWork(comm_bytes=1e6, world=2), Peaks(**PEAKS, seconds=0.0))
    assert got["parts"]["forward"]["expected"] is None  # no FLOPs counted
    assert got["parts"]["optimizer"]["expected"] is None
    assert got["parts"]["host"]["expected"] is None and got["host_share"] is None
    assert got["parts"]["exposed_comm"]["expected"] is None  # one node: no link probed
    linked = expected_step(row, StepWork(comm_bytes=1e6, link_bps=125e6, world=2),
                           Peaks(**PEAKS, seconds=0.0))
    assert linked["parts"]["exposed_comm"]["expected"] == pytest.approx(8e-3)  # 1 Gbit/s


def _summary(row):
    phases = {p: row[p] or 0.0 for p in ("data", "forward", "backward", "optimizer", "other")}
    phases["forward"] += row["host"] or 0.0  # host time was inside the phases
    return Summary(steps=50, step_s=row["step"], rank_phases=[{"rank": 0, **phases}],
                   rank_accounting=[row])


def test_headroom_names_the_part_furthest_from_expected_with_its_figures():
    # Tiny operators (35 of them, 0.1 ms each at most) and host time: the lever is the
    # batch size or compile, with the measured figures said.
    row = _row(forward=0.0004, backward=0.0006, optimizer=0.0001, host=0.003, data=0.0002)
    facts = RunFacts(peaks=PEAKS, flops_per_step=1e6, optimizer_bytes=1e4, batch_size=4)
    f = headroom(_summary(row), facts)
    assert (f.rule, f.severity, f.measurements["part"]) == ("headroom", "info", "host")
    assert f.title == "furthest from the expected step: host time between operators"
    assert "compute runs at 1% of this CPU's measured fp32 matmul rate" in f.message
    assert "70% of the step is host time between operators (3.0 ms)" in f.message
    assert "35 operators at the measured 2 µs each would take 2% of it" in f.message
    assert f.fix == ("raise data.batch_size from 4 (the operators stay, each does more "
                     "work) or set perf.compile=true (fewer, fused operators).")
    assert f.measurements["expected_step"]["parts"]["host"]["measured"] == 0.003


def test_big_slow_operators_are_named_without_a_setting_and_host_bound_steps_aside():
    # Forward's 10 operators take 20 ms (2 ms each, 1000 launches): slow work inside
    # them, not overhead between them. Host-bound would have said "Python overhead".
    row = _row(forward=0.020, backward=0.002, optimizer=0.0001, host=0.0002)
    facts = RunFacts(peaks=PEAKS, flops_per_step=0.3e9, optimizer_bytes=1e4, batch_size=64,
                     device_flops=100e9, device_flops_source="measured matmul")
    s = _summary(row)
    s.tflops = 0.3e9 / row["step"] / 1e12  # 1.3% of the yardstick: host-bound before
    rules = [f.rule for f in diagnose(s, facts)]
    assert rules == ["headroom"]
    (f,) = diagnose(s, facts)
    assert f.measurements["part"] == "forward"
    assert "torch profiler trace" in f.fix and "data.batch_size" not in f.fix
    assert f.changes == {}
    # The same numbers with no op clock (a GPU, compile): host-bound as before.
    s.rank_accounting = [{**row, "ops": {}, "host": None}]
    assert "host-bound" in [f.rule for f in diagnose(s, RunFacts(
        device_flops=100e9, device_flops_source="measured matmul", batch_size=64))]


def test_an_own_loop_hears_its_own_levers_and_a_slow_optimizer_no_setting():
    row = _row(forward=0.0004, backward=0.0006, optimizer=0.0001, host=0.003)
    facts = RunFacts(peaks=PEAKS, flops_per_step=1e6, batch_size=4, own_loop=True)
    (f,) = [f for f in diagnose(_summary(row), facts) if f.rule == "headroom"]
    assert "your DataLoader's batch_size" in f.fix
    assert "torch.compile your model before fleet.setup" in f.fix
    assert "data.batch_size" not in f.fix + f.message and "perf.compile" not in f.fix
    slow_opt = _row(forward=0.001, backward=0.002, optimizer=0.030, host=0.0001)
    g = headroom(_summary(slow_opt), RunFacts(peaks=PEAKS, flops_per_step=0.3e9,
                                             optimizer_bytes=1e6))
    assert g.measurements["part"] == "optimizer"
    assert "0.954 MiB read and written at 10 GB/s" in g.message
    assert "optimizer hooks" in g.fix


def test_no_peaks_no_headroom():
    assert headroom(_summary(_row(forward=0.01)), RunFacts()) is None


def test_the_optimizer_traffic_counts_parameters_gradients_and_state():
    model = torch.nn.Linear(100, 10)  # 1010 parameters, 4040 bytes
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 100)).sum().backward()
    opt.step()
    opt.zero_grad()  # gradients gone, as when the advisor reads it
    # read p, grad, exp_avg, exp_avg_sq; write p, exp_avg, exp_avg_sq (step: a scalar)
    assert optimizer_traffic(opt) == 7 * 4040
    assert optimizer_traffic(object()) == 0


def test_the_probes_measure_once_per_process_and_threads():
    first = cpu_peaks("fp32")
    again = cpu_peaks("fp32")
    assert again.seconds < first.seconds or first.seconds < 1e-3  # measured before
    assert (again.matmul_flops, again.launch_s) == (first.matmul_flops, first.launch_s)
    assert first.matmul_flops > 1e8 and 0 < first.launch_s < 1e-3
    assert first.memory_bps > 1e8 and first.dtype == "fp32"


def test_the_report_shows_the_slowest_ranks_expected_step(tmp_path):
    rows = [expected_step(_row(forward=f, backward=0.004, host=0.001, rank=r),
                          StepWork(flops=0.3e9), Peaks(**PEAKS, seconds=0.0))
            for r, f in enumerate((0.002, 0.009))]
    for r, got in enumerate(rows):
        got["rank"] = r
    (tmp_path / "diagnosis.json").write_text(json.dumps({"findings": [],
                                                         "expected_step": rows}))
    html = "".join(expected_section(tmp_path))
    assert "rank 1 (the slowest), measured step 14 ms, expected" in html
    assert "100 GFLOP/s (fp32 matmul), 2 µs per operator, 10 GB/s copied" in html
    assert '<td class="far">9 ms</td>' in html  # forward: 9 ms against 1.02 expected
    assert "not modelled" in html  # the optimizer: no bytes known
    (tmp_path / "diagnosis.json").write_text(json.dumps({"findings": []}))
    assert expected_section(tmp_path) == []
