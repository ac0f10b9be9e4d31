"""The ``[parallel]`` section: how the model is spread over the ranks (a strategy preset
and the mesh degrees that refine it), and the strategy names a config may use."""

from __future__ import annotations

from dataclasses import dataclass

from gpufleet.config.section import Section, opt, table

# The strategy presets; gpufleet.parallel registers one class under each name (its
# tests check the two agree), and the config checks names without importing it.
STRATEGY_NAMES = ("single", "dp", "ddp", "pipeline", "local_sgd", "model_parallel", "horovod",
                  "fsdp", "zero1", "hsdp")


@dataclass
class DDPOptions(Section):
    """``[parallel.ddp]``: DistributedDataParallel's settings."""

    bucket_cap_mb: float = opt(25.0, "Gradient bucket size in MB.", min=0.0)
    static_graph: bool = opt(False, "The graph is the same every step (enables reuse).")
    gradient_as_bucket_view: bool = opt(False, "Gradients are views into the buckets "
                                        "(saves one copy of the gradients).")
    find_unused_parameters: bool = opt(False, "Allow parameters that get no gradient.")
    broadcast_buffers: bool = opt(True, "Broadcast buffers from rank 0 every forward.")
    comm_hook: str = opt("none", "Compress gradients on the wire (torch's DDP "
                         "communication hooks): none, fp16, bf16 (half the bytes), or "
                         "powersgd (low-rank, far fewer bytes; for slow links).",
                         choices=("none", "fp16", "bf16", "powersgd"))
    powersgd_rank: int = opt(1, "powersgd: rank of the gradient approximation (higher: "
                             "more accurate, more bytes).", min=1)
    powersgd_start_step: int = opt(10, "powersgd: plain all-reduce for the first N steps, "
                                   "then compress (at least 2).", min=2)


@dataclass
class FSDPOptions(Section):
    """``[parallel.fsdp]``: fully sharded data parallel's settings (fsdp, hsdp)."""

    reshard_after_forward: bool = opt(True, "Free gathered parameters after forward (less "
                                      "memory, one more all-gather).")
    cpu_offload: bool = opt(False, "Keep sharded parameters and gradients in CPU memory "
                            "between uses.")
    wrap: str = opt("auto", "Module class names to shard one by one (comma-separated); "
                    "auto: the model's blocks (what every:K picks from).")


@dataclass
class PipelineOptions(Section):
    """``[parallel.pipeline]``: the pipeline's schedule and stage split."""

    schedule: str = opt("1f1b", "Micro-batch schedule.", choices=("gpipe", "1f1b"))
    microbatches: int = opt(4, "Micro-batches per batch.", min=1)
    split: str = opt("", "Module names where stages 2..N begin (comma-separated); empty: "
                     "balanced by parameters (sequential models).")


@dataclass
class LocalSGDOptions(Section):
    """``[parallel.local_sgd]``: how often local SGD averages the models."""

    period: int = opt(4, "Average the models every N optimizer steps (within a node, when "
                      "hierarchical).", min=1)
    inter_node_period: int = opt(0, "Also average across nodes every N steps (0: one flat "
                                 "group).", min=0)
    warmup_steps: int = opt(0, "Plain gradient all-reduce for the first N steps.", min=0)


#: keys of the flat ``[parallel]`` section of earlier versions -> their new place
RENAMED = {
    **{k: f"ddp.{k}" for k in ("bucket_cap_mb", "static_graph", "gradient_as_bucket_view",
                               "find_unused_parameters", "broadcast_buffers",
                               "powersgd_rank", "powersgd_start_step")},
    "ddp_comm_hook": "ddp.comm_hook",
    **{f"fsdp_{k}": f"fsdp.{k}" for k in ("reshard_after_forward", "cpu_offload", "wrap")},
    **{f"pipeline_{k}": f"pipeline.{k}" for k in ("schedule", "microbatches", "split")},
    **{f"local_sgd_{k}": f"local_sgd.{k}" for k in ("period", "inter_node_period",
                                                     "warmup_steps")},
}


@dataclass
class ParallelConfig(Section):
    """``[parallel]``: the strategy preset and mesh degrees, and one table per concern
    (``[parallel.ddp]``, ``[parallel.fsdp]``, ``[parallel.pipeline]``,
    ``[parallel.local_sgd]``) for what only that concern reads."""

    strategy: str = opt("auto", "How the model is spread: auto (the preset the degrees need: "
                        "pipeline for pp > 1, else fsdp for dp_shard > 1, else ddp with several "
                        "ranks, single on one) or a registered strategy (single, dp, ddp, fsdp, "
                        "hsdp, ...); the dp_replicate/dp_shard/tp/pp degrees refine it.")
    dp_replicate: int = opt(0, "Mesh: whole replicas that all-reduce gradients (0: the "
                            "strategy chooses; hsdp: the nodes).", min=0)
    dp_shard: int = opt(0, "Mesh: ranks that shard parameters, gradients and optimizer state "
                        "(0: the strategy chooses; fsdp: all ranks; hsdp: one node's).", min=0)
    tp: int = opt(0, "Mesh: tensor parallel degree, with fsdp or hsdp (0: 1). The built-in "
                  "GPT splits its heads; other models define tp_plan(tp_mesh).", min=0)
    pp: int = opt(0, "Mesh: pipeline stages (0: the strategy chooses; pipeline: all ranks).",
                  min=0)
    device_map: dict = opt({}, "Model parallel: module name prefix -> device, e.g. "
                           "{encoder = 'cuda:0', decoder = 'cuda:1'}.")
    activation_checkpointing: str = opt("", "Recompute activations in backward: '' (off), "
                                        "module class names (e.g. 'Block'), or 'every:K'.")
    sync_batchnorm: bool = opt(False, "Convert BatchNorm layers to SyncBatchNorm "
                               "(statistics over all ranks).")
    ddp: DDPOptions = table(DDPOptions)
    fsdp: FSDPOptions = table(FSDPOptions)
    pipeline: PipelineOptions = table(PipelineOptions)
    local_sgd: LocalSGDOptions = table(LocalSGDOptions)
