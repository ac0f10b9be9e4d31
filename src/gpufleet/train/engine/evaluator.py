"""Evaluation as a component: mean loss and ``eval.metrics`` over the evaluation set,
summed exactly across ranks.

The evaluation sampler gives every sample to exactly one rank (no padding), so the
all-reduced sums count each sample once; so does a stream's share (each rank its chunks
of every row, the last row as far as it goes).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset

from gpufleet.core.tree import batch_size_of, to_device
from gpufleet.data.loaders import first_samples
from gpufleet.data.stream_shard import StreamShard
from gpufleet.train.evalmetrics import EvalMetric, batch_totals, final_values
from gpufleet.train.perf import to_channels_last


class Evaluator:
    """Runs the evaluation set through the model; built once per run.

    Args:
        loader: this rank's evaluation loader.
        model / strategy / precision / loss_fn: the run's (the strategy gives the module
            to evaluate and the all-reduce).
        metrics: the metrics besides the loss (:mod:`gpufleet.train.evalmetrics`).
        device / pin_memory / channels_last: where batches go and how.
        max_batches: ``run.eval_batches`` per rank (0: all).
        data_copies: ranks that read each sample (pipeline stages read the same ones).
    """

    def __init__(self, loader: Any, model: torch.nn.Module, strategy: Any, precision: Any,
                 loss_fn: Any, metrics: list[EvalMetric], *, device: torch.device,
                 pin_memory: bool, channels_last: bool, max_batches: int,
                 data_copies: int) -> None:
        self.loader, self.model, self.strategy = loader, model, strategy
        self.precision, self.loss_fn, self.metrics = precision, loss_fn, metrics
        self.device, self.pin_memory, self.channels_last = device, pin_memory, channels_last
        self.max_batches, self.data_copies = max_batches, data_copies

    def reshard(self, shard: int, shards: int) -> None:
        """Read shard ``shard`` of ``shards`` from the next evaluation on (the ranks
        regrouped at another world size): the sampler's, or a stream's share's (its
        loader's workers start at each evaluation, with the new share)."""
        share = self.loader.dataset if isinstance(self.loader.dataset, StreamShard) \
            else self.loader.sampler
        share.rank, share.world_size = shard, shards

    @torch.no_grad()
    def run(self) -> tuple[float, dict[str, float], int]:
        """``(mean loss, {metric: value}, samples)`` over every rank's share."""
        model = self.strategy.eval_model(self.model)
        model.eval()
        batched = [m for m in self.metrics if m.update is not None]
        # [Σ loss·n, Σ n, then Σ metric, Σ count for each batched metric]
        totals = torch.zeros(2 + 2 * len(batched), dtype=torch.float64, device=self.device)
        for batch, counted in self._batches():
            n = batch_size_of(batch) if counted else 0
            batch = to_device(batch, self.device, non_blocking=self.pin_memory)
            if self.channels_last:
                batch = to_channels_last(batch)
            with self.precision.autocast():
                if batched:
                    loss, output, target = self.loss_fn.with_output(model, batch)
                else:
                    loss = self.loss_fn(model, batch)
            if counted:
                totals[0] += loss.double() * n
                totals[1] += n
                for i, metric in enumerate(batched):
                    total, count = batch_totals(metric, output, target, n)
                    totals[2 + 2 * i] += total
                    totals[3 + 2 * i] += count
        self.model.train()
        self.strategy.all_reduce(totals)  # COLLECTIVE + SYNC (below): once per evaluation
        loss_total, count, *metric_totals = totals.tolist()
        # Pipeline stages saw the same samples: the ratios stay, the count is divided.
        count /= self.data_copies
        loss_total /= self.data_copies
        value = loss_total / count if count else float("nan")
        return value, final_values(self.metrics, metric_totals, value), int(count)

    def _batches(self) -> Iterator[tuple[Any, bool]]:
        """This rank's evaluation batches, each with whether its loss counts.

        With a strategy whose forward is a collective (``eval_in_lockstep``), ranks with
        fewer batches than the others repeat one, uncounted, until all ran as many. A
        stream's share has no length: it is read to its end (or ``max_batches``), and
        in lockstep held in memory first, to count it.
        """
        sized = not isinstance(self.loader.dataset, IterableDataset)
        limit = self.max_batches or (len(self.loader) if sized else None)
        batches: Any = itertools.islice(self.loader, limit)
        if not self.strategy.eval_in_lockstep:
            yield from ((batch, True) for batch in batches)
            return
        if not sized:  # a stream: count this rank's batches by reading them
            batches = list(batches)
        own = len(batches) if not sized else min(limit or 0, len(self.loader))
        most = torch.tensor([float(own)], device=self.device)
        self.strategy.all_reduce(most, op="max")  # COLLECTIVE + SYNC: once per evaluation
        filler = None
        for filler in batches:
            yield filler, True
        for _ in range(int(most.item()) - own):
            if filler is None:  # this rank's share is empty: any sample will do
                data = self.loader.dataset  # (a stream's share: the stream's first)
                source = data.source if isinstance(data, StreamShard) else data
                filler = self.loader.collate_fn(first_samples(source, 1))
            yield filler, False
