"""A loop written for Lightning Fabric runs on Fleet unchanged: examples/fabric_loop.py's
``train`` under torchrun with Fabric, and the same function given a Fleet under
``gpufleet run`` (examples/fabric_loop_fleet.py), take the same samples, dropout masks,
losses and gathered evaluation error on 2 ranks, bit for bit, and in one process too;
the Fleet run also leaves its diagnosis, report and rank 0's logged values."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning", reason="Lightning Fabric is not installed "
                                        "(pip install -e '.[test]' brings it)")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(cmd: list[str], cwd: Path) -> None:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]


@pytest.fixture(scope="module")
def ported(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fabric-port")
    data = ["--data", str(out / "data.pt"), "--out", str(out)]
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
          "--nproc-per-node", "2", str(EXAMPLES / "fabric_loop.py"), *data], EXAMPLES)
    _run([sys.executable, "-m", "gpufleet", "run", "--nproc", "2",
          str(EXAMPLES / "fabric_loop_fleet.py"), "--", *data,
          "--run-dir", str(out / "run")], EXAMPLES)
    return out


def test_the_fabric_loop_on_fleet_takes_fabrics_steps_bit_for_bit(ported):
    for rank in (0, 1):
        fabric = torch.load(ported / f"fabric-rank{rank}.pt", weights_only=True)
        fleet = torch.load(ported / f"fleet-rank{rank}.pt", weights_only=True)
        assert len(fabric["losses"]) == 320 // 2 // 16 // 2 * 2  # 2 epochs of 5 steps
        assert fleet["losses"] == fabric["losses"], rank
        assert fleet["eval_mse"] == fabric["eval_mse"], rank
    ranks = [torch.load(ported / f"fleet-rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert ranks[0]["losses"] != ranks[1]["losses"]  # each rank read its own shard


def test_the_fleet_run_keeps_its_report_and_rank_0s_logged_values(ported):
    run = ported / "run"
    assert (run / "report.html").is_file() and (run / "diagnosis.json").is_file()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = [(r["epoch"], r["eval_mse"]) for r in records if r["kind"] == "user"]
    rank0 = torch.load(ported / "fleet-rank0.pt", weights_only=True)
    assert logged == [(0.0, rank0["eval_mse"][0]), (1.0, rank0["eval_mse"][1])]
    assert [r["step"] for r in records if r["kind"] == "train"] == [5, 10]


def test_in_one_process_too(tmp_path):
    """Alone, Fabric keeps the loader's RandomSampler; Fleet shuffles the same way."""
    from lightning.fabric import Fabric

    sys.path.insert(0, str(EXAMPLES))
    import fabric_loop

    import gpufleet

    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
    fabric.launch()
    fabric.seed_everything(fabric_loop.SEED)
    theirs = fabric_loop.train(fabric, tmp_path / "data.pt")
    fleet = gpufleet.Fleet(accelerator="cpu", devices=1, precision="32-true",
                           seed=fabric_loop.SEED, run_dir=str(tmp_path / "run"))
    ours = fleet.launch(fabric_loop.train, tmp_path / "data.pt")
    assert ours == theirs and len(ours["losses"]) == 2 * 320 // 16 // 2
