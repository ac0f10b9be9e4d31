"""Config loading, overrides, validation and the messages users see."""

from __future__ import annotations

import pytest

from gpufleet.config import Config, load_config, write_config
from gpufleet.errors import ConfigError, closest_first
from gpufleet.resolve import Machine, resolve

CPU = Machine(cuda=False, gpus=0, bf16=False)
GPU4 = Machine(cuda=True, gpus=4, bf16=True)


def test_defaults_and_overrides():
    cfg = load_config(overrides=["optim.lr=1e-4", "run.max_steps=7", "data.kwargs={n = 3}",
                                 "model.name=mypkg.mod:make", "dist.nnodes=2"])
    assert cfg.optim.lr == 1e-4
    assert cfg.run.max_steps == 7
    assert cfg.data.kwargs == {"n": 3}
    assert cfg.model.name == "mypkg.mod:make"
    assert cfg.dist.nnodes == "2"  # an integer on the command line becomes the string
    assert Config().optim.lr == -1.0  # the model's default, filled in by the trainer


def test_toml_file_then_overrides(tmp_path):
    path = tmp_path / "cfg.toml"
    path.write_text('[optim]\nlr = 0.5\ngrad_accum = 4\n[run]\nname = "exp"\n')
    cfg = load_config(path, ["optim.lr=0.25"])
    assert (cfg.optim.lr, cfg.optim.grad_accum, cfg.run.name) == (0.25, 4, "exp")


def test_resolved_config_round_trips(tmp_path):
    cfg = resolve(load_config(overrides={"optim.lr": 0.01}), CPU, world_size=2)
    write_config(cfg, tmp_path / "config.toml")
    again = load_config(tmp_path / "config.toml")
    assert again == cfg
    assert (again.run.device, again.precision.mode, again.parallel.strategy,
            again.dist.backend) == ("cpu", "fp32", "ddp", "gloo")


@pytest.mark.parametrize("override, words", [
    ("optim.lrr=0.1", ["optim.lrr", "Did you mean 'lr'", "Valid: lr"]),
    ("optimm.lr=0.1", ["config section", "'optimm'", "Did you mean 'optim'"]),
    ("parallel.strategy=ddq", ["parallel.strategy", "'ddq'", "Did you mean 'ddp'"]),
    ("precision.mode=bf16", ["precision.mode", "Did you mean 'bf16-mixed'"]),
    ("run.max_steps=abc", ["run.max_steps expects an integer", "'abc'", "run.max_steps=8"]),
    ("run.max_steps=1.5", ["run.max_steps expects an integer"]),
    ("optim.grad_accum=0", ["optim.grad_accum = 0 is below its minimum 1"]),
    ("run.deterministic=maybe", ["run.deterministic expects true or false"]),
    ("dist.nnodes=1:x", ["dist.nnodes", "MIN:MAX"]),
    ("lr=0.1", ["not of the form section.key"]),
    ("model.n_head=3", ["model.n_embd = 128 is not divisible by model.n_head = 3"]),
])
def test_bad_keys_and_values_name_the_problem(override, words):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    for word in words:
        assert word in str(info.value)


def test_closest_choice_listed_first():
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["parallel.strategy=sngle"])
    assert "Valid: single," in str(info.value)
    assert closest_first("ddq", ["single", "dp", "ddp"])[0] == "ddp"


def test_bad_toml_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[optim\nlr = ")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")


@pytest.mark.parametrize("overrides, machine, world, words", [
    (["parallel.strategy=dp"], CPU, 1, ["'dp' (nn.DataParallel) needs CUDA", "ddp"]),
    (["parallel.strategy=dp"], GPU4, 2, ["'dp' runs in one process", "ddp"]),
    (["parallel.strategy=single"], CPU, 2, ["independent copies", "ddp"]),
    (["run.device=cuda"], CPU, 1, ["no CUDA GPU is visible", "run.device=cpu"]),
    (["dist.backend=nccl"], CPU, 1, ["'nccl' needs CUDA", "gloo"]),
    (["precision.mode=bf16-mixed", "run.device=cuda"], Machine(True, 1, False), 1,
     ["no bf16 support", "fp16-mixed"]),
])
def test_impossible_combinations(overrides, machine, world, words):
    with pytest.raises(ConfigError) as info:
        resolve(load_config(overrides=overrides), machine, world)
    for word in words:
        assert word in str(info.value)


