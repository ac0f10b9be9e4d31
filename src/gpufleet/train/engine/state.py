"""What a run changes as it goes (:class:`TrainState`) and what watches it
(:class:`Monitors`): parts of the :class:`~gpufleet.train.engine.run.Run` that
gpufleet's loop and :class:`~gpufleet.Fleet` hold alike."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpufleet.fault.preempt import PreemptionWatch
    from gpufleet.fault.snapshot import SnapshotCallback
    from gpufleet.fault.watchdog import Watchdog
    from gpufleet.monitor.advisor import Advisor
    from gpufleet.monitor.arrival import ArrivalTimer
    from gpufleet.monitor.opclock import OpClock
    from gpufleet.monitor.phases import PhaseTimer
    from gpufleet.monitor.system import SystemSampler
    from gpufleet.train.recovery.receipts import ReceiptKeeper


@dataclass
class TrainState:
    """What training changes as it goes (the data position lives in the stream).

    Attributes:
        step: optimizer steps done (a resumed run counts the earlier ones).
        saved_step: the step of the newest checkpoint written or resumed from (-1: none).
        stop_reason: why this rank asked the run to stop ("" while it has not).
        flops_per_step: counted on the second step (None before; 0 when not counted).
        train_time_s / samples / tokens: training time and the global samples and tokens
            read in it this session (evaluation and checkpoints excluded).
    """

    step: int = 0
    saved_step: int = -1
    stop_reason: str = ""  # why this rank asked the run to stop (RunView.request_stop)
    flops_per_step: int | None = None
    train_time_s: float = 0.0
    samples: float = 0.0
    tokens: float = 0.0


@dataclass
class Monitors:
    """What watches the run. Each is None when the config turns it off or when it does
    not run on this rank (one system sampler per node, the advisor on rank 0)."""

    phase_timer: PhaseTimer | None = None
    arrival: ArrivalTimer | None = None  # each rank's wait for the others, GC pauses
    #: on a CPU, a sampled step's time inside operators (the accounting's host overhead)
    op_clock: OpClock | None = None
    watchdog: Watchdog | None = None
    preemption: PreemptionWatch | None = None
    system_sampler: SystemSampler | None = None
    advisor: Advisor | None = None
    snapshots: SnapshotCallback | None = None  # fault.snapshot_every's in-memory copies
    #: step end times and the receipt of a recovery, join or restart waiting for its
    #: re-warm (where the run can recover in process or was restarted)
    receipts: ReceiptKeeper | None = None
    #: the link probe's result at the start (gpufleet.monitor.links; {} without one)
    links: dict[str, Any] = field(default_factory=dict)
