"""The recipe a run trains with: faithful defaults, your optimizer and scheduler."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

import gpufleet
import toyjob
from gpufleet.config import OptimConfig, load_config
from gpufleet.core.callbacks import Callback
from gpufleet.errors import ConfigError
from gpufleet.models import build_gpt
from gpufleet.train.optim import fill_optimizer_defaults

BASE = {"run.max_steps": 12, "log.progress": "off", "log.every": 4, "data.batch_size": 16,
        "data.shuffle": False, "data.num_workers": 0, "monitor.report": False,
        "run.eval_every": 0}


def _fit(tmp_path, overrides=None, **kwargs):
    torch.manual_seed(0)
    model = toyjob.make_model()
    result = gpufleet.fit(model, toyjob.make_data(), loss_fn=F.mse_loss,
                          overrides={**BASE, "run.out_dir": str(tmp_path),
                                     **(overrides or {})}, **kwargs)
    return model, result


def _by_hand(make_opt, make_sched=None, steps=12, batch=16):
    """The same training written in plain PyTorch: batches in order, no extras."""
    torch.manual_seed(0)
    model = toyjob.make_model()
    opt = make_opt(model)
    sched = make_sched(opt) if make_sched else None
    x, y = toyjob.make_data().tensors
    for step in range(steps):
        i = (step * batch) % len(x)
        loss = F.mse_loss(model(x[i:i + batch]), y[i:i + batch])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sched:
            sched.step()
    return model


def _assert_same(a, b):
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_a_users_model_gets_the_optimizer_as_torch_builds_it_and_nothing_else(tmp_path):
    model, result = _fit(tmp_path)
    # torch's AdamW with its own lr, no weight decay added, no clip, no schedule.
    by_hand = _by_hand(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0))
    _assert_same(model, by_hand)
    written = (Path(result.run_dir) / "config.toml").read_text()
    assert 'preset = "none"' in written and "clip: off" in written
    assert "schedule: constant lr" in written and "AdamW(lr=0.001, betas=(0.9, 0.999)" in written
    rows = [json.loads(x) for x in open(Path(result.run_dir) / "metrics.jsonl")]
    train = [r for r in rows if r["kind"] == "train"]
    assert train and all("grad_norm" not in r for r in train)  # nothing measured it
    assert {r["lr"] for r in train} == {1e-3}


def test_the_built_in_gpt_keeps_its_recipe_as_a_named_preset():
    gpt = fill_optimizer_defaults(OptimConfig(), build_gpt(n_layer=1, n_head=2, n_embd=16,
                                                           block_size=8))
    assert (gpt.preset, gpt.clip_norm, gpt.warmup_steps, gpt.decay) == ("gpt", 1.0, 20,
                                                                        "cosine")
    mine = fill_optimizer_defaults(OptimConfig(preset="gpt", clip_norm=0.0),
                                   toyjob.make_model())
    assert (mine.preset, mine.clip_norm, mine.lr) == ("gpt", 0.0, 3e-3)  # asked for


def test_your_optimizer_groups_and_scheduler_match_plain_pytorch(tmp_path):
    torch.manual_seed(0)
    model = toyjob.make_model()
    opt = toyjob.sgd_two_groups(model.parameters())
    result = gpufleet.fit(model, toyjob.make_data(), loss_fn=F.mse_loss, optimizer=opt,
                          scheduler=toyjob.halve_every_3(opt),
                          overrides={**BASE, "run.out_dir": str(tmp_path)})
    by_hand = _by_hand(lambda m: toyjob.sgd_two_groups(m.parameters()), toyjob.halve_every_3)
    _assert_same(model, by_hand)
    recipe = load_config(Path(result.run_dir) / "config.toml").optim.recipe
    assert recipe.startswith("SGD(lr=0.05, momentum=0.9") and "group 0: lr=0.2" in recipe
    assert "StepLR(step_size=3, gamma=0.5) every step" in recipe


def _warm_then_step(opt):
    """A chained schedule: each scheduler inside steps its own ``optimizer``."""
    sched = torch.optim.lr_scheduler
    return sched.SequentialLR(opt, [sched.LinearLR(opt, 0.1, 1.0, total_iters=4),
                                    sched.StepLR(opt, step_size=3, gamma=0.5)],
                              milestones=[4])


def test_a_chained_scheduler_object_steps_the_optimizer_that_trains(tmp_path):
    """SequentialLR's schedulers each hold the optimizer: moved onto the run's rebuilt
    optimizer with it, as the outer one is, or training kept the first lr while the
    log showed the schedule."""
    torch.manual_seed(0)
    model = toyjob.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gpufleet.fit(model, toyjob.make_data(), loss_fn=F.mse_loss, optimizer=opt,
                 scheduler=_warm_then_step(opt),
                 overrides={**BASE, "run.out_dir": str(tmp_path)})
    by_hand = _by_hand(lambda m: torch.optim.SGD(m.parameters(), lr=0.1), _warm_then_step)
    _assert_same(model, by_hand)


def test_reduce_lr_on_plateau_steps_on_each_evaluations_loss(tmp_path):
    """Stepped with the eval loss after each evaluation (every 3 steps here), as a plain
    loop that steps it with the same losses at the same steps: the same weights."""
    torch.manual_seed(0)
    model = toyjob.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    train, held_out = toyjob.make_data(n=192, n_eval=64)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0,
                                                       threshold=0.5)
    result = gpufleet.fit(model, train, held_out, loss_fn=F.mse_loss, optimizer=opt,
                          scheduler=sched, overrides={**BASE, "run.out_dir": str(tmp_path),
                                                      "run.eval_every": 3})
    losses = dict(result.eval_losses)
    torch.manual_seed(0)
    by_hand = toyjob.make_model()
    hand_opt = torch.optim.SGD(by_hand.parameters(), lr=0.5)
    hand_sched = torch.optim.lr_scheduler.ReduceLROnPlateau(hand_opt, factor=0.5, patience=0,
                                                            threshold=0.5)
    x, y = train.tensors
    for step in range(1, 13):
        i = ((step - 1) * 16) % len(x)
        hand_opt.zero_grad()
        F.mse_loss(by_hand(x[i:i + 16]), y[i:i + 16]).backward()
        hand_opt.step()
        if step % 3 == 0 and step < 12:
            hand_sched.step(losses[step])
    assert hand_opt.param_groups[0]["lr"] < 0.5  # it acted (a small gain counts as none)
    _assert_same(model, by_hand)
    recipe = load_config(Path(result.run_dir) / "config.toml").optim.recipe
    assert "ReduceLROnPlateau(" in recipe and "after each evaluation, on the eval loss" \
        in recipe


def test_reduce_lr_on_plateau_without_an_evaluation_is_refused_before_training(tmp_path):
    model = toyjob.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with pytest.raises(ConfigError, match="this run does not evaluate"):
        gpufleet.fit(model, toyjob.make_data(), loss_fn=F.mse_loss, optimizer=opt,
                     scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(opt),
                     overrides={**BASE, "run.out_dir": str(tmp_path)})
    train, held_out = toyjob.make_data(n=192, n_eval=64)
    with pytest.raises(ConfigError, match="mode='min'"):
        gpufleet.fit(model, train, held_out, loss_fn=F.mse_loss, optimizer=opt,
                     scheduler=lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(
                         o, mode="max"),
                     overrides={**BASE, "run.out_dir": str(tmp_path), "run.eval_every": 3})


class _StopAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, view, step):
        if step == self.step:
            raise KeyboardInterrupt


def test_your_optimizer_and_scheduler_resume_bit_identically(tmp_path):
    def fit(run_dir, callbacks=(), resume=""):
        torch.manual_seed(0)
        model = toyjob.make_model()
        settings = {**BASE, "run.dir": str(run_dir), "checkpoint.every": 4,
                    "data.shuffle": True, "checkpoint.resume": resume}
        return model, gpufleet.fit(model, toyjob.make_data(), loss_fn=F.mse_loss,
                                   optimizer=toyjob.sgd_two_groups,
                                   scheduler=toyjob.halve_every_3, overrides=settings,
                                   callbacks=callbacks)

    whole, _ = fit(tmp_path / "whole")
    with pytest.raises(KeyboardInterrupt):
        fit(tmp_path / "cut", [_StopAt(6)])
    resumed, _ = fit(tmp_path / "cut", resume="latest")
    for (name, p), q in zip(whole.state_dict().items(), resumed.state_dict().values(),
                            strict=True):
        assert torch.equal(p, q), name


def test_an_epoch_scheduler_steps_once_per_epoch(tmp_path):
    # 256 samples, batch 16: 16 steps an epoch; StepLR(3) halves every third epoch.
    _, result = _fit(tmp_path, {"run.max_steps": 64, "log.every": 16,
                                "sched.interval": "epoch"},
                     optimizer=lambda p: torch.optim.SGD(p, lr=0.08),
                     scheduler=toyjob.halve_every_3)
    rows = [json.loads(x) for x in open(Path(result.run_dir) / "metrics.jsonl")]
    # After epochs 1..4 the scheduler has stepped 1..4 times: halved once, after the 3rd.
    lrs = [r["lr"] for r in rows if r["kind"] == "train"]
    assert lrs == pytest.approx([0.08, 0.08, 0.04, 0.04])


def test_two_schedules_at_once_and_foreign_optimizers_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="would both set the learning rate"):
        _fit(tmp_path, {"optim.warmup_steps": 5}, optimizer=torch.optim.SGD,
             scheduler=toyjob.halve_every_3)
    other = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="not parameters of the model"):
        _fit(tmp_path, optimizer=torch.optim.SGD(other.parameters(), lr=0.1))


# local_sgd all-reduces gradients through its warm-up (here the whole run), as ddp does;
# the pipeline's two stages each rebuild only their own layers' groups.
EXTRA = {"pipeline": ["--parallel.pipeline.microbatches", "2"],
         "local_sgd": ["--parallel.local_sgd.warmup_steps", "6"]}


# ddp and zero1 equal single in test_distributed.py and test_zero.py; here the slow set.
@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.slow), "fsdp",
                                      pytest.param("zero1", marks=pytest.mark.slow),
                                      "pipeline",
                                      pytest.param("local_sgd", marks=pytest.mark.slow)])
def test_your_optimizer_factory_from_the_config_under_two_ranks_equals_single(
        run_cli, tmp_path, strategy):
    job = ["--model", "toyjob:make_model", "--data", "toyjob:make_data",
           "--model.loss", "torch.nn.functional:mse_loss", "--data.num_workers", "0",
           "--optim.factory", "toyjob:sgd_two_groups", "--sched.factory",
           "toyjob:halve_every_3", "--max-steps", "6", "--run.eval_every", "0",
           "--run.out_dir", "runs", "--monitor.report", "false"]
    run_cli("train", *job, "--batch-size", "16", "--run-dir", "runs/one")
    # Two data-parallel ranks read 8 samples each; a pipeline's stages read all 16.
    batch = "16" if strategy == "pipeline" else "8"
    run_cli("train", *job, "--batch-size", batch, "--nproc", "2", "--strategy", strategy,
            *EXTRA.get(strategy, []), "--run-dir", "runs/two", timeout=300)
    from gpufleet.train.checkpoint import format as ckpt

    def final_params(run_dir):  # a file, or fsdp's directory of shards
        return ckpt.load_checkpoint(ckpt.list_checkpoints(run_dir)[-1])["model"]

    one, two = final_params(tmp_path / "runs/one"), final_params(tmp_path / "runs/two")
    for key, value in one.items():
        torch.testing.assert_close(two[key], value, rtol=1e-5, atol=1e-6, msg=key)
    recipe = load_config(tmp_path / "runs/two/config.toml").optim.recipe
    assert "SGD(lr=0.05, momentum=0.9" in recipe and f"strategy {strategy} on 2" in recipe


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD,
                                 torch.optim.RMSprop])
def test_every_torch_optimizer_object_is_rebuilt_with_its_groups(cls):
    from gpufleet.train.recipe import spec_from_optimizer

    model = toyjob.make_model()
    given = cls([{"params": model[0].parameters(), "weight_decay": 0.0},
                 {"params": model[3].parameters()}], lr=0.02)
    rebuilt = spec_from_optimizer(given, model).build(model)
    assert type(rebuilt) is cls
    assert [{k: v for k, v in g.items() if k != "params"} for g in rebuilt.param_groups] == [
        {k: v for k, v in g.items() if k != "params"} for g in given.param_groups]


def test_the_recipe_line_says_when_tf32_is_set_on_a_gpu():
    """The line names TF32 where a CUDA run sets it (the built-in GPT's recipe, or asked
    for), and says nothing where torch's own setting is left alone, or on a CPU."""
    from gpufleet.config import load_config
    from gpufleet.resolve import Machine, resolve
    from gpufleet.train.recipe import recipe_line

    gpu = Machine(cuda=True, gpus=1, bf16=True)
    sgd = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)

    def line(machine, overrides=(), **how):
        cfg = resolve(load_config(overrides=list(overrides)), machine, 1, **how)
        return recipe_line(sgd, "constant", cfg, "single", 1)

    assert "precision bf16-mixed, TF32 on |" in line(gpu)  # the built-in GPT
    assert "precision fp32 |" in line(gpu, own_loop=True)
    assert "precision fp32, TF32 on |" in line(gpu, ["perf.tf32=true"], own_loop=True)
    assert "precision bf16-mixed, TF32 off |" in line(gpu, ["perf.tf32=false"])
    assert "TF32" not in line(Machine(cuda=False, gpus=0, bf16=False), ["perf.tf32=true"])
