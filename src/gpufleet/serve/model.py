"""What the server serves: a model with a known input/output signature.

Four sources, picked by what ``source`` is:

- a **run directory** (``config.toml`` + ``checkpoints/step-*.pt``): the model is rebuilt
  from the run's config, loaded with the newest checkpoint, and its inputs are read off one
  sample of the run's own training data (a ``(inputs..., target)`` sample gives the
  inputs; the last item is the target). The built-in GPT takes ``INPUT__0`` INT64 token
  ids ``[batch, seq]`` (seq up to ``block_size``) and returns ``OUTPUT__0`` FP32 logits
  ``[batch, seq, vocab]``;
- a **Triton model directory** (``config.pbtxt`` + ``<version>/model.pt``), as
  ``gpufleet export triton`` writes it; the signature comes from ``config.pbtxt``;
- a **TorchScript file** (``*.pt``/``*.ts``, from ``torch.jit.save``), with ``--input``;
- a **factory** ``package.module:function`` returning an ``nn.Module`` (torch tensors in
  and out) or any callable taking and returning numpy arrays, with ``--input``.

``--input NAME:DTYPE:DIMS`` gives one input per flag, in call order: DIMS are the
per-sample dims without the batch dimension, comma-separated, ``-1`` for a dim of any
size (``tokens:INT64:-1``, ``x:FP32:3,32,32``). Outputs are found by calling the model
on an example batch: their datatypes, dims, and which dims follow a variable input dim
(``-1``). Names are ``OUTPUT__<i>`` (Triton's TorchScript convention) unless the model
returns a dict, whose keys are then the names.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gpufleet.errors import ConfigError, unknown_choice
from gpufleet.serve.protocol import DTYPES, datatype_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorSpec:
    """A named tensor of the signature; ``dims`` exclude the batch dim, -1 = any size."""

    name: str
    datatype: str
    dims: tuple[int, ...]


@dataclass
class ServedModel:
    """A model ready to serve: its signature and a batch-in, batch-out function."""

    name: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    fn: Callable[[list[np.ndarray]], list[np.ndarray]]
    version: str = "1"
    platform: str = "pytorch_libtorch"
    module: Any = None  # the torch module, for export (None for plain callables)
    example: list[np.ndarray] = field(default_factory=list)  # one sample, no batch dim


def parse_input_spec(text: str) -> TensorSpec:
    """Parse ``NAME:DTYPE:DIMS`` (DIMS comma-separated, -1 for any size, may be empty).

    Example:
        >>> parse_input_spec("tokens:INT64:-1")
        TensorSpec(name='tokens', datatype='INT64', dims=(-1,))
    """
    parts = text.split(":")
    if len(parts) != 3 or not parts[0]:
        raise ConfigError(f"--input {text!r}: write NAME:DTYPE:DIMS, e.g. x:FP32:3,32,32 or "
                          "tokens:INT64:-1 (dims without the batch dim, -1 for any size).")
    name, dtype, dims_text = parts
    if dtype.upper() not in DTYPES:
        raise ConfigError(unknown_choice(f"--input {text!r}: datatype", dtype, DTYPES))
    try:
        dims = tuple(int(d) for d in dims_text.split(",")) if dims_text else ()
    except ValueError:
        dims = (0,)
    if any(d == 0 or d < -1 for d in dims):
        raise ConfigError(f"--input {text!r}: dims {dims_text!r} must be positive integers "
                          "or -1, comma-separated.")
    return TensorSpec(name, dtype.upper(), dims)


def load_model(source: str, *, name: str | None = None, inputs: Sequence[str] = (),
               device: str = "auto", trust_code: bool = False) -> ServedModel:
    """Load what ``gpufleet serve SOURCE`` serves (see the module docstring).

    A run directory's checkpoint loads as tensors and plain data only; a factory its
    ``config.toml`` names (other than gpufleet's own) is refused unless ``trust_code``
    (``--trust-code``): the directory may come from someone else.

    Example:
        >>> model = load_model("runs/gpt-stdlib-20260101-120000")  # doctest: +SKIP
        >>> [(s.name, s.datatype, s.dims) for s in model.inputs]  # doctest: +SKIP
        [('INPUT__0', 'INT64', (-1,))]
    """
    specs = [parse_input_spec(s) for s in inputs]
    path = Path(source)
    dev = _device(device)
    if (path / "config.toml").is_file():
        model = _load_run(path, specs, dev, trust_code)
    elif (path / "config.pbtxt").is_file():
        model = load_triton_model_dir(path, dev)
    elif path.is_file():
        model = from_module(path.stem, jit_load(path, dev), _need(specs, source), dev)
    elif ":" in source and not path.exists():
        from gpufleet.job import import_object

        factory = import_object(source, "MODEL")
        model = from_module(source.rpartition(":")[2], factory(), _need(specs, source), dev)
    else:
        raise ConfigError(f"MODEL {source!r} is neither a run directory (config.toml + "
                          "checkpoints/), a Triton model directory (config.pbtxt), a "
                          "TorchScript file, nor a package.module:function factory. "
                          "Check the path.")
    if name:
        model.name = name
    model.name = _clean_name(model.name)
    log.info("serving %r: inputs %s, outputs %s", model.name, model.inputs, model.outputs)
    return model


def jit_load(path: str | Path, device: str = "cpu") -> Any:
    """``torch.jit.load`` without its deprecation warning: TorchScript is the format
    Triton's pytorch_libtorch backend loads, so it is the format we keep."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.load(str(path), map_location=device)


def _need(specs: list[TensorSpec], source: str) -> list[TensorSpec]:
    if not specs:
        raise ConfigError(f"MODEL {source!r} does not say what it takes. Describe each input "
                          "with --input NAME:DTYPE:DIMS, e.g. --input x:FP32:8 "
                          "(dims without the batch dim, -1 for any size).")
    return specs


def _clean_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "model"


def _device(device: str) -> str:
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ConfigError(unknown_choice("--device", device, ("auto", "cpu", "cuda")))
    return device


def _load_run(run_dir: Path, specs: list[TensorSpec], device: str,
              trust_code: bool) -> ServedModel:
    from gpufleet.config import load_config
    from gpufleet.data.loaders import first_samples
    from gpufleet.job import build_job, require_trusted
    from gpufleet.train.checkpoint.format import find_resume_checkpoint, load_checkpoint

    cfg = load_config(run_dir / "config.toml")
    require_trusted(cfg, trust_code, str(run_dir))  # before anything is imported
    # The newest checkpoint that passes its checksum (a damaged newer one is reported).
    checkpoint = find_resume_checkpoint(str(run_dir), cfg.run.out_dir, cfg.run.name)
    job = build_job(cfg)
    state = load_checkpoint(checkpoint, verify=False)["model"]
    job.model.load_state_dict(state)
    log.info("loaded %s", checkpoint)
    if not specs:
        example = _sample_inputs(first_samples(job.train_data, 1)[0])  # (or a stream's)
        variable = [{0} if cfg.model.name == "gpt" and i == 0 else set()
                    for i in range(len(example))]
        specs = [TensorSpec(f"INPUT__{i}", datatype_of(e.dtype),
                            tuple(-1 if d in variable[i] else n for d, n in enumerate(e.shape)))
                 for i, e in enumerate(example)]
    else:
        example = None
    return from_module(cfg.run.name, job.model, specs, device, example)


def _sample_inputs(sample: Any) -> list[np.ndarray]:
    """The model inputs in one training sample: all but the last item (the target) of a
    tuple, or the tensor itself."""
    import torch

    items = list(sample[:-1]) if isinstance(sample, (tuple, list)) and len(sample) > 1 else [
        sample[0] if isinstance(sample, (tuple, list)) else sample]
    if not all(isinstance(t, (torch.Tensor, np.ndarray)) for t in items):
        raise ConfigError("the run's training samples are not (tensors..., target) tuples, so "
                          "the model's inputs cannot be read off them. Describe them with "
                          "--input NAME:DTYPE:DIMS.")
    return [t.numpy() if isinstance(t, torch.Tensor) else np.asarray(t) for t in items]


def from_module(name: str, model: Any, specs: list[TensorSpec], device: str,
                 example: list[np.ndarray] | None = None) -> ServedModel:
    """Wrap a torch module (or a callable taking and returning numpy arrays) as a
    :class:`ServedModel`; the outputs are found by calling it on an example batch.

    Example:
        >>> m = from_module("mlp", torch.nn.Linear(8, 2), [TensorSpec("x", "FP32", (8,))],
        ...                 "cpu")  # doctest: +SKIP
        >>> m.outputs  # doctest: +SKIP
        [TensorSpec(name='OUTPUT__0', datatype='FP32', dims=(2,))]
    """
    import torch

    if isinstance(model, torch.nn.Module):
        model = model.to(device).eval()
        if any(s.datatype == "BYTES" for s in specs):
            raise ConfigError("a torch module cannot take BYTES inputs. Serve a callable "
                              "that takes numpy arrays, or send the data as numbers.")
        named = _torch_call(model, device)
    elif callable(model):
        named = _numpy_call(model)
    else:
        raise ConfigError(f"the factory returned {type(model).__name__}, not a torch module or "
                          "a callable. Return the model.")
    if example is None:
        example = [_example(s) for s in specs]
    outputs = probe_outputs(named, specs, example)

    def fn(arrays: list[np.ndarray]) -> list[np.ndarray]:
        return [a for _, a in named(arrays)]

    module = model if isinstance(model, torch.nn.Module) else None
    return ServedModel(name, specs, outputs, fn, module=module, example=example)


def _example(spec: TensorSpec) -> np.ndarray:
    shape = tuple(1 if d == -1 else d for d in spec.dims)
    if spec.datatype == "BYTES":
        return np.full(shape, b"", dtype=object)
    return np.zeros(shape, dtype=DTYPES[spec.datatype])


def _named(out: Any) -> list[tuple[str, Any]]:
    if isinstance(out, dict):
        return [(str(k), v) for k, v in out.items()]
    if isinstance(out, (tuple, list)):
        return [(f"OUTPUT__{i}", v) for i, v in enumerate(out)]
    return [("OUTPUT__0", out)]


def to_torch(array: np.ndarray, device: str = "cpu") -> Any:
    """A numpy array as a torch tensor on ``device`` (BF16 included)."""
    import torch

    if array.dtype == DTYPES.get("BF16"):
        return torch.from_numpy(array.view(np.uint16).copy()).view(torch.bfloat16).to(device)
    if not array.flags.writeable:
        array = array.copy()
    return torch.from_numpy(array).to(device)


def to_numpy(tensor: Any) -> np.ndarray:
    """A torch tensor as a numpy array on the CPU (BF16 included)."""
    import torch

    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.uint16).numpy().view(DTYPES["BF16"])
    return tensor.numpy()


