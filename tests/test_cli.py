"""The command line as users type it: help, errors, the default job."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from gpufleet.config import help_rows

SMALL_GPT = ["--max-steps", "4", "--model.n_layer", "1", "--model.n_embd", "32",
             "--model.block_size", "32", "--data.corpus_bytes", "200000", "--log.every", "2",
             "--run.eval_batches", "2"]


def test_help_explains_every_option(run_cli):
    out = run_cli("train", "--help").stdout
    for flag, _default, _text in help_rows():
        assert flag in out
    for flag in ("--nproc", "--resume", "--launcher", "--rdzv-endpoint", "--strategy"):
        assert flag in out


def test_console_script_and_version(run_cli):
    exe = shutil.which("gpufleet")
    assert exe, "the gpufleet console script is not installed"
    assert subprocess.run([exe, "--version"], capture_output=True, text=True).stdout \
        .startswith("gpufleet ")


@pytest.mark.parametrize("args, words", [
    (["--nprocs", "2"], ["--nprocs", "Did you mean '--nproc'"]),
    (["--optim.lrr=0.1"], ["optim.lrr", "Did you mean 'lr'"]),
    (["--strategy", "dp"], ["needs CUDA GPUs", "parallel.strategy=ddp"]),
    (["--max-steps", "ten"], ["run.max_steps expects an integer", "'ten'"]),
    (["--model", "no_such_pkg.nets:build"], ["cannot import module 'no_such_pkg.nets'",
                                             "PYTHONPATH"]),
    (["--data", "toyjob:make_dat"], ["has no 'make_dat'", "Did you mean 'make_data'"]),
    (["--model", "gtp"], ["model.name", "Did you mean 'gpt'", "package.module:function"]),
    (["--launcher", "none", "--nproc", "2"], ["runs one process", "--launcher elastic"]),
    (["--optim.lr"], ["--optim.lr has no value"]),
    (["--dist.init_method=udp://x"], ["dist.init_method", "env://"]),
    (["--nproc", "2", "--strategy", "single"], ["independent copies", "ddp"]),
    (["--strategy", "ddp"], ["needs a process group", "--nproc N"]),
    (["--model", "toyjob:make_model", "--model.kwargs={widht = 3}"],
     ["model.kwargs", "widht", "make_model(in_dim"]),
    (["--data.eval_fraction=1.0"], ["data.eval_fraction", "nothing to train on"]),
    (["--nnodes", "2", "--master-port", "29500"], ["multi-node", "--rdzv-id"]),
])
def test_user_errors_exit_2_with_the_fix(run_cli, args, words):
    proc = run_cli("train", *args, expect=2)
    assert "Traceback" not in proc.stderr
    for word in words:
        assert word in proc.stderr


def test_default_job_end_to_end(run_cli, tmp_path):
    proc = run_cli("train", *SMALL_GPT, env={"GPUFLEET_CACHE": str(tmp_path / "cache")})
    assert "gpufleet run summary" in proc.stdout
    (run_dir,) = (tmp_path / "runs").glob("gpt-stdlib-*")
    assert 'name = "gpt"' in (run_dir / "config.toml").read_text()
    rows = [json.loads(x) for x in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [2, 4]
    assert all(r["tokens_per_s"] > 0 for r in rows if r["kind"] == "train")
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [4]
    assert (run_dir / "checkpoints" / "step-0000004.pt").exists()
    assert list((tmp_path / "cache" / "corpus").glob("stdlib-*.bin"))


@pytest.mark.slow
def test_full_default_job_loss_falls(run_cli, tmp_path):
    """`gpufleet train` with no arguments, as the README says (about 75 s on 2 cores)."""
    run_cli("train", timeout=600, env={"GPUFLEET_CACHE": str(tmp_path / "cache")})
    (run_dir,) = (tmp_path / "runs").glob("gpt-stdlib-*")
    rows = [json.loads(x) for x in open(run_dir / "metrics.jsonl")]
    train = [r["loss"] for r in rows if r["kind"] == "train"]
    evals = [r["eval_loss"] for r in rows if r["kind"] == "eval"]
    assert rows[-1]["step"] == 600
    assert train[-1] < train[0] - 2.0  # ~4.6 -> ~1.9 seen on the CI machine
    assert evals == sorted(evals, reverse=True)
