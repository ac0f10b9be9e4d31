"""Your training step: the loss or a dict of losses, several models each with their own
optimizer, scaler, guard and clip, and what a strategy cannot train refused early."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import gpufleet
from gpufleet.errors import ConfigError
from gpufleet.train.engine.steps import check_strategy, per_model, split_losses

QUIET = {"log.progress": "off", "monitor.report": False, "run.eval_every": 0,
         "data.shuffle": False}


def _data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


def _metrics(run_dir: str) -> list[dict]:
    return [json.loads(line) for line in Path(run_dir, "metrics.jsonl").open()
            if '"loss"' in line]


def test_the_loss_that_drives_backward():
    loss, mse = torch.tensor(2.0), torch.tensor(1.0)
    assert split_losses(loss, ["model"]) == ({"model": loss}, {})
    assert split_losses({"mse": mse, "loss": loss}, ["model"])[0] == {"model": loss}
    assert split_losses({"mse": mse, "kl": loss}, ["model"])[0] == {"model": mse}
    driving, logged = split_losses({"g": loss, "extra": mse}, ["g", "d"])
    assert driving == {"g": loss} and set(logged) == {"g", "extra"}
    with pytest.raises(ConfigError, match="none is named after a model"):
        split_losses({"loss": loss}, ["g", "d"])
    with pytest.raises(ConfigError, match=r"'mse' is \(4,\), not a scalar"):
        split_losses({"mse": torch.ones(4)}, ["model"])
    with pytest.raises(ConfigError, match="returned float"):
        split_losses(1.0, ["model"])


def test_one_optimizer_object_for_several_models_is_refused():
    opt = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="one optimizer object for 2 models"):
        per_model(opt, ["g", "d"], "optimizer")
    with pytest.raises(ConfigError, match=r"\['x'\], which are not models"):
        per_model({"x": opt}, ["g", "d"], "optimizer")
    assert per_model(torch.optim.SGD, ["g", "d"], "optimizer") == {
        "g": torch.optim.SGD, "d": torch.optim.SGD}


def test_what_a_strategy_cannot_train_is_refused():
    with pytest.raises(ConfigError, match="'pipeline' runs its own schedule"):
        check_strategy("pipeline", False, True)
    with pytest.raises(ConfigError, match="'fsdp' trains one model"):
        check_strategy("fsdp", True, True)
    check_strategy("ddp", True, True)
    check_strategy("fsdp", False, True)


def test_several_models_on_fsdp_are_refused_before_any_rank_starts(tmp_path):
    models = {"a": nn.Linear(4, 1), "b": nn.Linear(4, 1)}
    with pytest.raises(ConfigError, match="'fsdp' trains one model"):
        gpufleet.fit(models, _data(), training_step=lambda m, b, s: {},
                     overrides={**QUIET, "dist.nproc": 2, "parallel.strategy": "fsdp",
                                "run.out_dir": str(tmp_path)})
    assert not any(tmp_path.iterdir())  # no run folder either


def mse_and_l1(model, batch, step):
    x, y = batch
    out = model(x)
    return {"loss": F.mse_loss(out, y), "l1": F.l1_loss(out, y)}


def test_a_dict_of_losses_is_logged_and_its_loss_trains(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    result = gpufleet.fit(model, _data(), training_step=mse_and_l1,
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.05),
                          overrides={**QUIET, "run.max_steps": 4, "log.every": 2,
                                     "data.batch_size": 16, "run.out_dir": str(tmp_path)})
    torch.manual_seed(0)
    plain = nn.Linear(4, 1)
    opt = torch.optim.SGD(plain.parameters(), lr=0.05)
    x, y = _data().tensors
    l1 = []
    for step in range(4):
        xb, yb = x[16 * step:16 * step + 16], y[16 * step:16 * step + 16]
        l1.append(F.l1_loss(plain(xb), yb).item())
        opt.zero_grad()
        F.mse_loss(plain(xb), yb).backward()
        opt.step()
    rows = _metrics(result.run_dir)
    assert [r["step"] for r in rows] == [2, 4]
    assert rows[1]["l1"] == pytest.approx(sum(l1[2:]) / 2, rel=1e-5)
    torch.testing.assert_close(model.weight, plain.weight)


class _Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)

    def forward(self, x):
        return self.net(x)


def _pair(seed: int = 0) -> dict[str, nn.Module]:
    torch.manual_seed(seed)
    return {"first": _Pair(), "second": _Pair()}


def both_losses(models, batch, step):
    x, y = batch
    return {"first": F.mse_loss(models["first"](x), y),
            "second": F.mse_loss(models["second"](x) * 3, y)}


def test_each_model_is_clipped_on_its_own(tmp_path):
    models = _pair()
    before = {n: [p.detach().clone() for p in m.parameters()] for n, m in models.items()}
    gpufleet.fit(models, _data(), training_step=both_losses,
                 optimizer=lambda p: torch.optim.SGD(p, lr=1.0),
                 overrides={**QUIET, "run.max_steps": 1, "optim.clip_norm": 0.01,
                            "run.out_dir": str(tmp_path)})
    for name, model in models.items():
        moved = torch.cat([(p - b).flatten() for p, b in zip(model.parameters(),
                                                            before[name], strict=True)])
        # lr 1: each model moved by its own gradient clipped to 0.01 (one norm over both
        # would leave each less).
        assert moved.norm().item() == pytest.approx(0.01, rel=1e-4), name


def nan_second_at_step_one(models, batch, step):
    losses = both_losses(models, batch, step)
    if step == 1:
        losses["second"] = losses["second"] * float("nan")
    return losses


def test_a_non_finite_loss_skips_only_its_own_models_step(tmp_path):
    models = _pair()
    second = [p.detach().clone() for p in models["second"].parameters()]
    seen = []

    class Watch(gpufleet.Callback):
        def on_step_end(self, view, step):
            seen.append((step, [p.detach().clone() for p in models["second"].parameters()],
                         models["first"].net.weight.detach().clone()))

    result = gpufleet.fit(models, _data(), training_step=nan_second_at_step_one,
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                          callbacks=[Watch()],
                          overrides={**QUIET, "run.max_steps": 3,
                                     "run.out_dir": str(tmp_path)})
    assert result.skipped_steps == 1
    after_first, after_second = seen[0], seen[1]
    assert not torch.equal(after_first[1][0], second[0])  # step 1 trained it
    for a, b in zip(after_first[1], after_second[1], strict=True):
        assert torch.equal(a, b)  # step 2 (the NaN) left it as it was
    assert not torch.equal(after_first[2], after_second[2])  # the other model stepped
    assert all(torch.isfinite(p).all() for p in models["second"].parameters())


def test_fp16_gives_each_optimizer_its_own_scaler_in_the_checkpoint(tmp_path):
    from gpufleet.train.checkpoint.format import load_checkpoint

    result = gpufleet.fit(_pair(), _data(), training_step=nan_second_at_step_one,
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                          overrides={**QUIET, "run.max_steps": 2, "run.device": "cpu",
                                     "precision.mode": "fp16-mixed",
                                     "precision.init_scale": 1024.0,
                                     "run.out_dir": str(tmp_path)})
    saved = load_checkpoint(result.checkpoint)["models"]
    assert set(saved) == {"first", "second"}
    # The second model's NaN step backed off its own scaler only.
    assert saved["first"]["precision"]["scaler"]["scale"] == 1024.0
    assert saved["second"]["precision"]["scaler"]["scale"] == 512.0
    for name in saved:
        assert saved[name]["optimizer"]["state"], name  # each optimizer stepped


def test_accumulation_holds_back_every_models_sync(tmp_path, monkeypatch):
    from gpufleet.parallel.base import Strategy

    held: list[str] = []
    plain_no_sync = Strategy.no_sync

    def no_sync(self, model):
        held.append(type(model).__name__ + str(id(model)))
        return plain_no_sync(self, model)

    monkeypatch.setattr(Strategy, "no_sync", no_sync)
    models = _pair()
    gpufleet.fit(models, _data(), training_step=both_losses,
                 optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                 overrides={**QUIET, "run.max_steps": 2, "optim.grad_accum": 3,
                            "run.out_dir": str(tmp_path)})
    ids = {"_Pair" + str(id(m)) for m in models.values()}
    # 2 steps x 2 micro-batches held back x 2 models.
    assert len(held) == 8 and set(held) == ids


def test_several_models_need_a_training_step(tmp_path):
    with pytest.raises(ConfigError, match="need a training_step"):
        gpufleet.fit(_pair(), _data(), overrides={**QUIET, "run.max_steps": 1,
                                                  "run.out_dir": str(tmp_path)})


_JOB = '''
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset


def models():
    return {"first": nn.Linear(4, 1), "second": nn.Linear(4, 1)}


def data():
    x = torch.randn(32, 4)
    return TensorDataset(x, x.sum(1, keepdim=True))


def step(models, batch, step):
    x, y = batch
    return {name: F.mse_loss(m(x), y) for name, m in models.items()}


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)
'''


def test_the_config_names_a_training_step_that_a_received_run_must_trust(tmp_path,
                                                                         monkeypatch):
    from gpufleet.config import load_config
    from gpufleet.entry import train
    from gpufleet.job import require_trusted

    (tmp_path / "stepjob.py").write_text(_JOB)
    monkeypatch.syspath_prepend(str(tmp_path))
    result = train(load_config(overrides={
        **QUIET, "model.name": "stepjob:models", "data.name": "stepjob:data",
        "model.training_step": "stepjob:step", "optim.factory": "stepjob:sgd",
        "run.max_steps": 2, "run.out_dir": str(tmp_path / "runs")}))
    assert result.steps == 2 and math.isfinite(result.final_loss)
    saved = load_config(Path(result.run_dir) / "config.toml")
    assert saved.model.training_step == "stepjob:step"
    with pytest.raises(ConfigError, match=r"model\.training_step = 'stepjob:step'"):
        require_trusted(saved, False, result.run_dir)


def test_a_resumed_run_gets_each_models_scaler_back(tmp_path):
    from gpufleet.train.checkpoint.format import load_checkpoint

    settings = {**QUIET, "run.device": "cpu", "precision.mode": "fp16-mixed",
                "precision.init_scale": 1024.0, "run.dir": str(tmp_path / "run")}

    def fit(steps: int, **more):
        return gpufleet.fit(_pair(), _data(), training_step=nan_second_at_step_one,
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                            overrides={**settings, "run.max_steps": steps, **more})

    fit(2)  # the NaN of step 1 halves the second model's scale
    result = fit(3, **{"checkpoint.resume": "latest"})  # step 2 is finite
    saved = load_checkpoint(result.checkpoint)["models"]
    assert result.steps == 3
    assert saved["first"]["precision"]["scaler"]["scale"] == 1024.0
    assert saved["second"]["precision"]["scaler"]["scale"] == 512.0  # restored, kept


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.mark.slow
def test_one_models_step_trains_alike_under_ddp_fsdp_and_zero1(tmp_path):
    losses = {}
    for strategy in ("ddp", "fsdp", "zero1"):
        torch.manual_seed(0)
        result = gpufleet.fit(_Net(), _data(), training_step=mse_and_l1, overrides={
            **QUIET, "dist.nproc": 2, "parallel.strategy": strategy, "run.max_steps": 4,
            "log.every": 2, "data.batch_size": 8, "run.out_dir": str(tmp_path / strategy)})
        losses[strategy] = [row["l1"] for row in _metrics(result.run_dir)]
    for strategy in ("fsdp", "zero1"):
        assert losses[strategy] == pytest.approx(losses["ddp"], rel=1e-5), strategy