def _torch_call(module: Any, device: str) -> Callable:
    import torch

    def call(arrays: list[np.ndarray]) -> list[tuple[str, np.ndarray]]:
        with torch.inference_mode():
            out = module(*(to_torch(a, device) for a in arrays))
        return [(n, to_numpy(t)) for n, t in _named(out)]

    return call


def _numpy_call(fn: Callable) -> Callable:
    def call(arrays: list[np.ndarray]) -> list[tuple[str, np.ndarray]]:
        return [(n, np.asarray(v)) for n, v in _named(fn(*arrays))]

    return call


def probe_outputs(call: Callable, specs: list[TensorSpec],
                  example: list[np.ndarray]) -> list[TensorSpec]:
    """Find the output signature by calling the model on batches of 1 and 2 samples, and
    once more with every variable input dim resized (output dims that change are -1)."""
    one = _run_probe(call, [e[None] for e in example], 1, "one sample")
    two = _run_probe(call, [np.concatenate([e[None], e[None]]) for e in example], 2,
                     "two samples")
    if [n for n, _ in one] != [n for n, _ in two]:
        raise ConfigError("the model returns different outputs for batches of 1 and 2.")
    resized = [_resize(e, s) for e, s in zip(example, specs)]
    other = one
    if any(r.shape != e.shape for r, e in zip(resized, example)):
        other = _run_probe(call, [r[None] for r in resized], 1, "resized variable dims")
    outputs = []
    for (name, a), (_, b) in zip(one, other):
        dims = tuple(-1 if m != n else m for m, n in zip(a.shape[1:], b.shape[1:]))
        outputs.append(TensorSpec(name, datatype_of(a.dtype), dims))
    return outputs


