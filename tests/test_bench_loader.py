import pytest
import torch

from gpufleet.bench.loader import parse_workers, pin_options
from gpufleet.data.tuner import (
    LoaderResult,
    measure_loader,
    recommend,
    tune_loader,
    usable_pin_options,
)
from gpufleet.errors import ConfigError
from loader_fixtures import make_slow_data

SLOW = ["--data", "loader_fixtures:make_slow_data"]


def test_measure_loader_reports_a_sane_result():
    r = measure_loader(make_slow_data(n=64), batch_size=8, num_workers=0, pin_memory=False,
                       batches=10, warmup=2)
    assert (r.num_workers, r.pin_memory) == (0, False)
    # 1 ms a sample: at most ~1000 samples/s in one process, and well above zero.
    assert 100 < r.samples_per_s < 1100
    assert r.batches_per_s == pytest.approx(r.samples_per_s / 8)
    assert 0 < r.first_batch_s < 5
    assert r.rss_mb is None or r.rss_mb > 10


def test_two_workers_beat_none_on_slow_items_and_are_recommended():
    results = tune_loader(make_slow_data(), batch_size=8, workers=[0, 2],
                          pin_options=[False], batches=30, warmup=3)
    by_workers = {r.num_workers: r for r in results}
    assert sorted(by_workers) == [0, 2]
    # Items sleep, so two workers overlap them: ideally 2x; 1.3x leaves room for noise.
    assert by_workers[2].samples_per_s > 1.3 * by_workers[0].samples_per_s, results
    assert recommend(results) is by_workers[2]


def test_recommend_prefers_fewer_workers_within_five_percent():
    def res(workers: int, speed: float, pin: bool = False) -> LoaderResult:
        return LoaderResult(workers, pin, speed, speed / 16, 0.1)

    assert recommend([res(0, 96.0), res(4, 100.0)]).num_workers == 0
    assert recommend([res(0, 94.0), res(4, 100.0), res(2, 99.0)]).num_workers == 2
    assert recommend([res(2, 99.0), res(2, 100.0, pin=True)]).pin_memory is True
    with pytest.raises(ConfigError):
        recommend([])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
def test_pinning_without_cuda_is_skipped_with_a_note():
    pins, notes = usable_pin_options([True, False])
    assert pins == [False] and "no CUDA" in notes[0]
    with pytest.raises(ConfigError, match="pin_memory = True needs CUDA"):
        measure_loader(make_slow_data(n=16), batch_size=4, num_workers=0, pin_memory=True)
    results = tune_loader(make_slow_data(n=16), batch_size=4, workers=[0],
                          pin_options=[True, False], batches=2, warmup=1)
    assert [r.pin_memory for r in results] == [False]


@pytest.mark.parametrize("kwargs, words", [
    ({"num_workers": -1}, ["num_workers = -1", ">= 0"]),
    ({"batch_size": 0}, ["batch_size = 0", ">= 1"]),
    ({"warmup": 0}, ["warmup = 0", "at least 1"]),
])
def test_measure_loader_rejects_bad_counts(kwargs, words):
    args = {"batch_size": 4, "num_workers": 0, "pin_memory": False, **kwargs}
    with pytest.raises(ConfigError) as e:
        measure_loader(make_slow_data(n=16), **args)
    for word in words:
        assert word in str(e.value)


def test_cli_option_parsing():
    assert parse_workers("0, 2,4,2") == [0, 2, 4]
    with pytest.raises(ConfigError, match="'two' is not a worker count"):
        parse_workers("0,two")
    assert pin_options("auto", cuda=True) == [True, False]
    assert pin_options("auto", cuda=False) == [False]
    with pytest.raises(ConfigError, match="Did you mean 'true'"):
        pin_options("ture", cuda=False)


def test_bench_loader_end_to_end(run_cli):
    proc = run_cli("bench", "loader", *SLOW, "--kwargs", "{n = 256}", "--batch-size", "8",
                   "--workers", "0,2", "--batches", "20", timeout=120)
    out = proc.stdout
    assert "machine:" in out and "torch " in out
    assert "256 samples, batch size 8" in out
    assert "DataLoader throughput" in out and "samples/s" in out
    lines = [line for line in out.splitlines() if line.startswith("recommendation: ")]
    assert len(lines) == 1, out
    assert lines[0].startswith("recommendation: --data.num_workers=2 --data.pin_memory=false (")
    assert "0 workers: " in lines[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("args, words", [
    (["--workers", "x"], ["--workers 'x'", "e.g. --workers 0,2,4"]),
    (["--workers", "0,-1"], ["'-1' is not a worker count"]),
    (["--data", "no_such_pkg.data:load"], ["cannot import module 'no_such_pkg.data'",
                                           "PYTHONPATH"]),
    (["--data", "loader_fixtures:make_slo_data"], ["Did you mean 'make_slow_data'"]),
    ([*SLOW, "--kwargs", "{m = 3}"], ["data.kwargs", "make_slow_data(n"]),
    (["--kwargs", "3"], ["not a TOML inline table"]),
    (["--pin", "sometimes"], ["--pin", "Valid:"]),
    (["--batches", "0"], ["--batches 0", "at least 1"]),
])
def test_bench_loader_user_errors_exit_2(run_cli, args, words):
    proc = run_cli("bench", "loader", *args, expect=2, timeout=60)
    assert "Traceback" not in proc.stderr
    for word in words:
        assert word in proc.stderr
