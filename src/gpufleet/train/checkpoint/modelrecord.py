"""What a Transformers model is, written into its run folder for ``gpufleet export hf``.

A run of ``gpufleet.fit`` on a Transformers model (any ``PreTrainedModel``) writes
``<run_dir>/transformers/config.json``: the model's own config, with ``architectures``
naming the class that was trained (``BertForSequenceClassification``). The export
builds that class from that config and loads the run's weights into it, with no base
folder to pass and nothing imported from the run's config. Other models write nothing.

Example:
    >>> import torch
    >>> record_transformers_model(torch.nn.Linear(2, 2), "runs/x") is None
    True
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from gpufleet.files import atomic_write_text
from gpufleet.models import model_kind

log = logging.getLogger(__name__)

#: The folder of the run directory that holds the model's config.json.
FOLDER = "transformers"


def record_transformers_model(model: Any, run_dir: str | Path) -> Path | None:
    """Write ``model``'s config and class to ``run_dir/transformers/config.json`` when it
    is a Transformers model; returns the file, or None (another kind of model, or a
    config that cannot be written as JSON, which is logged)."""
    if model_kind(model) != "transformers":
        return None
    try:
        config = model.config.to_dict()
        config["architectures"] = [type(model).__name__]
        text = json.dumps(config, indent=2, sort_keys=True)
    except (AttributeError, TypeError, ValueError) as e:
        log.warning("the model's Transformers config could not be recorded (%s); "
                    "gpufleet export hf will need --base", e)
        return None
    path = Path(run_dir) / FOLDER / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, text + "\n")
    return path