def _resize(example: np.ndarray, spec: TensorSpec) -> np.ndarray:
    for axis, d in enumerate(spec.dims):
        if d == -1:
            n = example.shape[axis]
            new = n // 2 if n >= 2 else 2
            example = (np.take(example, range(new), axis=axis, mode="wrap"))
    return example


def _run_probe(call: Callable, arrays: list[np.ndarray], rows: int,
               what: str) -> list[tuple[str, np.ndarray]]:
    try:
        out = call(arrays)
    except Exception as e:
        shapes = [list(a.shape) for a in arrays]
        raise ConfigError(f"the model failed on an example batch ({what}, input shapes "
                          f"{shapes}): {type(e).__name__}: {e}. Check --input (names, "
                          "datatypes, dims).") from e
    for name, a in out:
        if a.ndim == 0 or a.shape[0] != rows:
            raise ConfigError(f"output {name!r} has shape {list(a.shape)} for a batch of "
                              f"{rows}; a served model must keep the batch dim first.")
    return out


# -- Triton model directories (what `gpufleet export triton` writes) --------------
def _config_schema() -> Any:
    """Triton's ModelConfig protobuf module (shipped with tritonclient's gRPC client)."""
    try:
        from tritonclient.grpc import model_config_pb2
    except ImportError as e:
        raise ConfigError("reading or writing config.pbtxt needs Triton's model-config "
                          "schema: pip install 'gpufleet[serve]' (or "
                          "'tritonclient[grpc]').") from e
    return model_config_pb2


