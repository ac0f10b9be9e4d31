"""Files someone else sent: no code runs from a checkpoint or a config.toml unless the
user says so, and old checkpoints get a clear way forward."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import _env
from gpufleet.errors import CheckpointError
from gpufleet.train.checkpoint import format as ckpt

TINY = ["--max-steps", "2", "--model.n_layer", "1", "--model.n_head", "2",
        "--model.n_embd", "32", "--model.block_size", "16", "--data.corpus_bytes", "20000",
        "--run.eval_batches", "1", "--log.progress", "off", "--checkpoint.every", "1"]


def _gpufleet(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = _env({"GPUFLEET_CACHE": str(cwd / "cache")})
    return subprocess.run([sys.executable, "-m", "gpufleet", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A 2-step GPT run directory with checkpoints at steps 1 and 2."""
    tmp = tmp_path_factory.mktemp("sent")
    proc = _gpufleet(tmp, "train", *TINY, "--run-dir", str(tmp / "run"))
    assert proc.returncode == 0, proc.stderr
    return tmp / "run"


def _copy_run(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest)
    shutil.copytree(run.parent / "cache", dest.parent / "cache", dirs_exist_ok=True)
    return dest


def _with_checksum(path: Path) -> None:
    """What a sender who wants the file loaded sends along: a matching .sha256."""
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    ckpt.checksum_path(path).write_text(f"{digest}  {path.name}\n")


class _Trap:
    """Unpickling this runs a shell command that leaves a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _refused(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    for word in words:
        assert word in proc.stderr, proc.stderr


def test_checkpoints_hold_only_tensors_and_plain_data(tiny_run):
    state = torch.load(ckpt.list_checkpoints(tiny_run)[-1], weights_only=True)
    assert state["format"] == ckpt.FORMAT_VERSION
    assert isinstance(state["rng"][0]["numpy"][1], torch.Tensor)
    assert state["config"]["model"]["n_layer"] == 1


def test_a_booby_trapped_checkpoint_runs_no_code_in_train_serve_or_export(tiny_run,
                                                                          tmp_path):
    run = _copy_run(tiny_run, tmp_path / "run")
    marker = tmp_path / "code-ran"
    newest = ckpt.list_checkpoints(run)[-1]
    state = torch.load(newest, weights_only=True)
    state["scheduler"] = _Trap(marker)
    torch.save(state, newest)
    _with_checksum(newest)
    _refused(_gpufleet(tmp_path, "train", *TINY, "--max-steps", "3", "--resume", str(newest)),
             "holds pickled Python objects", "gpufleet checkpoint migrate")
    _refused(_gpufleet(tmp_path, "serve", str(run), "--port", "0"), "refuses")
    _refused(_gpufleet(tmp_path, "export", "triton", str(run), str(tmp_path / "repo")),
             "refuses")
    assert not marker.exists()
    with pytest.raises(CheckpointError, match=r"posix\.system"):
        ckpt.load_checkpoint(newest)
    assert not marker.exists()


def test_a_run_dir_naming_foreign_code_is_refused_without_trust_code(tiny_run, tmp_path):
    run = _copy_run(tiny_run, tmp_path / "run")
    config = run / "config.toml"
    marker = tmp_path / "code-ran"
    config.write_text(config.read_text().replace('name = "gpt"\n', 'name = "os:system"\n')
                      .replace("[model.kwargs]", f'[model.kwargs]\ncommand = "touch {marker}"'))
    assert 'name = "os:system"' in config.read_text()
    for args in (["serve", str(run), "--port", "0"],
                 ["export", "triton", str(run), str(tmp_path / "repo")]):
        _refused(_gpufleet(tmp_path, *args), "model.name = 'os:system'", "--trust-code")
    assert not marker.exists()
    # A gpufleet module is trusted only for functions it defines, not names it imports.
    config.write_text(config.read_text().replace('"os:system"', '"gpufleet.procs:os"'))
    _refused(_gpufleet(tmp_path, "serve", str(run), "--port", "0"), "--trust-code")


def test_trust_code_lets_the_users_own_factory_through(tiny_run, tmp_path):
    from gpufleet.config import load_config
    from gpufleet.job import require_trusted

    cfg = load_config(None, ["model.name=toyjob:make_model"])
    require_trusted(cfg, True, "run")  # nothing raised
    with pytest.raises(Exception, match="toyjob:make_model"):
        require_trusted(cfg, False, "run")
    require_trusted(load_config(None, []), False, "run")  # the built-in gpt needs no flag


def _as_format_1(path: Path) -> None:
    """Rewrite a checkpoint as gpufleet wrote it before format 2: numpy's key array."""
    state = torch.load(path, weights_only=True)
    for rng in state["rng"]:
        name, keys, *rest = rng["numpy"]
        rng["numpy"] = (name, keys.numpy().astype(np.uint32), *rest)
    state["format"] = 1
    torch.save(state, path)
    _with_checksum(path)


