"""Copy the next batch to the GPU while the current one is being computed on."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from gpufleet.core.tree import each_tensor, to_device

_END = object()  # marks an exhausted loader in the one-batch look-ahead


class DevicePrefetcher:
    """Wrap a loader so that each batch reaches ``device`` while the previous one trains.

    Why: a plain ``batch.to("cuda")`` in the loop copies on the compute stream, so the GPU
    sits idle during every host-to-device copy. On CUDA this wrapper keeps one batch in
    flight: as soon as the consumer takes batch ``i``, the copy of batch ``i + 1`` is
    issued on a side CUDA stream with ``non_blocking=True`` and overlaps with the compute
    on batch ``i``. The copy is only truly asynchronous from pinned host memory, so use a
    ``DataLoader(..., pin_memory=True)``; from pageable memory it still works, just without
    the overlap.

    When the consumer takes a batch, the current stream first waits for the side stream
    (``current_stream().wait_stream(side)``, a GPU-side wait, no host sync), so kernels
    never read a half-copied tensor. Every tensor of the batch is then marked with
    ``tensor.record_stream(current_stream)``: the memory was allocated on the side stream,
    and without the mark the caching allocator would consider it free as soon as the
    Python tensor dies, even though kernels queued on the current stream may still read
    it; the mark makes the allocator wait for that stream's pending work first.

    On any other device (CPU, MPS, ...) it is a transparent pass-through: the loader's
    batches come out unchanged, with no copies. Batches may be tensors or nested
    tuples, lists and dicts of tensors; other leaves are passed through.

    Args:
        loader: an iterable of batches, usually a ``torch.utils.data.DataLoader``.
        device: where the batches should end up.

    Example:
        >>> from torch.utils.data import DataLoader
        >>> loader = DataLoader(torch.arange(6), batch_size=2)
        >>> [b.tolist() for b in DevicePrefetcher(loader, torch.device("cpu"))]
        [[0, 1], [2, 3], [4, 5]]
    """

    def __init__(self, loader: Iterable[Any], device: torch.device | str) -> None:
        self.loader = loader
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._it: Iterator[Any] | None = None
        self._stream: torch.cuda.Stream | None = None
        self._next: Any = _END

    def __len__(self) -> int:
        if not hasattr(self.loader, "__len__"):
            raise TypeError(f"the wrapped {type(self.loader).__name__} has no length, so "
                            "neither has this DevicePrefetcher.")
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> DevicePrefetcher:
        """Start a new pass over the loader (and, on CUDA, issue the first copy)."""
        self._it = iter(self.loader)
        if self._cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=self.device)
            self._preload()
        return self

    def __next__(self) -> Any:
        if self._it is None:
            iter(self)
        assert self._it is not None
        if not self._cuda:
            return next(self._it)
        batch = self._next
        if batch is _END:
            raise StopIteration
        assert self._stream is not None
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self._stream)  # GPU-side wait for the copy; no host sync
        _record_stream(batch, current)
        self._preload()  # the next copy overlaps with the consumer's work on `batch`
        return batch

    def _preload(self) -> None:
        assert self._it is not None and self._stream is not None
        try:
            batch = next(self._it)
        except StopIteration:
            self._next = _END
            return
        with torch.cuda.stream(self._stream):
            self._next = to_device(batch, self.device, non_blocking=True)


def _record_stream(batch: Any, stream: torch.cuda.Stream) -> None:
    """Call ``record_stream(stream)`` on every CUDA tensor in a nested batch."""
    for t in each_tensor(batch):
        if t.is_cuda:
            t.record_stream(stream)
