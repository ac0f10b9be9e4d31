"""`gpufleet export hf` of a run that `gpufleet.fit` trained on a Transformers model: the
run records the model's class and config, `--class` overrides the class, and the
weights go into a model with or without the base model's prefix (`bert.`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

import gpufleet
from conftest import final_params
from gpufleet.hf.export import export_pretrained

QUIET = {"log.progress": "off", "monitor.report": False, "run.eval_every": 0}


class Labelled(Dataset):
    """Token ids with a label each: what a tokenized classification set yields."""

    def __init__(self, n: int = 8, length: int = 8) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1000, 2000, (n, length), generator=g)
        self.labels = torch.arange(n) % 2

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]),
                "labels": self.labels[i]}


@pytest.fixture(scope="module")
def fit_run(minilm_dir, tmp_path_factory) -> Path:
    """A run of gpufleet.fit on MiniLM with a classifier head (2 steps); read only."""
    from transformers import AutoModelForSequenceClassification

    out = tmp_path_factory.mktemp("runs")
    model = AutoModelForSequenceClassification.from_pretrained(minilm_dir, num_labels=2)
    result = gpufleet.fit(model, Labelled(), overrides={
        **QUIET, "run.max_steps": 2, "data.batch_size": 4, "optim.lr": 1e-2,
        "run.out_dir": str(out)})
    return Path(result.run_dir)


def test_a_fit_run_exports_its_own_class_and_config(fit_run, tmp_path, minilm_dir, run_cli):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, BertModel

    run = fit_run
    recorded = json.loads((run / "transformers" / "config.json").read_text())
    assert recorded["architectures"] == ["BertForSequenceClassification"]
    trained = final_params(run)
    assert any(k.startswith("bert.embeddings.") for k in trained)

    # No --base: the recorded config and class; the tokenizer from MiniLM's folder.
    out = export_pretrained(run, tmp_path / "whole", tokenizer=minilm_dir)
    exported = AutoModelForSequenceClassification.from_pretrained(out)
    assert type(exported).__name__ == "BertForSequenceClassification"
    for key, value in trained.items():
        torch.testing.assert_close(exported.state_dict()[key], value, rtol=0, atol=0,
                                   msg=key)
    assert len(AutoTokenizer.from_pretrained(out)) == len(AutoTokenizer.from_pretrained(
        minilm_dir))

    # --class BertModel with MiniLM as --base (a bare BertModel): the `bert.` weights go
    # to `embeddings...`, the classifier head is left out.
    export_pretrained(run, tmp_path / "bare", base=minilm_dir, class_name="BertModel")
    bare = BertModel.from_pretrained(tmp_path / "bare").state_dict()
    key = "embeddings.word_embeddings.weight"
    torch.testing.assert_close(bare[key], trained["bert." + key], rtol=0, atol=0)
    assert not any(k.startswith("classifier") for k in bare)
    assert "--class NAME" in run_cli("export", "hf", "--help").stdout


def test_a_fit_run_without_a_tokenizer_exports_the_model_alone(fit_run, tmp_path):
    from transformers import AutoModelForSequenceClassification

    run = fit_run
    out = export_pretrained(run, tmp_path / "out")
    assert not (out / "tokenizer_config.json").exists()
    exported = AutoModelForSequenceClassification.from_pretrained(out).state_dict()
    trained = final_params(run)
    torch.testing.assert_close(exported["classifier.weight"], trained["classifier.weight"],
                               rtol=0, atol=0)
