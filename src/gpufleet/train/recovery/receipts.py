"""The receipts of a run's recoveries, joins and restarts (the record itself is
:mod:`gpufleet.fault.receipt`): what each rank saw, put together on rank 0, the re-warm
timed over the steps after, then one line in ``recoveries.jsonl`` and in the log.

:class:`ReceiptKeeper` is a callback of the run when it can recover in process or was
restarted by its agent. Per step it keeps one clock read (the newest
:data:`STEPS_KEPT`; the median step before a loss comes from them); after an event it
times the steps until one runs at full speed, then rank 0 writes the receipt.
"""

from __future__ import annotations

import itertools
import logging
import os
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Any

from gpufleet.core.callbacks import Callback
from gpufleet.data.audit import replayed_since
from gpufleet.data.ledger import LEDGER_DIR
from gpufleet.fault.receipt import FULL_SPEED, Receipt, Transfer, append_receipt
from gpufleet.launch.netif import IFNAME_VARIABLES, interface_of, node_address

log = logging.getLogger(__name__)

STEPS_KEPT = 64  # step end times in the ring: the median step before a loss
REFERENCE_STEPS = 20  # without steps before (a restart): the median of this many after
GIVE_UP_STEPS = 500  # no full-speed step this long after: the receipt says so


class ReceiptKeeper(Callback):
    """Step end times and the receipt waiting for its re-warm (see the module docs).

    Args:
        view: the run's read-only view (its rank, run directory).
    """

    def __init__(self, view: Any) -> None:
        self.view = view
        self._ends: deque[float] = deque(maxlen=STEPS_KEPT)  # the newest steps' ends
        self.pending: Receipt | None = None
        self._went_on = self._prev = 0.0
        self._durations: list[float] = []

    # -- per step: one clock read ------------------------------------------------------
    def on_step_end(self, trainer: Any, step: int) -> None:
        self._ends.append(time.perf_counter())
        if self.pending is not None:
            self._rewarm(self._ends[-1])

    def on_fit_end(self, trainer: Any, result: Any) -> None:
        self.flush()

    def on_exception(self, trainer: Any, error: BaseException) -> None:
        self.flush()

    # -- around an event ---------------------------------------------------------------
    def begin(self) -> tuple[float | None, float | None]:
        """An event begins: an earlier receipt still waiting is written as it is, and
        the ring starts again. Returns the median step before it and the clock read at
        the end of the last step (None when not known)."""
        if self.pending is not None:
            self.pending.notes.append("the next event began before a step ran at full "
                                      "speed")
        self.flush()
        ends = list(self._ends)
        last = ends[-1] if ends else None
        steps = [b - a for a, b in itertools.pairwise(ends)]
        self._ends.clear()
        return (statistics.median(steps) if steps else None), last

    def settle(self, receipt: Receipt, went_on: float) -> None:
        """``receipt`` is complete but for its re-warm, timed from ``went_on``
        (``time.perf_counter()`` when training went on)."""
        self.pending, self._went_on, self._prev = receipt, went_on, went_on
        self._durations = []

    def _rewarm(self, now: float) -> None:
        receipt = self.pending
        assert receipt is not None
        self._durations.append(now - self._prev)
        self._prev = now
        reference = receipt.median_step_s
        if reference is None:  # a restart: the median of the first steps after it
            if len(self._durations) < REFERENCE_STEPS:
                return
            reference = receipt.median_step_s = statistics.median(self._durations)
            receipt.notes.append(f"full speed: the median of the {REFERENCE_STEPS} steps "
                                 "after it (no step before it in this process)")
        if self._durations[-1] <= FULL_SPEED * reference or \
                len(self._durations) == REFERENCE_STEPS:
            if self._found(receipt, reference):  # (the steps before were all slower)
                self._write()
                return
        if len(self._durations) >= GIVE_UP_STEPS:
            receipt.notes.append(f"no step at full speed in the {GIVE_UP_STEPS} after it")
            self._write()

    def _found(self, receipt: Receipt, reference: float) -> bool:
        """Whether a step so far ran within FULL_SPEED of ``reference``: the re-warm is
        then filled in."""
        found = next((i for i, d in enumerate(self._durations)
                      if d <= FULL_SPEED * reference), None)
        if found is None:
            return False
        receipt.rewarm_steps = found + 1
        receipt.rewarm_s = sum(self._durations[:found + 1])
        return True

    def flush(self) -> None:
        """Write the receipt waiting for its re-warm as it is (the run ended, or a new
        event began first)."""
        receipt = self.pending
        if receipt is None:
            return
        if receipt.median_step_s is None and len(self._durations) >= 3:  # a short run
            receipt.median_step_s = statistics.median(self._durations)
            self._found(receipt, receipt.median_step_s)
        self._write()

    def _write(self) -> None:
        receipt, self.pending = self.pending, None
        if receipt is None or not self.view.env.is_main:
            return
        try:
            append_receipt(self.view.run_dir, receipt)
        except OSError as e:  # the receipt is not worth the run: say so and go on
            log.error("the %s receipt could not be written to %s: %s", receipt.kind,
                      self.view.run_dir, e)
        log.info("%s", receipt.line())


