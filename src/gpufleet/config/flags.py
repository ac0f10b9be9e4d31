"""The short command-line flags for the config keys people type most."""

from __future__ import annotations

# Short flags for the options people type most; every config key also works as
# --section.key=value (see `gpufleet train --help`).
SHORTCUTS: dict[str, tuple[str, str]] = {
    "--nproc": ("dist.nproc", "ranks on this node (default: one per GPU, 1 on CPU)"),
    "--nnodes": ("dist.nnodes", "nodes: N or MIN:MAX (elastic)"),
    "--node-rank": ("dist.node_rank", "this node's rank (static multi-node)"),
    "--master-addr": ("dist.master_addr", "address of node 0 (static multi-node)"),
    "--master-port": ("dist.master_port", "port on node 0 (static multi-node)"),
    "--rdzv-endpoint": ("dist.rdzv_endpoint", "rendezvous host:port (elastic multi-node)"),
    "--rdzv-id": ("dist.rdzv_id", "rendezvous id shared by all nodes"),
    "--rdzv-backend": ("dist.rdzv_backend", "c10d (default), etcd (an etcd cluster, every "
                                            "member in --rdzv-endpoint), static or etcd-v2"),
    "--launcher": ("dist.launcher", "auto, elastic, spawn or none"),
    "--max-restarts": ("dist.max_restarts", "restarts of the ranks after a failure"),
    "--resume": ("checkpoint.resume", "'latest', 'auto' or a checkpoint / run directory path"),
    "--model": ("model.name", "'gpt' or your factory package.module:function"),
    "--data": ("data.name", "'stdlib' or your factory package.module:function"),
    "--strategy": ("parallel.strategy", "auto, single, dp, ddp, fsdp, hsdp, zero1, pipeline, "
                                        "local_sgd, model_parallel or horovod"),
    "--precision": ("precision.mode", "auto, fp32, bf16-mixed or fp16-mixed"),
    "--max-steps": ("run.max_steps", "optimizer steps (with --max-epochs: whichever ends "
                                     "first)"),
    "--max-epochs": ("run.max_epochs", "passes over the training set"),
    "--batch-size": ("data.batch_size", "samples per rank per micro-step"),
    "--lr": ("optim.lr", "peak learning rate"),
    "--grad-accum": ("optim.grad_accum", "micro-steps per optimizer step"),
    "--device": ("run.device", "auto, cpu or cuda"),
    "--seed": ("run.seed", "random seed"),
    "--name": ("run.name", "run name (run directory prefix)"),
    "--run-dir": ("run.dir", "use this run directory"),
}
