"""The [perf] fast-path switches change the computation as intended (on CPU where they
can; the GPU numbers come from benchmarks/mfu.py on a GPU)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import gpufleet
import toyjob
from gpufleet.config import load_config
from gpufleet.core.callbacks import Callback
from gpufleet.resolve import Machine, resolve
from gpufleet.train.perf import apply_backend_flags


def _fit(tmp_path, overrides, model, data):
    base = {"run.out_dir": str(tmp_path), "log.progress": "off", "log.every": 1,
            "run.max_steps": 6, "data.batch_size": 16, "optim.warmup_steps": 1}
    return gpufleet.fit(model, data, loss_fn=F.mse_loss, overrides={**base, **overrides})


@pytest.mark.parametrize("scope", ["model", "blocks"])
def test_compile_compiles_in_place_and_matches_eager(tmp_path, scope):
    torch.manual_seed(0)
    eager_model = toyjob.make_model()
    torch.manual_seed(0)
    compiled_model = toyjob.make_model()
    eager = _fit(tmp_path / "a", {}, eager_model, toyjob.make_data())
    compiled = _fit(tmp_path / "b", {"perf.compile": True, "perf.compile_scope": scope},
                    compiled_model, toyjob.make_data())
    if scope == "model":
        assert compiled_model._compiled_call_impl is not None  # forward goes through dynamo
    else:  # the two Linear blocks each through dynamo, the container eager
        assert compiled_model._compiled_call_impl is None
        assert [m._compiled_call_impl is not None for m in compiled_model] == [
            True, False, False, True]
    assert eager_model._compiled_call_impl is None
    # Same state-dict names as the eager model: checkpoints load either way.
    saved = torch.load(compiled.checkpoint, weights_only=True)["model"]
    assert saved.keys() == eager_model.state_dict().keys()
    for (_, a), (_, b) in zip(eager.losses, compiled.losses):
        assert a == pytest.approx(b, rel=1e-4)


def test_channels_last_reaches_weights_and_inputs(tmp_path):
    seen = []

    class Spy(Callback):
        def on_phase(self, trainer, phase):
            if phase == "forward" and not seen:
                conv = trainer.strategy.unwrap(trainer.model)[0]
                seen.append(conv.weight.is_contiguous(memory_format=torch.channels_last))

    torch.manual_seed(0)
    model = toyjob.make_conv_model()
    result = gpufleet.fit(model, toyjob.make_image_data(), loss_fn=F.mse_loss, callbacks=[Spy()],
                          overrides={"run.out_dir": str(tmp_path), "log.progress": "off",
                                     "run.max_steps": 3, "data.batch_size": 8,
                                     "perf.channels_last": True})
    assert seen == [True]
    assert result.steps == 3
    # The input conversion the loop applies to 4-D float batches:
    from gpufleet.train.perf import to_channels_last

    x, y = to_channels_last((torch.randn(2, 3, 4, 4), torch.randn(2, 1)))
    assert x.is_contiguous(memory_format=torch.channels_last) and y.is_contiguous()


def test_backend_flags_follow_the_config():
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
              torch.backends.cudnn.benchmark)
    try:
        on = load_config(overrides=["perf.cudnn_benchmark=true", "perf.tf32=true"]).perf
        apply_backend_flags(on, False)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.benchmark
        apply_backend_flags(load_config(overrides=["perf.tf32=false"]).perf, False)
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        # default (and auto, unresolved) leave torch's settings as the script set them
        torch.backends.cuda.matmul.allow_tf32 = True
        for value in ("default", "auto"):
            apply_backend_flags(load_config(overrides=[f"perf.tf32={value}"]).perf, False)
            assert torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        apply_backend_flags(load_config(overrides=["perf.cudnn_benchmark=true"]).perf, True)
        assert not torch.backends.cudnn.benchmark  # deterministic wins
    finally:
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
         torch.backends.cudnn.benchmark) = before


@pytest.mark.parametrize("overrides, words", [
    (["parallel.strategy=dp", "perf.compile=true"], ["perf.compile", "ddp"]),
    (["run.deterministic=true", "perf.cudnn_benchmark=true"], ["contradict"]),
    (["perf.compile_mode=fast"], ["perf.compile_mode", "Valid:"]),
])
def test_perf_combinations_that_cannot_work(overrides, words):
    with pytest.raises(gpufleet.ConfigError) as info:
        resolve(load_config(overrides=overrides), Machine(cuda=True, gpus=2, bf16=True), 1)
    for word in words:
        assert word in str(info.value)


def test_gpt_widths_off_tensor_core_multiples_are_flagged(caplog, tmp_path, monkeypatch):
    from gpufleet.job import build_job

    monkeypatch.setenv("GPUFLEET_CACHE", str(tmp_path))
    cfg = load_config(overrides=["model.n_embd=96", "model.n_head=4", "data.corpus_bytes=20000",
                                 "model.block_size=16"])
    with caplog.at_level("WARNING", logger="gpufleet.job"):
        build_job(cfg)
    assert "multiple of 64" in caplog.text


def test_ranks_on_one_node_share_its_cores(monkeypatch):
    from gpufleet.core.machine import usable_cores
    from gpufleet.train.perf import share_cores

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        assert share_cores(local_world_size=1) is None
        assert torch.get_num_threads() == before
        want = max(1, usable_cores() // 2)
        assert share_cores(local_world_size=2) == want == torch.get_num_threads()
        assert share_cores(local_world_size=10 * usable_cores()) == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice wins
        torch.set_num_threads(before)
        assert share_cores(local_world_size=2) is None
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(("strategy", "scope"), [("single", "model"), ("ddp", "model"),
                                                  ("zero1", "model"), ("fsdp", "blocks"),
                                                  ("pipeline", "blocks"),
                                                  ("model_parallel", "blocks")])
def test_compile_scope_auto_is_blocks_only_where_the_strategy_works_by_blocks(strategy, scope):
    """One graph for a model that stays whole (it fuses across blocks and the loss head);
    block by block where FSDP hooks each block or a pipeline splits the model."""
    from gpufleet.config import ParallelConfig, load_config
    from gpufleet.parallel import build_strategy
    from gpufleet.parallel.parallelize import compile_scope

    built = build_strategy(strategy, ParallelConfig(), torch.device("cpu"))
    assert compile_scope(load_config().perf, built) == scope
    chosen = load_config(overrides={"perf.compile_scope": "blocks"}).perf
    assert compile_scope(chosen, built) == "blocks"  # a scope named is kept