# -- what each rank saw ------------------------------------------------------------------
def rank_facts(run: Any, steps_done: int, received: list[tuple[int, int, float]]) -> dict:
    """This rank's part of a receipt (small: gathered on every rank): the steps it had
    finished, its node's address and network interface, the transfers it received
    (``(peer, bytes, seconds)``)."""
    addr = node_address(run.env)
    variable = IFNAME_VARIABLES[1] if run.device.type == "cuda" else IFNAME_VARIABLES[0]
    interface = os.environ.get(variable) or (interface_of(addr) if addr else "")
    return {"steps": steps_done, "addr": addr, "interface": interface,
            "received": received}


def transfers_of(facts: list[dict], links: dict[str, Any]) -> list[Transfer]:
    """The transfers every rank received (``facts`` in new rank order), each judged
    against the link probe's figure for its pair of nodes."""
    out = []
    for rank, fact in enumerate(facts):
        for peer, nbytes, seconds in fact["received"]:
            link_mb_s, latency_ms = link_between(links, facts[peer]["addr"], fact["addr"])
            out.append(Transfer(rank, peer, nbytes, seconds, fact["interface"], link_mb_s,
                                latency_ms).judged())
    return out


def link_between(links: dict[str, Any], a: str, b: str) -> tuple[float | None, float | None]:
    """The link probe's one-way rate (MB/s) and round trip (ms) between the nodes at
    addresses ``a`` and ``b``; ``(None, None)`` without a probe of that pair. The probe
    counts both directions of its swap, so one way is half its figure."""
    for pair in (links or {}).get("pairs") or []:
        if a and b and a != b and set(pair.get("addr") or ()) == {a, b}:
            return pair["mbit_s"] / 2 / 8, pair["latency_ms"]
    return None, None


def replayed(run: Any, step: int, since_t: float) -> tuple[int | None, int]:
    """The samples read again after a restore to ``step`` that began at ``since_t``
    (wall clock), and the highest step any rank took data for, from the ledgers in the
    run directory (``(None, -1)`` without one)."""
    if not (Path(run.run_dir) / LEDGER_DIR).is_dir():
        return None, -1
    try:
        return replayed_since(run.run_dir, step, since_t)
    except (OSError, ValueError, KeyError) as e:  # a ledger being written: not the run's end
        log.debug("the ledger could not be read for the receipt: %s", e)
        return None, -1


def restart_receipt(run: Any, source: Path | None, step: int, world_from: int,
                    since_t: float, seconds: float) -> Receipt:
    """The receipt of a restart by the elastic agent that resumed from checkpoint
    ``source`` at ``step`` (read in ``seconds``, the read begun at ``since_t``; None: no
    checkpoint, the run began again at step 0): the steps finished before the restart
    after the checkpoint's (the step whose data was taken last, less the one under way),
    the samples they read."""
    samples, last = replayed(run, step, since_t)
    receipt = Receipt(
        "restart", since_t, step, world_from, run.env.world_size,
        detected_by=f"the elastic agent's restart {run.env.restart_count}",
        phases={"read": seconds}, total_s=seconds, steps_repeated=max(0, last - 1 - step),
        samples_replayed=samples)
    if source is not None:
        nbytes = source.stat().st_size if source.is_file() else sum(
            p.stat().st_size for p in source.rglob("*") if p.is_file())
        receipt.checkpoint = {"path": str(source.resolve()), "bytes": nbytes,
                              "seconds": seconds}
    else:
        receipt.phases = {}
        receipt.notes.append("no checkpoint to resume from: trained again from step 0")
    if last < 0:
        receipt.notes.append("no ledger of the steps before the restart")
    return receipt
