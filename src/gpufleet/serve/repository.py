"""A model repository: a directory of model folders the server loads and unloads.

The layout is Triton's (``tritonserver --model-repository=DIR``), which ``gpufleet export
triton`` writes: each sub-folder of the directory is one model, named after the folder,
either a Triton model directory (``config.pbtxt`` + ``<version>/model.pt``) or a run
directory of ``gpufleet train`` (``config.toml`` + ``checkpoints/``). ``gpufleet serve
DIR`` loads every model at start; the ``model_repository`` extension's endpoints list
them (``POST /v2/repository/index``), load or reload one from its folder
(``.../models/NAME/load``) and unload one, freeing its memory (``.../unload``).
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path

from gpufleet.errors import ConfigError, unknown_choice
from gpufleet.serve.model import ServedModel, load_model

log = logging.getLogger(__name__)

MODEL_FILES = ("config.pbtxt", "config.toml")  # what makes a sub-folder a model


def is_repository(path: str | Path) -> bool:
    """Whether ``path`` is a directory of model folders (and not one model itself).

    Example:
        >>> is_repository("model_repository")  # doctest: +SKIP
        True
    """
    path = Path(path)
    if not path.is_dir() or any((path / f).is_file() for f in MODEL_FILES):
        return False
    return bool(_model_folders(path))


def _model_folders(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()
                  if p.is_dir() and any((p / f).is_file() for f in MODEL_FILES))


class ModelRepository:
    """The model folders under ``root``, loaded on request.

    Args:
        root: the repository directory.
        device: where models load (``auto``, ``cpu``, ``cuda``).
        trust_code: as for :func:`~gpufleet.serve.model.load_model` (run directories
            whose config names a factory of their own).

    Example:
        >>> repo = ModelRepository("model_repository")  # doctest: +SKIP
        >>> repo.names(), repo.load("gpt").inputs  # doctest: +SKIP
    """

    def __init__(self, root: str | Path, device: str = "auto",
                 trust_code: bool = False) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise ConfigError(f"model repository {str(self.root)!r} is not a directory.")
        self.device, self.trust_code = device, trust_code

    def names(self) -> list[str]:
        """The models in the directory now (it is read again on every call)."""
        return _model_folders(self.root)

    def folder(self, name: str) -> Path:
        """The folder of model ``name``; a ``KeyError`` naming the models if none."""
        names = self.names()
        if name not in names:  # also keeps '..' and other paths out
            raise KeyError(unknown_choice(f"model repository {str(self.root)!r}: model",
                                          name, names))
        return self.root / name

    def load(self, name: str) -> ServedModel:
        """Load model ``name`` from its folder (slow: call it off the event loop)."""
        return load_model(str(self.folder(name)), name=name, device=self.device,
                          trust_code=self.trust_code)

    def load_all(self) -> tuple[list[ServedModel], dict[str, str]]:
        """Every model of the directory, and why each one that failed to load did."""
        models, failed = [], {}
        for name in self.names():
            try:
                models.append(self.load(name))
            except Exception as e:  # a broken folder must not keep the others from serving
                failed[name] = f"load failed: {type(e).__name__}: {e}"
                # The text only: a record holding the exception would hold its frames,
                # and through them every model loaded so far.
                log.warning("model %r of the repository: %s", name, failed[name])
        return models, failed


def free_memory() -> None:
    """Return what unloaded models held: collect their cycles, and empty torch's CUDA
    cache so the device memory goes back too."""
    import torch  # deferred: loaded already whenever a torch model was served

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
