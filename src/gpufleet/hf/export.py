"""``gpufleet export hf RUN_DIR OUT_DIR``: a trained Transformers model back to a
``save_pretrained`` folder, with its tokenizer.

A run trained with ``--model gpufleet.hf:pretrained`` keeps gpufleet checkpoints (the
model's state dict plus the training state). This builds the same Transformers class
from the base folder's config (with the run's ``model.kwargs``, e.g. ``num_labels``),
loads the newest intact checkpoint's weights into it (``weights_only=True``: nothing in
the file runs), and saves model and tokenizer together, so that
``AutoModel*.from_pretrained(OUT_DIR)`` and ``AutoTokenizer.from_pretrained(OUT_DIR)``
give back the trained model.

Nothing named in the run's config is imported: the base folder comes from
``model.kwargs.path`` of ``gpufleet.hf:pretrained`` runs, from the model's own config
that a run of ``gpufleet.fit`` recorded (``<run_dir>/transformers/config.json``, see
:mod:`gpufleet.train.checkpoint.modelrecord`), or from ``--base``. The class is ``--class``, else
the one the run trained, else the base folder's. Weights of a model with a head
(``bert.embeddings...``) export into the bare model (``embeddings...``; the head is
left out) and the other way round, by the class's ``base_model_prefix``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from gpufleet.errors import ConfigError

log = logging.getLogger(__name__)

PRETRAINED_FACTORIES = ("gpufleet.hf:pretrained", "gpufleet.hf.models:pretrained")


def export_pretrained(run_dir: str | Path, out_dir: str | Path, base: str | Path | None = None,
                      tokenizer: str | Path | None = None,
                      class_name: str | None = None) -> Path:
    """Write the run's trained weights and the tokenizer as a ``save_pretrained`` folder.

    Args:
        run_dir: a run directory (config.toml and checkpoints/).
        out_dir: the folder to write (created).
        base: the model folder the run started from (config.json); default: the run's
            ``model.kwargs.path`` when it was trained with ``gpufleet.hf:pretrained``.
        tokenizer: the folder to take the tokenizer from (default: ``base``; none for
            a run whose base is its recorded config: the model is then written alone).
        class_name: the Transformers class to export as (``BertModel``,
            ``AutoModelForSequenceClassification``); default: the class the run trained,
            else the base folder's.

    Returns:
        ``out_dir``.

    Example:
        >>> export_pretrained("runs/entity-markers-1", "out/minilm-tuned")  # doctest: +SKIP
        PosixPath('out/minilm-tuned')
    """
    from gpufleet.config import load_config
    from gpufleet.hf.models import check_model_folder, model_class, save_together
    from gpufleet.train.checkpoint.format import find_resume_checkpoint
    from gpufleet.train.checkpoint.modelrecord import FOLDER

    run = Path(run_dir)
    if not (run / "config.toml").is_file():
        raise ConfigError(f"{str(run)!r} is not a run directory (no config.toml). Give the "
                          "folder `gpufleet train` wrote, e.g. runs/<name>-<time>.")
    cfg = load_config(run / "config.toml")
    # The built-in GPT's settings are not a Transformers model's: only a factory's count.
    kwargs = dict(cfg.model.kwargs) if cfg.model.name != "gpt" else {}
    recorded = run / FOLDER
    base = Path(base or _base_folder(cfg.model.name, kwargs, recorded))
    check_model_folder(base)
    checkpoint = find_resume_checkpoint(str(run), cfg.run.out_dir, cfg.run.name)
    state = _model_state(checkpoint)
    auto_class = class_name or kwargs.pop("auto_class", None) or _trained_class(recorded)
    kwargs.pop("auto_class", None)
    kwargs.pop("path", None)
    model = _build(model_class(base, auto_class), base, kwargs)
    state = _match_prefix(model, state)
    _resize_like(model, state)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ConfigError(
            f"the weights in {checkpoint} do not fit {type(model).__name__} built from "
            f"{base}: missing {list(missing)[:5]}, unexpected {list(unexpected)[:5]}. Pass "
            "--class with the class the run trained (e.g. BertForSequenceClassification), "
            "or --base with the folder the run's model was built from.")
    if tokenizer is None and base == recorded:  # fit got a model, never a tokenizer
        out = _save_alone(model, out_dir)
    else:
        out = save_together(model, _tokenizer(Path(tokenizer) if tokenizer else base),
                            out_dir)
    log.info("exported %s (step %s) to %s", checkpoint.name, checkpoint.stem, out)
    return out


def _base_folder(model_name: str, kwargs: dict[str, Any], recorded: Path) -> str:
    if model_name in PRETRAINED_FACTORIES and kwargs.get("path"):
        return str(kwargs["path"])
    if (recorded / "config.json").is_file():  # a gpufleet.fit run of a Transformers model
        return str(recorded)
    raise ConfigError(
        f"the run's model is {model_name!r}, not gpufleet.hf:pretrained with a path, and "
        "the run recorded no Transformers config, so its Transformers folder is unknown. "
        "Pass --base FOLDER: the save_pretrained folder (config.json, tokenizer) the model "
        "was built from.")


def _trained_class(recorded: Path) -> str | None:
    """The class a ``gpufleet.fit`` run trained, as it recorded it (None: no record)."""
    import json

    try:
        names = json.loads((recorded / "config.json").read_text()).get("architectures")
    except (OSError, ValueError):
        return None
    return names[0] if names else None


def _match_prefix(model: Any, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` named as ``model`` names its weights: the base model's prefix
    (``bert.``) added for a model with a head, or taken off (the head left out) for the
    bare model."""
    prefix = f"{getattr(model, 'base_model_prefix', '') or ''}."
    if prefix == ".":
        return state
    own = any(k.startswith(prefix) for k in model.state_dict())
    saved = any(k.startswith(prefix) for k in state)
    if own and not saved:  # the bare model was trained; exported with a head
        return {prefix + k: v for k, v in state.items()}
    if saved and not own:  # a model with a head was trained; exported bare
        head = [k for k in state if not k.startswith(prefix)]
        if head:
            log.warning("%s has no head: the run's %s are left out", type(model).__name__,
                        ", ".join(head[:4]) + (" ..." if len(head) > 4 else ""))
        return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    return state


