"""Shared fixtures: a tiny trained GPT run, the model it serves, and running servers."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpufleet.serve.app import ServeOptions, create_app
from gpufleet.serve.model import ServedModel, TensorSpec, from_module, load_model
from gpufleet.serve.runner import BackgroundServer

TINY_GPT = ["--max-steps", "2", "--model.n_layer", "1", "--model.n_head", "2",
            "--model.n_embd", "32", "--model.block_size", "16", "--data.corpus_bytes", "20000",
            "--run.eval_batches", "1", "--log.progress", "off"]
# One numpy callable per datatype family: every input comes back as an output.
ECHO_TYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32",
              "INT64", "FP16", "FP32", "FP64", "BF16", "BYTES"]


@pytest.fixture(scope="session")
def gpt_run(tmp_path_factory) -> Path:
    """A run directory of a 1-layer GPT trained for 2 steps by `gpufleet train`."""
    tmp = tmp_path_factory.mktemp("gptrun")
    env = {**os.environ, "GPUFLEET_CACHE": str(tmp / "cache"), "OMP_NUM_THREADS": "1"}
    run_dir = tmp / "run"
    proc = subprocess.run([sys.executable, "-m", "gpufleet", "train", *TINY_GPT,
                           "--run-dir", str(run_dir)], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    return run_dir


def cache_of(run_dir: Path) -> str:
    """The GPUFLEET_CACHE the run's corpus was built in (serving reads the data again)."""
    return str(run_dir.parent / "cache")


@pytest.fixture(scope="session")
def gpt_model(gpt_run) -> ServedModel:
    old = os.environ.get("GPUFLEET_CACHE")
    os.environ["GPUFLEET_CACHE"] = cache_of(gpt_run)
    try:
        return load_model(str(gpt_run), name="gpt", device="cpu")
    finally:
        if old is None:
            del os.environ["GPUFLEET_CACHE"]
        else:
            os.environ["GPUFLEET_CACHE"] = old


def _upper(text: np.ndarray) -> np.ndarray:
    out = np.empty(text.shape, dtype=object)
    out.reshape(-1)[:] = [s.upper() for s in text.reshape(-1)]
    return out


@pytest.fixture(scope="session")
def extra_models() -> list[ServedModel]:
    """A BYTES model (upper-cases text) and an echo model with one input per datatype."""
    upper = from_module("upper", _upper, [TensorSpec("TEXT", "BYTES", (-1,))], "cpu")
    specs = [TensorSpec(f"IN_{t}", t, (2,)) for t in ECHO_TYPES]
    echo = from_module("echo", lambda *xs: tuple(xs), specs, "cpu")
    return [upper, echo]


@pytest.fixture(scope="module")
def server(gpt_model, extra_models):
    """The models served from a thread: small body limit, 1 ms queue delay."""
    app = create_app([gpt_model, *extra_models],
                     ServeOptions(max_batch_size=8, max_queue_delay_us=1000,
                                  max_body_bytes=256 * 1024))
    with BackgroundServer(app) as srv:
        yield srv
