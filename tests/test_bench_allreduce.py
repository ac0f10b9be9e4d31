"""``gpufleet bench allreduce``: 2 gloo ranks, both methods, every size in the table."""

from __future__ import annotations

import pytest

from gpufleet.bench.allreduce import bus_bandwidth, parse_counts, parse_sizes
from gpufleet.errors import ConfigError


def test_two_ranks_print_both_methods_for_every_size_and_the_machine(run_cli):
    proc = run_cli("bench", "allreduce", "--nproc", "2", "--sizes", "4K,256K",
                   "--iters", "2", "--warmup", "1", "--launcher", "spawn")
    out = proc.stdout
    assert "(gloo, float32 sum)" in out and "AR busbw GB/s" in out and "PS us" in out
    rows = [line for line in out.splitlines() if line.strip("│ ").startswith("2 ")]
    assert [r.split("│")[2].strip() for r in rows] == ["4K", "256K"]
    for row in rows:  # every time measured and positive
        cells = [c.strip() for c in row.split("│")[1:-1]]
        assert float(cells[2].replace(",", "")) > 0 and float(cells[5].replace(",", "")) > 0
    assert "machine:" in out and "torch" in out


def test_bus_bandwidth_follows_nccl_tests():
    algbw, busbw = bus_bandwidth(8_000_000, 0.004, 8)
    assert algbw == pytest.approx(2.0) and busbw == pytest.approx(3.5)
    assert bus_bandwidth(10, 1.0, 2)[1] == bus_bandwidth(10, 1.0, 2)[0]


def test_bad_sizes_and_counts_name_the_format(run_cli):
    assert parse_sizes("1KB,2m") == [1024, 2 << 20]
    assert parse_counts("2,4") == [2, 4]
    with pytest.raises(ConfigError, match=r"e\.g\. 4K,1M,64M"):
        parse_sizes("4X")
    with pytest.raises(ConfigError, match="at least 2"):
        parse_counts("1")
    proc = run_cli("bench", "allreduce", "--sizes", "lots", expect=2)
    assert "gpufleet: error:" in proc.stderr and "'LOTS' is not a size" in proc.stderr