def test_an_old_checkpoint_gets_the_migration_command_then_resumes(tiny_run, tmp_path):
    run = _copy_run(tiny_run, tmp_path / "run")
    newest = ckpt.list_checkpoints(run)[-1]
    want = torch.load(newest, weights_only=True)["rng"][0]["numpy"][1]
    _as_format_1(newest)
    _refused(_gpufleet(tmp_path, "train", *TINY, "--max-steps", "3", "--resume",
                       str(newest)), f"gpufleet checkpoint migrate {newest}")
    proc = _gpufleet(tmp_path, "checkpoint", "migrate", str(newest))
    assert proc.returncode == 0 and "migrated" in proc.stdout, proc.stderr
    ckpt.verify_checkpoint(newest)  # a new checksum came with it
    assert torch.equal(torch.load(newest, weights_only=True)["rng"][0]["numpy"][1], want)
    proc = _gpufleet(tmp_path, "train", *TINY, "--max-steps", "3", "--resume", str(newest))
    assert proc.returncode == 0, proc.stderr
    assert "nothing to do" in _gpufleet(tmp_path, "checkpoint", "migrate",
                                        str(newest)).stdout


def test_migrate_refuses_a_file_that_is_not_gpufleets(tmp_path):
    path = tmp_path / "step-0000001.pt"
    torch.save({"format": 1, "thing": _Trap(tmp_path / "x").__class__}, path)
    proc = _gpufleet(tmp_path, "checkpoint", "migrate", str(path))
    _refused(proc, "not a file gpufleet wrote")


def test_a_truncated_newest_checkpoint_without_checksum_falls_back(tiny_run, tmp_path):
    run = _copy_run(tiny_run, tmp_path / "run")
    first, newest = ckpt.list_checkpoints(run)[-2:]
    ckpt.checksum_path(newest).unlink()
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    assert ckpt.find_resume_checkpoint("latest", "", "", str(run)) == first
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        ckpt.find_resume_checkpoint(str(newest), "", "")


def test_a_sharded_checkpoint_of_format_1_is_refused_then_migrated(tmp_path):
    from gpufleet.train.checkpoint import sharded

    rng = {"python": (3, tuple(range(625)), None), "torch": torch.get_rng_state(),
           "numpy": ("MT19937", np.arange(624, dtype=np.uint32), 0, 0, 0.0)}
    path = sharded.save_sharded_checkpoint(tmp_path, 1, {"model": {"w": torch.ones(2)}},
                                           {"step": 1, "rng": [rng]}, keep_last=2)
    with pytest.raises(CheckpointError, match=f"gpufleet checkpoint migrate {path}"):
        sharded.read_trainer_state(path)
    proc = _gpufleet(tmp_path, "checkpoint", "migrate", str(path))
    assert proc.returncode == 0 and "migrated" in proc.stdout, proc.stderr
    sharded.verify_sharded(path)  # the manifest names the new trainer.pt
    state = sharded.read_trainer_state(path)
    assert state["rng"][0]["numpy"][1].tolist() == list(range(624))
    assert torch.equal(sharded.read_full_model(path)["w"], torch.ones(2))


def test_a_sharded_checkpoint_whose_dcp_metadata_calls_code_is_refused(tmp_path):
    import pickle

    from gpufleet.train.checkpoint import sharded

    path = sharded.save_sharded_checkpoint(tmp_path, 1, {"model": {"w": torch.ones(2)}},
                                           {"step": 1}, keep_last=2)
    marker = tmp_path / "code-ran"
    (path / ".metadata").write_bytes(pickle.dumps(_Trap(marker)))
    lines = (path / ckpt.MANIFEST).read_text().splitlines()  # a matching manifest too
    digest = hashlib.sha256((path / ".metadata").read_bytes()).hexdigest()
    (path / ckpt.MANIFEST).write_text("\n".join(
        f"{digest}  .metadata" if line.endswith(" .metadata") else line
        for line in lines) + "\n")
    sharded.verify_sharded(path)
    for load in (sharded.read_trainer_state, sharded.read_full_model, ckpt.check_loadable,
                 ckpt.load_checkpoint):
        with pytest.raises(CheckpointError, match=r"\.metadata asks for posix\.system"):
            load(path)
    assert not marker.exists()
