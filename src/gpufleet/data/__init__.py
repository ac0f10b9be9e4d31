"""Data for training: the built-in stdlib corpus, token windows, sampling and loading."""

from gpufleet.data.corpus import build_stdlib_corpus
from gpufleet.data.loader import default_num_workers, seed_worker
from gpufleet.data.sampler import ResumableDistributedSampler
from gpufleet.data.tokens import TokenWindowDataset, split_train_eval

__all__ = [
    "ResumableDistributedSampler",
    "TokenWindowDataset",
    "build_stdlib_corpus",
    "default_num_workers",
    "seed_worker",
    "split_train_eval",
]