def _save_alone(model: Any, out_dir: str | Path) -> Path:
    from gpufleet.hf.models import ModelFolderError

    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(out))
    except OSError as e:
        raise ModelFolderError(f"cannot write the model to {str(out)!r}: {e}. Pick a folder "
                               "you can write to.") from e
    log.info("saved the model to %s without a tokenizer (pass --tokenizer FOLDER to add "
             "one)", out)
    return out


def _model_state(checkpoint: Path) -> dict[str, Any]:
    """The model's state dict from a checkpoint, read without running anything in it
    (gpufleet's one safe loader: ``weights_only=True``; an old-format file gets the
    migration command)."""
    from gpufleet.train.checkpoint.format import CheckpointError, load_checkpoint

    try:
        state = load_checkpoint(checkpoint, verify=False)  # newest_intact verified it
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    if not isinstance(state.get("model"), dict):
        raise ConfigError(f"{checkpoint} holds no model state dict; it is not a gpufleet "
                          "checkpoint.")
    return state["model"]


def _build(cls: Any, base: Path, kwargs: dict[str, Any]) -> Any:
    """An untrained ``cls`` from ``base``'s config (with ``kwargs``)."""
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(str(base), **kwargs)
    except (OSError, TypeError, ValueError) as e:
        raise ConfigError(f"cannot read the model config in {base} with the run's "
                          f"model.kwargs {kwargs}: {e}") from e
    build = getattr(cls, "from_config", None) or cls._from_config
    return build(config)


def _resize_like(model: Any, state: dict[str, Any]) -> None:
    """``model``'s vocabulary sized as the checkpoint's."""
    embeddings = model.get_input_embeddings()
    name = next((n for n, p in model.named_parameters() if p is embeddings.weight), None)
    rows = state[name].shape[0] if name in state else embeddings.weight.shape[0]
    if rows != embeddings.weight.shape[0]:  # tokens were added before or during training
        model.resize_token_embeddings(rows)


def _tokenizer(folder: Path) -> Any:
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as e:
        raise ConfigError(f"no tokenizer in {folder} ({e}). Pass --tokenizer FOLDER (the "
                          "folder the run's data was tokenized with).") from e
