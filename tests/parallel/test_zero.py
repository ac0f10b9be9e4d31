"""``zero1`` (DDP + ZeroRedundancyOptimizer) on CPU with two gloo ranks, through the CLI:
the same parameters as ``single`` on the same global batch, and a checkpoint (optimizer
state consolidated on rank 0) that resumes exactly."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from conftest import final_params
from equivalence import assert_same_weights
from gpufleet.train.optim import param_groups

TOY = ["--model", "toyjob:make_model", "--data", "toyjob:make_data", "--max-steps", "12",
       "--model.loss", "torch.nn.functional:mse_loss", "--log.every", "1",
       "--optim.warmup_steps", "2", "--run.out_dir", "runs", "--data.num_workers", "0",
       # Two parameter groups (decay on matrices), as the optimizer built below has.
       "--optim.preset", "gpt"]


def _train(run_cli, tmp_path: Path, name: str, *args: str) -> Path:
    run_cli("train", *TOY, "--run-dir", f"runs/{name}", *args)
    return tmp_path / "runs" / name


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, open(run_dir / "metrics.jsonl"))
            if r["kind"] == "train"]


def test_zero1_equals_single_and_resumes_as_if_uninterrupted(run_cli, tmp_path):
    single = _train(run_cli, tmp_path, "single", "--batch-size", "32")
    zero = ["--nproc", "2", "--strategy", "zero1", "--batch-size", "16"]
    straight = _train(run_cli, tmp_path, "straight", *zero, "--checkpoint.every", "6")
    assert_same_weights(final_params(straight), final_params(single))
    # The step-6 checkpoint holds every rank's part of the AdamW state, in torch.optim's
    # form: a plain optimizer of the same model loads it.
    step6 = straight / "checkpoints" / "step-0000006.pt"
    state = torch.load(step6, weights_only=True)
    import toyjob

    model = toyjob.make_model()
    plain = torch.optim.AdamW(param_groups(model, 0.1))
    plain.load_state_dict(state["optimizer"])
    assert len(plain.state) == 4
    assert all(float(s["step"]) == 6.0 for s in plain.state.values())
    # Resumed from step 6 by two ranks again: the same data position, the same updates.
    resumed = _train(run_cli, tmp_path, "resumed", *zero, "--resume", str(step6))
    assert _losses(resumed) == _losses(straight)[6:]
    for name, p in final_params(resumed).items():
        torch.testing.assert_close(p, final_params(straight)[name], rtol=0, atol=0)
