"""The run's own monitors and callbacks, for gpufleet's loop and for :class:`~gpufleet.Fleet`
alike: the phase and arrival timers, the stall watchdog, the preemption watch, and the
callbacks that write and diagnose what they measure."""

from __future__ import annotations

import logging
import signal
from pathlib import Path

import torch

from gpufleet.config import Config, config_to_dict
from gpufleet.core.callbacks import Callback
from gpufleet.fault.preempt import SIGNALS, PreemptionWatch
from gpufleet.fault.watchdog import Watchdog
from gpufleet.launch import DistEnv, is_initialized, job_store
from gpufleet.launch.netif import node_address
from gpufleet.monitor.advisor import Advisor, run_facts
from gpufleet.monitor.arrival import ArrivalTimer
from gpufleet.monitor.jsonl import MetricsFile
from gpufleet.monitor.links import probe_node_links
from gpufleet.monitor.opclock import OpClock
from gpufleet.monitor.phases import PhaseTimer
from gpufleet.monitor.profile import ProfilerCallback
from gpufleet.monitor.sinks import build_sinks
from gpufleet.monitor.syncprobe import SyncProbe
from gpufleet.monitor.system import SystemSampler
from gpufleet.train.checkpoint.keeping import EarlyStopping
from gpufleet.train.engine.resilience import snapshots_of
from gpufleet.train.engine.run import Run
from gpufleet.train.engine.state import Monitors
from gpufleet.train.recovery.receipts import ReceiptKeeper

log = logging.getLogger(__name__)


def build_monitors(cfg: Config, env: DistEnv, device: torch.device, run_dir: Path,
                   signals: tuple[signal.Signals, ...] = SIGNALS) -> Monitors:
    """The phase timer, the stall watchdog and the preemption watch (catching
    ``signals``), as configured."""
    fault = cfg.fault
    return Monitors(
        phase_timer=PhaseTimer(device, cfg.log.every) if cfg.monitor.phases else None,
        arrival=ArrivalTimer() if cfg.monitor.phases else None,
        # CPU only: on CUDA an operator's host time is its launch, not its work.
        op_clock=OpClock() if cfg.monitor.phases and device.type == "cpu" else None,
        watchdog=(Watchdog(fault, run_dir, env.rank, env.world_size, job_store(),
                           env.restart_count, node=(env.node_rank, node_address(env)))
                  if fault.watchdog else None),
        preemption=(PreemptionWatch(fault.preempt_check_every, is_initialized(), signals)
                    if fault.preempt_check_every else None))


def own_callbacks(run: Run) -> list[Callback]:
    """The run's own callbacks, in the order they hear each hook: phase timing first
    (its clock reads bracket the others' work least), the file sinks before the advisor
    that reads what they were given. Fills in the monitors built here."""
    cfg, env, mon, monitors = run.cfg, run.env, run.cfg.monitor, run.monitors
    timer = monitors.phase_timer
    own: list[Callback] = [cb for cb in (timer, timer and timer.stream, monitors.arrival,
                                          monitors.op_clock, monitors.watchdog) if cb]
    # Before the sinks: the snapshots add to the metrics they write. A run keeps them
    # where it has the checkpointer's state functions to capture its state with.
    monitors.snapshots = snapshots_of(run) if cfg.fault.snapshot_every else None
    if monitors.snapshots is not None:
        own.append(monitors.snapshots)
    elif cfg.fault.snapshot_every and env.is_main:
        log.warning("fault.snapshot_every = %d: this loop takes no snapshots, since it "
                    "registered no state to take them of (fleet.register_state(state) "
                    "before the loop, see docs/own-loop.md)", cfg.fault.snapshot_every)
    if cfg.early_stop.metric:
        own.append(EarlyStopping(cfg.early_stop))
    if cfg.profile.steps:  # every rank writes its own trace
        own.append(ProfilerCallback(cfg.profile.steps, run.run_dir, env.rank,
                                    env.world_size))
    if env.local_rank == 0 and mon.system_interval_s > 0:  # one sampler per node
        monitors.system_sampler = SystemSampler(run.run_dir, interval_s=mon.system_interval_s)
        own.append(monitors.system_sampler)
    # COLLECTIVE on several nodes: every rank runs it or none (the config is rank 0's,
    # from _run_dir). How fast each node reaches the others, for the advisor.
    links = probe_node_links(env, mon.link_probe and mon.diagnose and mon.phases,
                             run.device)
    monitors.links = links  # (the receipts judge state transfers against it)
    recovers = cfg.fault.snapshot_every and cfg.fault.recover_in_process
    if recovers or env.restart_count > 0:
        monitors.receipts = ReceiptKeeper(run.view)  # one clock read a step
        own.append(monitors.receipts)
    if not env.is_main:
        if monitors.snapshots is not None:
            # Rank 0's node lost (stores on etcd): this rank may go on as rank 0, and
            # then writes the metrics (the sinks and the advisor stay with the first).
            own.append(MetricsFile(run.run_dir / "metrics.jsonl", main_only=True))
        return own
    metrics = MetricsFile(run.run_dir / "metrics.jsonl")
    own.append(metrics)
    own.extend(build_sinks(mon.sinks, run.run_dir, config_to_dict(cfg)))
    if mon.diagnose and mon.phases:
        monitors.advisor = Advisor(run_facts(run.view, links), run.run_dir, metrics,
                                   monitors.system_sampler, phase_timer=monitors.phase_timer)
        own.append(monitors.advisor)
        if mon.sync_probe_steps and run.device.type == "cuda":
            own.append(SyncProbe(monitors.advisor, mon.sync_probe_steps))
    return own
