"""The configuration of a run: one small dataclass per section.

Every field carries its help text (shown by ``gpufleet train --help``) and, where the
value is one of a few names, its choices. Each section checks its own fields in
``__post_init__``; :func:`gpufleet.config.check_environment` checks the combinations that
depend on the machine (``dp`` without CUDA, say).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from gpufleet.config.distributed import DistConfig, FaultConfig
from gpufleet.config.parallel import STRATEGY_NAMES, ParallelConfig
from gpufleet.config.section import AUTO, Section, opt, tables
from gpufleet.errors import ConfigError, unknown_choice


@dataclass
class RunConfig(Section):
    name: str = opt("", "Run name; the run directory is <out_dir>/<name>-<time> (empty: "
                    "from the model and data factories, e.g. resnet18-fakedata, or the "
                    "module's class for gpufleet.fit).")
    dir: str = opt("", "Run directory to use as is (default: a new one under out_dir).")
    out_dir: str = opt("runs", "Folder that holds the run directories.")
    max_steps: int = opt(-1, "Optimizer steps to train for; with run.max_epochs, whichever "
                         "ends first (-1: 600, or no step limit when run.max_epochs is set; "
                         "0: no step limit).", min=-1)
    max_epochs: int = opt(0, "Passes over the training set; with run.max_steps, whichever "
                          "ends first (0: no epoch limit).", min=0)
    seed: int = opt(1337, "Seed for python, numpy, torch (CPU and CUDA) and data workers.")
    deterministic: bool = opt(False, "Use only deterministic kernels (slower; bit-exact reruns).")
    device: str = opt("auto", "Where to train: auto (CUDA if present), cpu or cuda.",
                      choices=("auto", "cpu", "cuda"))
    preflight: bool = opt(True, "Before the ranks start, run one batch of 2 samples "
                          "through the model and loss on the CPU (forward only), so a config "
                          "mistake is one line, not a traceback per rank.")
    eval_every: int = opt(200, "Evaluate every N optimizer steps (0: only at the end).", min=0)
    eval_batches: int = opt(50, "Batches per rank in an evaluation (0: the whole set).", min=0)


# Evaluation metrics built in (gpufleet.train.evalmetrics implements them).
BUILTIN_METRICS = ("accuracy", "top5_accuracy", "perplexity")


def check_names(spec: str) -> list[str]:
    """The names in ``spec``, checked without importing anything (a config is checked
    where its functions must not run, e.g. when a run is exported)."""
    names = list(dict.fromkeys(n.strip() for n in spec.split(",") if n.strip()))
    for name in names:
        if name not in BUILTIN_METRICS and ":" not in name:
            raise ConfigError(unknown_choice(
                "eval.metrics", name, BUILTIN_METRICS,
                "Or name your own as package.module:function(output, target)."))
    return names


@dataclass
class EvalConfig(Section):
    metrics: str = opt("", "Evaluation metrics besides the loss, comma-separated: accuracy, "
                       "top5_accuracy, perplexity, or your own package.module:function"
                       "(output, target). Summed exactly across ranks.")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_names(self.metrics)


@dataclass
class ModelConfig(Section):
    name: str = opt("gpt", "'gpt' (built in) or your factory as 'package.module:function'.")
    kwargs: dict = opt({}, "Keyword arguments for your factory, e.g. {hidden = 64}.")
    loss: str = opt("", "Optional 'package.module:function' called as loss(output, target).")
    training_step: str = opt("", "Optional 'package.module:function' called as "
                             "fn(models, batch, step), returning the loss or a dict of "
                             "losses (see the training-step guide).")
    n_layer: int = opt(4, "GPT: transformer blocks.", min=1)
    n_head: int = opt(4, "GPT: attention heads per block.", min=1)
    n_embd: int = opt(128, "GPT: width of the residual stream.", min=1)
    block_size: int = opt(128, "GPT: context length in tokens.", min=2)
    dropout: float = opt(0.0, "GPT: dropout probability.", min=0.0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.name == "gpt" and self.n_embd % self.n_head:
            raise ConfigError(
                f"model.n_embd = {self.n_embd} is not divisible by model.n_head = {self.n_head}. "
                f"Pick n_embd as a multiple of n_head, e.g. n_embd = {self.n_head * 32}."
            )


@dataclass
class DataConfig(Section):
    name: str = opt("stdlib", "'stdlib' (bytes of Python's standard library sources) or your "
                    "factory 'package.module:function' returning a Dataset or (train, eval).")
    kwargs: dict = opt({}, "Keyword arguments for your data factory.")
    batch_size: int = opt(16, "Samples per rank per micro-step.", min=1)
    num_workers: int = opt(-1, "DataLoader workers per rank (-1: picked from the machine).",
                           min=-1)
    pin_memory: bool = opt(True, "Pin host memory for faster copies (only used with CUDA).")
    prefetch_factor: int = opt(2, "Batches each worker loads ahead (with num_workers > 0).",
                               min=1)
    device_prefetch: bool = opt(True, "CUDA: copy the next batch to the GPU on a side "
                                "stream while the current step computes (false: copy on "
                                "the compute stream when the batch is taken).")
    shuffle: bool = opt(True, "Shuffle the training set every epoch.")
    batching: str = opt("fixed", "fixed (batch_size samples per batch) or tokens (pack "
                        "variable-length samples under token_budget; the data set needs "
                        "`lengths`).", choices=("fixed", "tokens"))
    token_budget: int = opt(0, "tokens batching: longest sample x samples <= this.", min=0)
    max_len: int = opt(0, "tokens batching: longer samples are left out and counted "
                       "(0: no limit beyond token_budget).", min=0)
    max_samples: int = opt(0, "tokens batching: cap on samples per batch (0: none).", min=0)
    sort_size: int = opt(100, "tokens batching: batches per rank sorted together by length.",
                         min=1)
    eval_fraction: float = opt(0.05, "stdlib corpus: share held out for evaluation.", min=0.0)
    corpus_bytes: int = opt(4_000_000, "stdlib corpus: size cap in bytes.", min=1024)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.eval_fraction >= 1.0:
            raise ConfigError(f"data.eval_fraction = {self.eval_fraction} leaves nothing to "
                              "train on. Use a share below 1, e.g. 0.05 (0: no evaluation).")


#: Recipes a run can start from (gpufleet.train.recipe fills them in): "none" is the
#: optimizer as torch builds it and nothing else; "gpt" the built-in GPT's nanoGPT-style
#: pre-training; "transformers" the Transformers Trainer's fine-tuning defaults.
PRESETS = ("none", "gpt", "transformers")


@dataclass
class OptimConfig(Section):
    preset: str = opt("auto", "Recipe the settings left at -1/auto come from: auto (gpt for "
                      "the built-in GPT, transformers for a Transformers model, none for any "
                      "other model), none (the optimizer's own defaults: no clipping, "
                      "warm-up, schedule, momentum or weight decay), gpt, transformers.",
                      choices=("auto", *PRESETS))
    name: str = opt("adamw", "Optimizer.", choices=("adamw", "sgd"))
    factory: str = opt("", "Your optimizer: 'package.module:function' called as fn(params) "
                       "with the (wrapped) model's parameters; replaces optim.name and its "
                       "settings.")
    lr: float = opt(AUTO, "Peak learning rate (-1: the preset's: none 1e-3, gpt 3e-3, "
                    "transformers 5e-5).", min=AUTO)
    weight_decay: float = opt(AUTO, "Decoupled weight decay (-1: the preset's: none 0 on "
                              "every parameter; gpt 0.1 and transformers 0, on matrices "
                              "only).", min=AUTO)
    beta1: float = opt(0.9, "AdamW beta1.", min=0.0)
    beta2: float = opt(AUTO, "AdamW beta2 (-1: 0.95 for gpt, else 0.999).", min=AUTO)
    momentum: float = opt(AUTO, "SGD momentum (-1: 0.9 for gpt, else 0).", min=AUTO)
    grad_accum: int = opt(1, "Micro-steps per optimizer step (gradient sync only on the last).",
                          min=1)
    clip_value: float = opt(0.0, "Clip each gradient element to [-v, v] (0: off).", min=0.0)
    clip_norm: float = opt(AUTO, "Clip the global gradient norm to this value (0: off; -1: "
                           "the preset's: 1.0 for gpt and transformers, off for none).",
                           min=AUTO)
    warmup_steps: int = opt(-1, "Linear learning-rate warm-up steps (-1: 20 for gpt, else "
                            "0).", min=-1)
    decay: str = opt("auto", "Learning-rate decay after warm-up (auto: cosine for gpt, "
                     "linear for transformers, constant for none).",
                     choices=("auto", "cosine", "linear", "constant"))
    min_lr_ratio: float = opt(AUTO, "Final learning rate as a share of lr (-1: 0.1 for gpt, "
                              "else 0).", min=AUTO)
    recipe: str = opt("", "Written by the run: its whole effective recipe in one line "
                      "(read back, it is ignored).")

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("lr", "weight_decay", "beta2", "momentum", "clip_norm", "min_lr_ratio"):
            value = getattr(self, key)
            if value < 0 and value != AUTO:
                raise ConfigError(f"optim.{key} = {value!r} is negative. Give 0 or more, or "
                                  f"-1 for the model's default (its preset's value).")


@dataclass
class SchedConfig(Section):
    factory: str = opt("", "Your learning-rate scheduler: 'package.module:function' called "
                       "as fn(optimizer); replaces optim's warm-up and decay.")
    interval: str = opt("step", "When your scheduler steps: every optimizer step, or at "
                        "the end of every epoch.", choices=("step", "epoch"))


@dataclass
class PrecisionConfig(Section):
    mode: str = opt("auto", "Numeric precision: auto (the built-in GPT's recipe: bf16-mixed "
                    "on a GPU with native bf16; your model: fp32, as your script computes), "
                    "fp32, bf16-mixed, fp16-mixed.",
                    choices=("auto", "fp32", "bf16-mixed", "fp16-mixed"))
    init_scale: float = opt(65536.0, "fp16-mixed: initial loss scale.", min=1.0)
    growth_interval: int = opt(2000, "fp16-mixed: steps between loss-scale increases.", min=1)


@dataclass
class PerfConfig(Section):
    compile: bool = opt(False, "torch.compile the model (in place, so checkpoint names stay "
                        "the same).")
    compile_mode: str = opt("default", "torch.compile mode; reduce-overhead replays CUDA "
                            "graphs (best for small models whose steps are launch-bound).",
                            choices=("default", "reduce-overhead", "max-autotune"))
    compile_scope: str = opt("auto", "What perf.compile compiles: auto (blocks when the "
                             "strategy shards or splits the model by blocks: fsdp, hsdp, tp, "
                             "pipeline; else the whole model, which fuses more), blocks (each "
                             "of the model's repeated blocks on its own, as FSDP shards them: "
                             "small graphs that compile once and are reused; the whole model "
                             "when it repeats none) or model (one graph for the whole model).",
                             choices=("auto", "blocks", "model"))
    tf32: str = opt("auto", "TF32 tensor cores for fp32 matmuls and convolutions on CUDA "
                    "(Ampere and newer; about 8x fp32 speed, 10-bit mantissa): true, false, "
                    "default (left as torch or your script set it: torch's own default "
                    "runs matmuls in full fp32, convolutions in TF32), or auto (true for the "
                    "built-in GPT's recipe, else default).",
                    choices=("auto", "default", "true", "false"))
    cudnn_benchmark: bool = opt(False, "cuDNN times its convolution algorithms and keeps the "
                                "fastest (for conv nets with fixed input shapes).")
    channels_last: bool = opt(False, "NHWC memory format for conv nets: model weights and "
                              "4-D float inputs (faster convolutions on tensor cores).")


@dataclass
class CheckpointConfig(Section):
    every: int = opt(0, "Save every N optimizer steps (0: only at the end).", min=0)
    keep_last: int = opt(3, "Checkpoints to keep (older ones are deleted).", min=1)
    keep_best: int = opt(0, "Also keep the best K checkpoints by checkpoint.monitor (0: off).",
                         min=0)
    monitor: str = opt("eval_loss", "What keep_best ranks by: eval_loss, eval_<metric>, or "
                       "a logged training value such as loss.")
    mode: str = opt("min", "Whether a lower (min) or higher (max) monitor value is better.",
                    choices=("min", "max"))
    every_epochs: int = opt(0, "Also save at the end of every N epochs (0: off).", min=0)
    save_final: bool = opt(True, "Save when training ends.")
    async_save: bool = opt(False, "Write checkpoints in a background thread: training "
                           "only waits for a copy of the state in host memory (sharded "
                           "strategies: every rank its shards; a second save waits for "
                           "the first).")
    resume: str = opt("", "'latest' (newest checkpoint of this run name), 'auto' (latest if "
                      "any, else a fresh start: for requeued jobs) or a path.")


@dataclass
class EarlyStopConfig(Section):
    metric: str = opt("", "Stop when this stops improving: eval_loss, eval_<metric>, or a "
                      "logged training value such as loss (empty: off). The run ends with "
                      "a checkpoint.")
    mode: str = opt("min", "Whether lower (min) or higher (max) is better.",
                    choices=("min", "max"))
    patience: int = opt(3, "Checks (evaluations, or log intervals for a training value) "
                        "without an improvement before stopping.", min=1)
    min_delta: float = opt(0.0, "Smallest change that counts as an improvement.", min=0.0)


@dataclass
class MonitorConfig(Section):
    phases: bool = opt(True, "Time each step's phases on every rank (data, forward, "
                       "backward, optimizer, other); on a GPU also one step in each log interval "
                       "on the stream (CUDA events, read at the log line).")
    system_interval_s: float = opt(1.0, "Seconds between system samples (GPUs through NVML, "
                                   "host through psutil) to system.jsonl; 0: off.", min=0.0)
    diagnose: bool = opt(True, "Say in plain words what limits the run, with numbers and "
                         "the fix.")
    sync_probe_steps: int = opt(5, "Steps run under torch's CUDA sync-debug mode to find "
                                "host-device syncs in your step (CUDA only; 0: off).", min=0)
    link_probe: bool = opt(True, "On several nodes, time how fast each node reaches the "
                           "others at the start (a few MB; well under a second on a "
                           "healthy link), so the diagnosis names the node behind a slow "
                           "link.")
    report: bool = opt(True, "Write report.html (self-contained) into the run directory.")
    sinks: str = opt("", "Extra metric sinks, comma-separated: tensorboard, mlflow, wandb.")
    peak_tflops: float = opt(0.0, "Peak TFLOPS of one device for MFU (0: from the table of "
                             "known GPUs for the run's precision).", min=0.0)


@dataclass
class ProfileConfig(Section):
    steps: str = opt("", "Trace these optimizer steps with the torch profiler, e.g. '10-12' "
                     "(one trace per rank in <run_dir>/profile; empty: off).")


@dataclass
class LogConfig(Section):
    every: int = opt(10, "Log (and reduce metrics across ranks) every N steps.", min=1)
    progress: str = opt("auto", "Progress display: auto (bar on a terminal, lines otherwise), "
                        "bar, lines or off.", choices=("auto", "bar", "lines", "off"))
    level: str = opt("INFO", "Log level.", choices=("DEBUG", "INFO", "WARNING", "ERROR"))


@dataclass
class Config:
    """Everything a run needs. Build with :func:`gpufleet.config.load_config`.

    Example:
        >>> cfg = Config()
        >>> cfg.optim.grad_accum
        1
    """

    run: RunConfig = field(default_factory=RunConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sched: SchedConfig = field(default_factory=SchedConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    perf: PerfConfig = field(default_factory=PerfConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    early_stop: EarlyStopConfig = field(default_factory=EarlyStopConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        names = ("auto", *STRATEGY_NAMES)
        if self.parallel.strategy not in names:
            raise ConfigError(unknown_choice("parallel.strategy", self.parallel.strategy, names))


SECTIONS: dict[str, type] = {
    f.name: f.default_factory for f in dataclasses.fields(Config)  # type: ignore[misc]
}
SECTION_NAMES: dict[type, str] = {cls: name for name, cls in SECTIONS.items()}
for _name, _cls in SECTIONS.items():
    _cls._section_name = _name  # what a section's errors call it
    for _table, _sub in tables(_cls).items():
        _sub._section_name = f"{_name}.{_table}"
