"""Language-model training windows read straight from a memory-mapped token file.

The file is a flat array of token ids (``uint8`` for bytes, ``uint16`` for most BPE
vocabularies). Nothing is loaded up front: each process maps the file on first use, so
many DataLoader workers share the operating system's page cache instead of holding copies.
"""

from __future__ import annotations

import operator
import os
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import Dataset


def _count_tokens(path: Path, dtype: npt.DTypeLike) -> int:
    itemsize = np.dtype(dtype).itemsize
    size = os.path.getsize(path)
    if size % itemsize:
        raise ValueError(f"{path} has {size} bytes, not a multiple of {itemsize} (the size "
                         f"of one {np.dtype(dtype).name} token). Pass the dtype the file "
                         "was written with.")
    return size // itemsize


class TokenWindowDataset(Dataset):
    """Windows of ``block_size + 1`` tokens over ``[start, end)`` of a token file.

    Window ``i`` starts at token ``start + i * block_size``; consecutive windows share one
    token (the last target of one is the first input of the next), so every token in the
    range is predicted once. Item ``i`` is ``(x, y)``: two ``int64`` tensors of length
    ``block_size`` with ``y[t] == x[t + 1]`` (the next token). A partial window at the end
    is left out.

    Attributes:
        n_tokens: tokens in ``[start, end)``.

    Example:
        >>> import numpy as np, tempfile
        >>> path = tempfile.mkdtemp() + "/tokens.bin"
        >>> np.arange(10, dtype=np.uint8).tofile(path)
        >>> ds = TokenWindowDataset(path, block_size=4)
        >>> len(ds), ds[1]
        (2, (tensor([4, 5, 6, 7]), tensor([5, 6, 7, 8])))
    """

    def __init__(self, path: str | Path, block_size: int, dtype: npt.DTypeLike = np.uint8,
                 start: int = 0, end: int | None = None) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size = {block_size!r}: must be a positive integer.")
        self.path = Path(path)
        self.block_size = block_size
        self.dtype = np.dtype(dtype)
        total = _count_tokens(self.path, self.dtype)
        end = total if end is None else end
        if not 0 <= start <= end <= total:
            raise ValueError(f"token range [{start}, {end}) does not fit {self.path}, which "
                             f"holds {total} tokens. Use 0 <= start <= end <= {total}.")
        self.start, self.end = start, end
        self.n_tokens = end - start
        self._tokens: np.memmap | None = None  # opened lazily, once per process

    def __len__(self) -> int:
        return max(0, (self.n_tokens - 1) // self.block_size)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = operator.index(i)
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"window {i} out of range for {n} windows")
        i %= n
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        lo = self.start + i * self.block_size
        chunk = self._tokens[lo:lo + self.block_size + 1]
        # astype copies out of the map, so the tensors do not keep it alive.
        x = torch.from_numpy(chunk[:-1].astype(np.int64))
        y = torch.from_numpy(chunk[1:].astype(np.int64))
        return x, y

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader workers (and spawn) get the path, not the map: each re-opens it.
        state = self.__dict__.copy()
        state["_tokens"] = None
        return state

    def __repr__(self) -> str:
        return (f"TokenWindowDataset({str(self.path)!r}, block_size={self.block_size}, "
                f"tokens=[{self.start}, {self.end}), windows={len(self)})")


def split_train_eval(path: str | Path, block_size: int, eval_fraction: float,
                     dtype: npt.DTypeLike = np.uint8,
                     ) -> tuple[TokenWindowDataset, TokenWindowDataset | None]:
    """Split a token file into a training set and the held-out last ``eval_fraction``.

    Args:
        path: flat token file.
        block_size: tokens per training window.
        eval_fraction: share of the tokens, taken from the end, held out for evaluation;
            ``0`` gives no evaluation set.
        dtype: token dtype the file was written with.

    Returns:
        ``(train, eval)``; ``eval`` is ``None`` when ``eval_fraction == 0``.

    Raises:
        ValueError: ``eval_fraction`` outside ``[0, 1)``, or a split too small to hold one
            window of ``block_size + 1`` tokens.

    Example:
        >>> import numpy as np, tempfile
        >>> path = tempfile.mkdtemp() + "/tokens.bin"
        >>> np.zeros(1000, dtype=np.uint8).tofile(path)
        >>> train, val = split_train_eval(path, block_size=16, eval_fraction=0.1)
        >>> train.n_tokens, val.n_tokens
        (900, 100)
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction = {eval_fraction!r}: must be in [0, 1) "
                         "(e.g. 0.05 holds out the last 5% of the tokens).")
    total = _count_tokens(Path(path), dtype)
    n_eval = int(total * eval_fraction)
    split = total - n_eval
    need = block_size + 1
    if split < need:
        raise ValueError(f"the training split has {split} of {total} tokens, fewer than "
                         f"block_size + 1 = {need}. Use more data or a smaller block_size.")
    if eval_fraction > 0 and n_eval < need:
        raise ValueError(f"the evaluation split has {n_eval} of {total} tokens "
                         f"(eval_fraction = {eval_fraction}), fewer than block_size + 1 = "
                         f"{need}. Raise eval_fraction, use more data, lower block_size, or "
                         "set eval_fraction = 0 for no evaluation.")
    train = TokenWindowDataset(path, block_size, dtype, start=0, end=split)
    if eval_fraction == 0:
        return train, None
    return train, TokenWindowDataset(path, block_size, dtype, start=split, end=total)
