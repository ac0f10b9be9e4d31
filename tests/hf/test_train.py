"""Transformers models through the trainer: padded dict batches, a model that returns its
loss or logits + labels with a loss function, bf16-mixed with accumulation, and the
entity-marker example fine-tuning the real MiniLM on 2 gloo ranks."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F

import gpufleet
from conftest import TESTS, final_params
from gpufleet.hf import TextDataset, add_tokens, pad_batch
from gpufleet.train.engine.batches import make_loss_fn

from .conftest import EXAMPLES, MARKERS, SENTENCE

sys.path.insert(0, str(EXAMPLES))
import entity_markers


def _tiny_classifier(vocab_size: int):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, num_labels=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def test_text_dataset_pads_each_batch_to_its_longest_sample(minilm):
    tokenizer = minilm[1]
    data = TextDataset(tokenizer, ["a car", "a red car stopped"], [1, 0])
    assert data.lengths == [4, 6] and data[0]["labels"] == 1
    batch = data.collate_fn([data[0], data[1]])
    assert batch["input_ids"].shape == (2, 6) and batch["input_ids"].dtype == torch.long
    assert batch["input_ids"][0, 4:].tolist() == [tokenizer.pad_token_id] * 2
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 0, 0], [1] * 6]
    assert batch["labels"].tolist() == [1, 0]
    tagged = pad_batch([{"input_ids": [1, 2], "labels": [3, 4]}, {"input_ids": [1],
                                                                  "labels": [5]}])
    assert tagged["labels"].tolist() == [[3, 4], [5, -100]]  # -100: ignored by the loss
    with pytest.raises(ValueError, match="2 labels for 1 texts"):
        TextDataset(tokenizer, ["a car"], [0, 1])


def test_loss_from_the_model_or_from_logits_and_labels(minilm):
    model = _tiny_classifier(len(minilm[1])).eval()
    data = TextDataset(minilm[1], ["a car", "the red bus stopped"], [1, 0])
    batch = data.collate_fn([data[0], data[1]])
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        own = make_loss_fn()(model, batch)
        from_logits = make_loss_fn(F.cross_entropy)(model, batch)
        expected = F.cross_entropy(model(**inputs).logits, batch["labels"])
    torch.testing.assert_close(own, expected)
    torch.testing.assert_close(from_logits, expected)


def _mean(values):
    return sum(values) / len(values)


@pytest.mark.parametrize("loss_fn", [None, F.cross_entropy], ids=["own-loss", "logits"])
def test_single_process_bf16_with_accumulation_loss_falls(minilm_dir, tmp_path, loss_fn):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    model = _tiny_classifier(len(tokenizer))
    add_tokens(model, tokenizer, MARKERS, special=True, init="mean-all")
    # A task a small model learns from scratch in a few steps: are there markers?
    texts, _ = entity_markers.make_sentences(128)
    labels = [i % 2 for i in range(len(texts))]
    texts = [t if label else t.replace("[ENT_START] ", "").replace(" [ENT_END]", "")
             for t, label in zip(texts, labels)]
    data = TextDataset(tokenizer, texts, labels, max_length=32)
    result = gpufleet.fit(model, data, loss_fn=loss_fn, overrides={
        "run.max_steps": 30, "run.device": "cpu", "run.out_dir": str(tmp_path),
        "run.eval_every": 0, "data.batch_size": 8, "optim.grad_accum": 2,
        "precision.mode": "bf16-mixed", "optim.lr": 3e-3, "optim.warmup_steps": 2,
        "optim.decay": "constant", "log.every": 1, "log.progress": "off",
        "checkpoint.save_final": False})
    losses = [loss for _, loss in result.losses]
    assert result.steps == 30 and len(losses) == 30
    assert _mean(losses[-6:]) < _mean(losses[:6]) - 0.1, losses


def _run_example(run_cli, tmp_path, *extra):
    env = {"PYTHONPATH": os.pathsep.join([str(EXAMPLES), str(TESTS)]), "HF_HUB_OFFLINE": "1"}
    proc = run_cli("--work-dir", str(tmp_path / "em"), "--nproc", "2", "--max-steps", "10",
                   "--n-train", "160", "--log.progress=off", "--checkpoint.save_final=false",
                   *extra, module="entity_markers", env=env, timeout=280)
    (run_dir,) = (tmp_path / "em" / "runs").glob("entity-markers-*")
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    config = (run_dir / "config.toml").read_text()
    assert 'strategy = "ddp"' in config and 'backend = "gloo"' in config and "nproc = 2" in config
    assert "vocabulary 30522 -> 30524" in proc.stdout
    assert "training loss by step" in proc.stdout
    return losses


# Slow: the example end to end; the single-process Transformers tests stay in the
# default run.
@pytest.mark.slow
def test_example_fine_tunes_minilm_on_two_gloo_ranks_and_the_loss_falls(run_cli, tmp_path):
    losses = _run_example(run_cli, tmp_path)
    assert len(losses) == 10
    assert _mean(losses[-3:]) < _mean(losses[:3]) - 0.1, losses


@pytest.mark.slow
def test_example_with_bf16_and_accumulation_on_two_ranks(run_cli, tmp_path):
    losses = _run_example(run_cli, tmp_path, "--precision.mode=bf16-mixed",
                          "--optim.grad_accum=2", "--data.batch_size=4")
    assert _mean(losses[-3:]) < _mean(losses[:3]) - 0.1, losses


@pytest.mark.parametrize("rank, shown", [("0", True), ("1", False)])
def test_the_transformers_load_report_prints_on_rank_0_only(minilm_dir, monkeypatch, rank,
                                                            shown):
    import logging

    from gpufleet.hf import pretrained

    # MiniLM has no classifier head: loading it as a classifier reports the new weights.
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("transformers").addHandler(handler)  # what transformers prints
    try:
        model = pretrained(str(minilm_dir), "AutoModelForSequenceClassification",
                           num_labels=2)
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert model.config.num_labels == 2
    text = "\n".join(seen)
    assert ("LOAD REPORT" in text) is shown and ("classifier.weight" in text) is shown


def test_export_hf_gives_from_pretrained_the_trained_weights(run_cli, tmp_path, minilm_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    # A small BERT with MiniLM's tokenizer plus the markers, as `gpufleet tokens add` makes.
    base = tmp_path / "base"
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": MARKERS})
    model = _tiny_classifier(len(tokenizer))
    tokenizer.save_pretrained(base)
    model.save_pretrained(base)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(EXAMPLES), str(TESTS),
                                                       os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1"}
    kwargs = f"{{path = {json.dumps(str(base))}, auto_class = " \
             "'AutoModelForSequenceClassification', num_labels = 2}"
    run_cli("train", "--model", "gpufleet.hf:pretrained", f"--model.kwargs={kwargs}",
            "--data", "entity_markers:build_data",
            f"--data.kwargs={{model_dir = {json.dumps(str(base))}, n_train = 32}}",
            "--max-steps", "3", "--batch-size", "8", "--run-dir", "runs/hf", "--lr", "1e-2",
            "--run.eval_every=0", "--log.progress=off", "--device", "cpu", env=env)
    proc = run_cli("export", "hf", "runs/hf", "out", env=env)
    assert "wrote the trained model and its tokenizer to out" in proc.stdout
    trained = final_params(tmp_path / "runs" / "hf")
    exported = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out")
    got = exported.state_dict()
    assert trained.keys() <= got.keys()
    for key, value in trained.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
    before = model.state_dict()["classifier.weight"]
    assert not torch.equal(got["classifier.weight"], before)  # trained, not the base
    out_tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert len(out_tok) == len(tokenizer) and out_tok.tokenize(SENTENCE)[1] == "[ENT_START]"


def test_export_hf_of_an_own_factory_asks_for_the_base_folder(run_cli, tmp_path):
    from gpufleet.config import load_config, write_config

    (tmp_path / "runs" / "toy").mkdir(parents=True)
    write_config(load_config(overrides={"model.name": "toyjob:make_model"}),
                 tmp_path / "runs" / "toy" / "config.toml")
    proc = run_cli("export", "hf", "runs/toy", "out", expect=2)
    assert "the run's model is 'toyjob:make_model'" in proc.stderr
    assert "Pass --base FOLDER" in proc.stderr and "Traceback" not in proc.stderr
