"""Built-in models, and what kind of model a run was given."""

from __future__ import annotations

from typing import Any

from gpufleet.models.gpt import GPT, GPTConfig, build_gpt

__all__ = ["GPT", "GPTConfig", "build_gpt", "model_kind", "model_preset"]


def model_kind(model: Any) -> str:
    """``gpt`` (gpufleet's GPT), ``transformers`` (a PreTrainedModel) or ``model``."""
    if isinstance(model, GPT):
        return "gpt"
    if any(c.__module__.startswith("transformers.") and c.__name__ == "PreTrainedModel"
           for c in type(model).__mro__):
        return "transformers"
    return "model"


def model_preset(model: Any) -> str:
    """The recipe preset (``optim.preset``) ``auto`` gives ``model``: ``gpt`` for
    gpufleet's GPT, ``transformers`` for a Transformers model, ``none`` for any other."""
    return {"gpt": "gpt", "transformers": "transformers"}.get(model_kind(model), "none")
