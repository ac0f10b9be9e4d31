"""The ``fit_cuda`` fixture of the CUDA-path tests."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import gpufleet

from .helpers import Capture, counting_tokens, tiny_gpt


@pytest.fixture
def fit_cuda(tmp_path):
    """``fit_cuda(overrides, model=..., data=..., loss_fn=..., callbacks=...)`` trains on
    cuda:0 with the run directory under tmp_path; returns ``(FitResult, Capture)``."""

    def run(overrides: dict[str, Any] | None = None, model: torch.nn.Module | None = None,
            data: Any = None, loss_fn: Any = None,
            callbacks: list[Any] | None = None) -> tuple[Any, Capture]:
        capture = Capture()
        settings = {"run.device": "cuda", "run.max_steps": 40, "run.eval_every": 0,
                    "run.out_dir": str(tmp_path), "data.batch_size": 16,
                    "data.num_workers": 0, "optim.lr": 3e-3, "optim.warmup_steps": 5,
                    "log.every": 10, "log.progress": "off", "log.level": "WARNING",
                    "checkpoint.save_final": False, "monitor.report": False,
                    **(overrides or {})}
        result = gpufleet.fit(model if model is not None else tiny_gpt(),
                              data if data is not None else counting_tokens(),
                              loss_fn=loss_fn, overrides=settings,
                              callbacks=[capture, *(callbacks or [])])
        return result, capture

    return run
