"""Measure how fast a DataLoader feeds batches from your own dataset, and pick a setup.

Each measurement builds a fresh ``DataLoader`` that reads random indices (a
``RandomSampler`` with a fixed seed), as training does, so disk and cache effects look
like the real thing; sequential reads would flatter memory-mapped or file-backed data.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler

from gpufleet.data.loaders import seed_worker
from gpufleet.errors import ConfigError

log = logging.getLogger(__name__)

NEAR_BEST = 0.95  # recommend() prefers fewer workers within 5% of the best throughput


@dataclass
class LoaderResult:
    """One DataLoader setup and how fast it delivered batches.

    Attributes:
        num_workers: worker processes (0: batches are made in the main process).
        pin_memory: whether batches were copied into pinned (page-locked) memory.
        samples_per_s: samples delivered per second, after the warm-up batches.
        batches_per_s: batches delivered per second, after the warm-up batches.
        first_batch_s: seconds from creating the iterator to the first batch (worker
            start-up plus the first ``prefetch_factor`` batches' worth of work).
        rss_mb: resident memory of the main process plus its workers in MiB, or None
            without psutil. Pages shared between processes count once per process, so
            this is an upper bound.
    """

    num_workers: int
    pin_memory: bool
    samples_per_s: float
    batches_per_s: float
    first_batch_s: float
    rss_mb: float | None = None


def measure_loader(dataset: Dataset, *, batch_size: int, num_workers: int, pin_memory: bool,
                   batches: int = 50, warmup: int = 5, prefetch_factor: int | None = None,
                   persistent_workers: bool = False,
                   collate_fn: Callable[[list[Any]], Any] | None = None) -> LoaderResult:
    """Time ``batches`` batches of a fresh DataLoader over ``dataset``.

    The first ``warmup`` batches (including the first, whose start-up time is reported
    as ``first_batch_s``) are not counted in the throughput. The main process only takes
    the batches, so this is the most the loader can feed; training competes with it for
    the same cores.

    Args:
        dataset: a map-style dataset (``__getitem__`` and ``__len__``).
        batch_size: samples per batch.
        num_workers: DataLoader worker processes.
        pin_memory: pin the batches (needs CUDA).
        batches: batches to time after the warm-up.
        warmup: batches read before the clock starts (at least 1).
        prefetch_factor: batches each worker prepares ahead (torch's default when
            None; workers > 0 only).
        persistent_workers: passed to the DataLoader (workers > 0 only).
        collate_fn: how samples become a batch (torch's default when None).

    Raises:
        ConfigError: a count out of range, or ``pin_memory`` without CUDA.

    Example:
        >>> data = torch.utils.data.TensorDataset(torch.zeros(64, 4))
        >>> r = measure_loader(data, batch_size=8, num_workers=0, pin_memory=False,
        ...                    batches=4, warmup=1)
        >>> r.num_workers, r.samples_per_s > 0
        (0, True)
    """
    _check_counts(batch_size=batch_size, num_workers=num_workers, batches=batches)
    if warmup < 1:
        raise ConfigError(f"warmup = {warmup!r}: must be at least 1 (the first batch, which "
                          "includes worker start-up, is never timed).")
    if pin_memory and not torch.cuda.is_available():
        raise ConfigError("pin_memory = True needs CUDA, and none is available here (torch "
                          "would skip pinning). Measure with pin_memory=False.")
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise ConfigError(f"the dataset ({type(dataset).__name__}) has no __len__ or is an "
                          "IterableDataset; measure_loader reads random indices, so it needs "
                          "a map-style dataset with __getitem__ and __len__.")
    if len(dataset) == 0:
        raise ConfigError("the dataset is empty; there is nothing to measure.")
    total = warmup + batches
    # Random indices, as in training; num_samples past len(dataset) repeats permutations.
    sampler = RandomSampler(dataset, num_samples=total * batch_size,
                            generator=torch.Generator().manual_seed(0))
    extra: dict[str, Any] = {}
    if num_workers > 0:
        extra["persistent_workers"] = persistent_workers
        if prefetch_factor is not None:
            extra["prefetch_factor"] = prefetch_factor
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                        num_workers=num_workers, pin_memory=pin_memory,
                        collate_fn=collate_fn, worker_init_fn=seed_worker, drop_last=True,
                        **extra)
    start = time.perf_counter()
    it = iter(loader)
    next(it)
    first_batch_s = time.perf_counter() - start
    for _ in range(warmup - 1):
        next(it)
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
    elapsed = max(time.perf_counter() - start, 1e-9)
    rss_mb = _rss_mb()  # while the workers are still alive
    del it  # shuts the workers down
    return LoaderResult(num_workers=num_workers, pin_memory=pin_memory,
                        samples_per_s=batches * batch_size / elapsed,
                        batches_per_s=batches / elapsed, first_batch_s=first_batch_s,
                        rss_mb=rss_mb)


def usable_pin_options(pin_options: Sequence[bool]) -> tuple[list[bool], list[str]]:
    """The ``pin_memory`` values that can be measured here, and notes on the rest.

    Without CUDA, torch does not pin (it warns and returns ordinary memory), so
    ``True`` is dropped and a note says so.

    Example:
        >>> usable_pin_options([False])
        ([False], [])
    """
    options = list(dict.fromkeys(bool(p) for p in pin_options))  # unique, in order
    if torch.cuda.is_available() or True not in options:
        return options, []
    note = "pin_memory=true skipped: no CUDA here, so torch would not pin (it only warns)."
    return [p for p in options if not p], [note]


def tune_loader(dataset: Dataset, *, batch_size: int, workers: Sequence[int],
                pin_options: Sequence[bool], batches: int = 50, warmup: int = 5,
                prefetch_factor: int | None = None, persistent_workers: bool = False,
                collate_fn: Callable[[list[Any]], Any] | None = None) -> list[LoaderResult]:
    """Measure every combination of ``workers`` and ``pin_options`` with measure_loader.

    Combinations with ``pin_memory=True`` are skipped without CUDA (see
    :func:`usable_pin_options`; the skip is logged).

    Example:
        >>> data = torch.utils.data.TensorDataset(torch.zeros(64, 4))
        >>> rs = tune_loader(data, batch_size=8, workers=[0], pin_options=[False],
        ...                  batches=4, warmup=1)
        >>> [(r.num_workers, r.pin_memory) for r in rs]
        [(0, False)]
    """
    if not workers:
        raise ConfigError("workers is empty. Give at least one worker count, e.g. [0, 2].")
    for w in workers:
        _check_counts(num_workers=w)
    pins, notes = usable_pin_options(pin_options)
    for note in notes:
        log.warning(note)
    if not pins:
        raise ConfigError(f"pin_options = {list(pin_options)!r}: nothing left to measure. "
                          "Include False when there is no CUDA.")
    return [measure_loader(dataset, batch_size=batch_size, num_workers=w, pin_memory=p,
                           batches=batches, warmup=warmup, prefetch_factor=prefetch_factor,
                           persistent_workers=persistent_workers, collate_fn=collate_fn)
            for w in dict.fromkeys(workers) for p in pins]


def recommend(results: Sequence[LoaderResult]) -> LoaderResult:
    """The setup to use: the fastest, but with fewer workers when nearly as fast.

    Every result within 5% of the best ``samples_per_s`` counts as a tie (timings vary
    more than that between runs); among the ties the one with the fewest workers wins,
    since each worker costs memory, start-up time and a core the training could use.
    Equal worker counts go to the faster result.

    Example:
        >>> r = recommend([LoaderResult(0, False, 100.0, 10.0, 0.1),
        ...                LoaderResult(2, False, 103.0, 10.3, 0.5)])
        >>> r.num_workers
        0
    """
    if not results:
        raise ConfigError("no results to recommend from. Measure at least one setup.")
    best = max(r.samples_per_s for r in results)
    near = [r for r in results if r.samples_per_s >= NEAR_BEST * best]
    return min(near, key=lambda r: (r.num_workers, -r.samples_per_s))


def _check_counts(**counts: int) -> None:
    lowest = {"num_workers": 0}
    for name, value in counts.items():
        low = lowest.get(name, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ConfigError(f"{name} = {value!r}: must be an integer >= {low}.")


def _rss_mb() -> float | None:
    try:
        import psutil
    except ImportError:
        return None
    main = psutil.Process()
    total = 0
    for proc in [main, *main.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
        except psutil.Error:  # a worker that exited meanwhile
            pass
    return total / 2**20
