"""Data for training: the built-in stdlib corpus, token windows, memory-mapped JSONL,
resumable sampling (fixed-size and token-budget batches) and loading."""

from gpufleet.core.machine import default_num_workers
from gpufleet.data.bucket import BucketBatchSampler, pad_collate, padded_waste
from gpufleet.data.corpus import build_stdlib_corpus
from gpufleet.data.jsonl import JsonlDataset, JsonlError
from gpufleet.data.loaders import seed_worker
from gpufleet.data.sampler import ResumableDistributedSampler
from gpufleet.data.tokens import TokenWindowDataset, split_train_eval

__all__ = [
    "BucketBatchSampler",
    "JsonlDataset",
    "JsonlError",
    "ResumableDistributedSampler",
    "TokenWindowDataset",
    "build_stdlib_corpus",
    "default_num_workers",
    "pad_collate",
    "padded_waste",
    "seed_worker",
    "split_train_eval",
]
