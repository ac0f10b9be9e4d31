"""gpufleet sbatch: the batch script it writes."""

from __future__ import annotations

import pytest

from gpufleet.launch.sbatch import batch_script


def test_script_has_the_srun_line_requeue_signal_and_resume_auto():
    text = batch_script(["--config", "my run.toml"], nodes=2, ntasks_per_node=8,
                        gpus_per_node=8, time_limit="24:00:00", job_name="exp")
    lines = text.splitlines()
    for want in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --requeue",
                 "#SBATCH --gpus-per-node=8", "#SBATCH --time=24:00:00",
                 "#SBATCH --signal=USR1@90", "#SBATCH --open-mode=append"):
        assert want in lines
    assert ("srun gpufleet train --config 'my run.toml' --run-dir "
            '"runs/exp-${SLURM_JOB_ID}" --resume auto') in lines
    assert 'if [ "$code" -eq 75 ]; then scontrol requeue "$SLURM_JOB_ID"; fi' in lines


def test_the_users_run_dir_and_resume_are_kept():
    text = batch_script(["--run-dir", "runs/a", "--resume", "latest"], nodes=1,
                        ntasks_per_node=1)
    assert "srun gpufleet train --run-dir runs/a --resume latest\n" in text


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match="--nodes 0"):
        batch_script([], nodes=0, ntasks_per_node=1)
