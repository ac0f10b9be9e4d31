"""The ``[dist]`` and ``[fault]`` sections: how the ranks of a run meet (launcher, nodes,
rendezvous, process group), and what the run does when a rank or a node fails (the
non-finite skip, the watchdog and heartbeats, preemption, in-memory snapshots and
in-process recovery)."""

from __future__ import annotations

from dataclasses import dataclass

from gpufleet.config.section import Section, opt
from gpufleet.errors import ConfigError


@dataclass
class DistConfig(Section):
    launcher: str = opt("auto", "auto (elastic agent when --nproc > 1), elastic, spawn "
                        "(torch.multiprocessing, for notebooks) or none; a run's config.toml "
                        "records slurm when srun started its ranks.",
                        choices=("auto", "elastic", "spawn", "none", "slurm"))
    nproc: int = opt(0, "Ranks on this node (0: one per visible GPU, 1 on CPU).", min=0)
    nnodes: str = opt("1", "Nodes: N, or MIN:MAX for an elastic job.")
    node_rank: int = opt(0, "This node's rank (static multi-node).", min=0)
    master_addr: str = opt("127.0.0.1", "Address of node 0 (static multi-node).")
    master_port: int = opt(0, "Port on node 0 (0: a free port; needed for multi-node).", min=0)
    rdzv_endpoint: str = opt("", "Rendezvous endpoint host:port (elastic multi-node); with "
                             "--rdzv-backend etcd every etcd member's, comma-separated.")
    rdzv_backend: str = opt("c10d", "Rendezvous backend: c10d (a store on node 0 or on "
                            "`gpufleet store`'s host), etcd (an etcd cluster: every store of "
                            "the run replicated, no node the others need), static, etcd-v2 "
                            "(torch's, on one etcd member).",
                            choices=("c10d", "etcd", "static", "etcd-v2"))
    rdzv_id: str = opt("", "Rendezvous id shared by all nodes (default: the run name).")
    max_restarts: int = opt(0, "Times the agent restarts the ranks after a failure.", min=0)
    rdzv_timeout: float = opt(600.0, "Seconds the nodes have to meet at the rendezvous before "
                              "the run fails, naming what is missing.", min=1.0)
    rdzv_last_call_s: float = opt(30.0, "Seconds an elastic rendezvous that has its minimum "
                                  "of nodes still waits for more (also after a node is lost).",
                                  min=1.0)
    rdzv_keep_alive_s: float = opt(5.0, "Seconds between an elastic node's rendezvous "
                                   "heartbeats; a node silent for three is dropped, and the "
                                   "others go on without it.", min=1.0)
    rdzv_poll_s: float = opt(0.0, "Seconds between an elastic agent's reads of the rendezvous "
                             "state (while it waits for other nodes, and its check for nodes "
                             "waiting to join). 0: 0.01 s per node of the run's largest node "
                             "count, from 0.1 to 1 s (torch's own 1 s from 100 nodes up): "
                             "about 100 store reads a second in all. Lower lets a node "
                             "started again rejoin sooner.", min=0.0)
    backend: str = opt("auto", "Process-group backend: auto (nccl on CUDA, gloo on CPU).",
                       choices=("auto", "nccl", "gloo"))
    init_method: str = opt("env://", "Process-group init: env:// or tcp://host:port.")
    timeout: float = opt(600.0, "Seconds before process-group init or a collective fails.",
                         min=1.0)

    def __post_init__(self) -> None:
        super().__post_init__()
        parts = self.nnodes.split(":")
        if not (1 <= len(parts) <= 2 and all(p.isdigit() and int(p) >= 1 for p in parts)):
            raise ConfigError(
                f"dist.nnodes = {self.nnodes!r} is not a node count. "
                "Give N (e.g. '2') or MIN:MAX (e.g. '1:4')."
            )
        if not self.init_method.startswith(("env://", "tcp://", "file://")):
            raise ConfigError(
                f"dist.init_method = {self.init_method!r} is not understood. "
                "Use env:// (default) or tcp://HOST:PORT."
            )


AUTO_SNAPSHOT_EVERY = 10  # fault.snapshot_every = -1 (auto), where it turns snapshots on


@dataclass
class FaultConfig(Section):
    skip_nonfinite: bool = opt(True, "Skip an optimizer step whose loss or gradients are "
                               "not finite on any rank (all ranks agree through one "
                               "all-reduced flag, decided on the device with a fused "
                               "optimizer: no host sync per step).")
    max_skips_in_row: int = opt(10, "Stop the run after this many skipped steps in a row, "
                                "naming the first parameter whose gradient went bad.", min=1)
    watchdog: bool = opt(True, "Watch for stalled steps; dump every rank's Python stack "
                         "and name the rank that is behind.")
    stall_factor: float = opt(10.0, "A step counts as stalled once it runs this many times "
                              "the median of the recent step times (and stall_min_s).",
                              min=1.0)
    stall_min_s: float = opt(300.0, "A step never counts as stalled before this many "
                             "seconds (the only limit until a few steps are timed).",
                             min=0.1)
    watchdog_poll_s: float = opt(1.0, "Seconds between the watchdog's checks.", min=0.05)
    preempt_check_every: int = opt(10, "On SIGTERM/SIGUSR1/SIGINT the ranks stop together "
                                   "at the next multiple of this many steps, write a "
                                   "checkpoint and exit 75 (requeue; 130 for Ctrl-C). Each "
                                   "check is a one-int CPU all-reduce (about 1 ms on a busy "
                                   "2-core host); 0: signals are not caught.", min=0)
    heartbeat_timeout_s: float = opt(15.0, "A rank whose heartbeat has not moved for this "
                                     "many seconds (or three times the longest gap its "
                                     "beats showed, when longer) stopped answering "
                                     "(stopped, dead, or its node down or cut off): it is "
                                     "named and the run ends or restarts elastically, "
                                     "instead of waiting dist.timeout.", min=0.5)
    snapshot_every: int = opt(-1, "Every N steps each rank copies its whole training state "
                              "(model and optimizer shards, scheduler, scaler, RNG, data "
                              "position) into host memory in a background thread and sends "
                              "one copy to a rank on the next node; 0: off. Host memory per "
                              "rank: its own state plus one partner's. -1 (auto): every "
                              f"{AUTO_SNAPSHOT_EVERY} steps for an elastic node range "
                              "(--nnodes MIN:MAX) on CPUs whose strategy recovers in process "
                              "(ddp, fsdp, hsdp), where their cost was measured within 2% of "
                              "a step; off otherwise (on GPUs until their cost there is "
                              "measured).", min=-1)
    recover_in_process: bool = opt(True, "With snapshots on and ranks lost mid-run (a node "
                                   "killed), the ranks left leave the broken process group, "
                                   "agree through the job's store on who is left, and go on "
                                   "in their own processes from the newest in-memory "
                                   "snapshot (replicated strategies: ddp); otherwise, or "
                                   "when that fails, they exit and the elastic agent "
                                   "restarts them from the newest checkpoint.")
    recover_window_s: float = opt(1.0, "Seconds the ranks left after a loss wait for each "
                                  "other to report before going on without those that did "
                                  "not.", min=0.05)