def load_triton_model_dir(folder: Path, device: str = "cpu") -> ServedModel:
    """Serve a Triton model directory with a TorchScript model (what export writes)."""
    from google.protobuf import text_format

    model_config_pb2 = _config_schema()
    try:
        config = text_format.Parse((folder / "config.pbtxt").read_text(),
                                   model_config_pb2.ModelConfig())
    except text_format.ParseError as e:
        raise ConfigError(f"{folder / 'config.pbtxt'} is not a valid model config: {e}") from e
    versions = sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())
    filename = config.default_model_filename or "model.pt"
    if not versions or not (folder / str(versions[-1]) / filename).is_file():
        raise ConfigError(f"{folder} has no <version>/{filename}. Export the model again.")
    type_names = model_config_pb2.DataType.Name
    specs = [TensorSpec(t.name, type_names(t.data_type).removeprefix("TYPE_")
                        .replace("STRING", "BYTES"), _dims(t)) for t in config.input]
    module = jit_load(folder / str(versions[-1]) / filename, device)
    model = from_module(config.name or folder.name, module, specs, device)
    if len(model.outputs) != len(config.output):
        raise ConfigError(f"{folder / 'config.pbtxt'} lists {len(config.output)} outputs but "
                          f"the model returns {len(model.outputs)}.")
    model.outputs = [TensorSpec(c.name, o.datatype, _dims(c))
                     for c, o in zip(config.output, model.outputs)]
    model.version = str(versions[-1])
    return model


def _dims(tensor: Any) -> tuple[int, ...]:
    """Per-sample dims of a config input/output; ``reshape { shape: [] }`` is a scalar."""
    if tensor.HasField("reshape") and not tensor.reshape.shape:
        return ()
    return tuple(tensor.dims)
