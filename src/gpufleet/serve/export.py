"""Export a served model to a Triton model repository, and read one back.

``export_triton`` writes::

    OUT_DIR/<model>/config.pbtxt     name, platform, max_batch_size, input/output, batching
    OUT_DIR/<model>/1/model.pt       TorchScript (torch.jit.trace of the model)

for Triton's ``pytorch_libtorch`` backend. Inputs are ``INPUT__<i>`` and outputs
``OUTPUT__<i>`` in call/return order, the backend's naming convention. The trace is
checked against the eager model on the example batch and on one with every variable dim
resized, so a trace that froze a shape is refused instead of exported.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from gpufleet.errors import ConfigError
from gpufleet.serve.model import (
    ServedModel,
    TensorSpec,
    _config_schema,
    _resize,
    to_numpy,
    to_torch,
)

log = logging.getLogger(__name__)

_CONFIG_TYPES = {"BYTES": "TYPE_STRING"}  # every other v2 datatype X is TYPE_X


def config_type(datatype: str) -> str:
    """The ModelConfig ``data_type`` of a v2 datatype (``FP32`` -> ``TYPE_FP32``)."""
    return _CONFIG_TYPES.get(datatype, f"TYPE_{datatype}")


def model_config(model: ServedModel, max_batch_size: int, max_queue_delay_us: int,
                 instance_kind: str | None = None) -> dict[str, Any]:
    """Triton's ModelConfig for ``model``, as the dict of its JSON form.

    Example:
        >>> m = ServedModel("m", [TensorSpec("INPUT__0", "FP32", (8,))],
        ...                 [TensorSpec("OUTPUT__0", "FP32", (1,))], fn=None)
        >>> model_config(m, 8, 100)["input"]
        [{'name': 'INPUT__0', 'data_type': 'TYPE_FP32', 'dims': [8]}]
    """
    def tensor(s: TensorSpec) -> dict[str, Any]:
        entry: dict[str, Any] = {"name": s.name, "data_type": config_type(s.datatype),
                                 "dims": list(s.dims) or [1]}
        if not s.dims:  # a scalar per sample: Triton needs dims, the model sees []
            entry["reshape"] = {"shape": []}
        return entry

    config: dict[str, Any] = {"name": model.name, "platform": model.platform,
                              "max_batch_size": max_batch_size,
                              "input": [tensor(s) for s in model.inputs],
                              "output": [tensor(s) for s in model.outputs]}
    if max_batch_size > 1:
        config["dynamic_batching"] = {"max_queue_delay_microseconds": max_queue_delay_us}
    if instance_kind:  # e.g. KIND_CPU for a trace that pinned a device
        config["instance_group"] = [{"count": 1, "kind": instance_kind}]
    return config


def to_pbtxt(config: dict[str, Any]) -> str:
    """A ModelConfig dict in protobuf text format (what ``config.pbtxt`` holds), written
    by protobuf's ``text_format`` from Triton's own ModelConfig message.

    Example:
        >>> print(to_pbtxt({"name": "m", "max_batch_size": 8, "dynamic_batching": {}}))
        name: "m"
        max_batch_size: 8
        dynamic_batching {
        }
        <BLANKLINE>
    """
    from google.protobuf import json_format, text_format

    message = json_format.ParseDict(config, _config_schema().ModelConfig())
    return text_format.MessageToString(message)


def export_triton(model: ServedModel, out_dir: str | Path, max_batch_size: int = 8,
                  max_queue_delay_us: int = 100) -> Path:
    """Write ``model`` as a Triton model repository under ``out_dir``; returns the
    model's folder.

    Example:
        >>> from gpufleet.serve.model import load_model  # doctest: +SKIP
        >>> export_triton(load_model("runs/gpt-1"), "repo")  # doctest: +SKIP
        PosixPath('repo/gpt-stdlib')
    """
    import torch

    if model.module is None:
        raise ConfigError(f"model {model.name!r} is not a torch module, so it cannot be saved "
                          "as TorchScript. Export a run directory or an nn.Module factory.")
    if any(not s.name.startswith("OUTPUT__") for s in model.outputs):
        raise ConfigError(f"model {model.name!r} returns named outputs (a dict); Triton's "
                          "TorchScript backend needs a tensor or a tuple of tensors.")
    module = model.module.cpu().eval()
    batch = [np.concatenate([e[None], e[None]]) for e in model.example]
    with torch.no_grad(), warnings.catch_warnings():
        # Python branches on shapes (the GPT's length check) warn; the checks below compare
        # the trace with the model on a second shape instead.
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript: what Triton loads
        traced = torch.jit.trace(module, tuple(to_torch(a) for a in batch), check_trace=False)
    resized = [_resize(e, s)[None] for e, s in zip(model.example, model.inputs)]
    for arrays in (batch, resized):
        _check_same(module, traced, arrays)
    folder = Path(out_dir) / model.name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    traced.save(str(folder / "1" / "model.pt"))
    # A trace records devices as constants (e.g. a torch.arange(..., device=x.device) in
    # the model's forward): such a model only runs where it was traced, so it is pinned
    # to CPU instances.
    pinned = 'Device = prim::Constant[value="cpu"]' in str(traced.inlined_graph)
    if pinned:
        log.warning("the TorchScript trace of %r pins tensors to the CPU; the Triton config "
                    "asks for CPU instances (instance_group KIND_CPU)", model.name)
    config = model_config(model, max_batch_size, max_queue_delay_us,
                          "KIND_CPU" if pinned else None)
    (folder / "config.pbtxt").write_text(to_pbtxt(config))
    log.info("wrote %s", folder)
    return folder


def _check_same(module: Any, traced: Any, arrays: list[np.ndarray]) -> None:
    import torch

    with torch.no_grad():
        tensors = tuple(to_torch(a) for a in arrays)
        want, got = module(*tensors), traced(*tensors)
    want = want if isinstance(want, (tuple, list)) else [want]
    got = got if isinstance(got, (tuple, list)) else [got]
    shapes = [list(a.shape) for a in arrays]
    if len(want) != len(got) or any(w.shape != g.shape or not torch.allclose(
            w.float(), g.float(), rtol=1e-4, atol=1e-5) for w, g in zip(want, got)):
        raise ConfigError(f"the TorchScript trace differs from the model on inputs of shape "
                          f"{shapes} (the trace froze a shape or a branch). Make forward "
                          "free of Python branches on tensor values, or script it yourself.")


def load_for_export(source: str, name: str | None = None,
                    trust_code: bool = False) -> ServedModel:
    """The model behind ``gpufleet export triton SOURCE`` (same sources as serve), on CPU;
    ``trust_code`` as for :func:`~gpufleet.serve.model.load_model`."""
    from gpufleet.serve.model import load_model

    model = load_model(source, name=name, device="cpu", trust_code=trust_code)
    if model.module is None or not model.example:
        raise ConfigError(f"{source!r} is not a torch model with a known example input.")
    return model


def outputs_of(model: ServedModel, arrays: list[np.ndarray]) -> list[np.ndarray]:
    """Call ``model`` directly (no server) on a batch: what tests compare against."""
    import torch

    with torch.no_grad():
        out = model.module(*(to_torch(a) for a in arrays))
    return [to_numpy(t) for t in (out if isinstance(out, (tuple, list)) else [out])]