def test_auto_values_resolve_per_machine():
    gpu = resolve(Config(), GPU4, world_size=4)
    assert (gpu.run.device, gpu.precision.mode, gpu.parallel.strategy, gpu.dist.backend) == \
        ("cuda", "bf16-mixed", "ddp", "nccl")
    cpu = resolve(Config(), CPU, world_size=1)
    assert (cpu.run.device, cpu.precision.mode, cpu.parallel.strategy, cpu.dist.backend) == \
        ("cpu", "fp32", "single", "gloo")
    # Under Horovod the process group only carries book-keeping: gloo, also on GPUs.
    hvd = resolve(load_config(overrides={"parallel.strategy": "horovod"}), GPU4, world_size=4)
    assert (hvd.run.device, hvd.dist.backend) == ("cuda", "gloo")


def test_each_parallelism_has_its_own_table_and_old_flat_keys_name_the_new_one(tmp_path):
    cfg = load_config(overrides=["parallel.ddp.comm_hook=fp16", "parallel.pipeline.schedule=gpipe",
                                 "parallel.fsdp.cpu_offload=true", "parallel.local_sgd.period=2"])
    assert (cfg.parallel.ddp.comm_hook, cfg.parallel.pipeline.schedule) == ("fp16", "gpipe")
    assert cfg.parallel.fsdp.cpu_offload and cfg.parallel.local_sgd.period == 2
    path = write_config(cfg, tmp_path / "config.toml")
    assert "[parallel.ddp]" in path.read_text() and load_config(path) == cfg
    for old, new in (("ddp_comm_hook", "ddp.comm_hook"), ("pipeline_schedule", "pipeline.schedule"),
                     ("bucket_cap_mb", "ddp.bucket_cap_mb"), ("fsdp_wrap", "fsdp.wrap"),
                     ("local_sgd_period", "local_sgd.period")):
        with pytest.raises(ConfigError, match=rf"parallel\.{old} is now parallel\.{new}"):
            load_config(overrides=[f"parallel.{old}=1"])
    (tmp_path / "old.toml").write_text('[parallel]\nstrategy = "ddp"\nddp_comm_hook = "fp16"\n')
    with pytest.raises(ConfigError, match=r"--parallel\.ddp\.comm_hook=fp16"):
        load_config(tmp_path / "old.toml")
    with pytest.raises(ConfigError, match=r"Did you mean 'comm_hook'"):
        load_config(overrides=["parallel.ddp.comm_hok=fp16"])


def test_auto_precision_and_tf32_keep_your_models_recipe_and_give_the_gpt_its_own():
    """On a GPU with bf16, only the built-in GPT's recipe (the gpt preset) is switched to
    bf16-mixed and TF32; your model (given to fit, built by a factory, or your own loop)
    computes in fp32 with torch's TF32 settings left alone, as your plain script does."""
    from torch import nn

    from gpufleet.models import GPT, GPTConfig

    def chosen(overrides=(), **how):
        cfg = resolve(load_config(overrides=list(overrides)), GPU4, 1, **how)
        return cfg.precision.mode, cfg.perf.tf32

    assert chosen() == ("bf16-mixed", "true")  # gpufleet train's built-in GPT
    assert chosen(model=GPT(GPTConfig(vocab_size=8, block_size=4, n_layer=1, n_head=1,
                                      n_embd=4))) == ("bf16-mixed", "true")
    assert chosen(model=nn.Linear(2, 2)) == ("fp32", "default")
    assert chosen(["model.name=mypkg.nets:resnet"]) == ("fp32", "default")
    assert chosen(own_loop=True) == ("fp32", "default")
    # a preset or a value you name wins
    assert chosen(["optim.preset=gpt"], model=nn.Linear(2, 2)) == ("bf16-mixed", "true")
    assert chosen(["precision.mode=bf16-mixed", "perf.tf32=true"],
                  model=nn.Linear(2, 2)) == ("bf16-mixed", "true")
    assert chosen(["optim.preset=none"]) == ("fp32", "default")
    # on a CPU nothing changes: fp32, and TF32 does not apply
    assert resolve(Config(), CPU, 1).perf.tf32 == "default"


def test_tf32_takes_true_and_false_as_before_and_names_its_choices(tmp_path):
    (tmp_path / "c.toml").write_text("[perf]\ntf32 = true\n")
    assert load_config(tmp_path / "c.toml").perf.tf32 == "true"  # an older config.toml
    assert load_config(overrides={"perf.tf32": False}).perf.tf32 == "false"
    assert load_config(overrides=["perf.tf32=default"]).perf.tf32 == "default"
    for wrong in ("fast", 1):
        with pytest.raises(ConfigError, match=r"perf\.tf32: unknown value.*Valid: "):
            load_config(overrides={"perf.tf32": wrong})
