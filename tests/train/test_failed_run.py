"""A run that fails lets go of what its callbacks hold: the process that goes on (a
notebook, a script that catches the error) keeps no sampler thread, no process-wide hook
and no open sink, and every callback hears the error through ``on_exception``."""

from __future__ import annotations

import gc
import importlib.util
import threading

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import gpufleet
from gpufleet.core.callbacks import Callback
from gpufleet.monitor.arrival import ArrivalTimer

HAS_MLFLOW = importlib.util.find_spec("mlflow") is not None


class FailsAt(torch.nn.Module):
    """A linear model whose ``fail_at``-th forward raises ``error``."""

    def __init__(self, fail_at: int, error: BaseException) -> None:
        super().__init__()
        self.layer, self.calls = torch.nn.Linear(4, 1), 0
        self.fail_at, self.error = fail_at, error

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_at:
            raise self.error
        return self.layer(x)


class Heard(Callback):
    def __init__(self, raise_too: bool = False) -> None:
        self.errors: list[BaseException] = []
        self.ended = False
        self.raise_too = raise_too

    def on_exception(self, trainer, error) -> None:
        self.errors.append(error)
        if self.raise_too:
            raise OSError("a callback that fails while the run fails")

    def on_fit_end(self, trainer, result) -> None:
        self.ended = True


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))


def _ours() -> tuple[list[str], list]:
    threads = [t.name for t in threading.enumerate() if t.name.startswith("gpufleet")]
    hooks = [cb for cb in gc.callbacks if isinstance(getattr(cb, "__self__", None),
                                                     ArrivalTimer)]
    return threads, hooks


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_a_failed_fit_leaves_no_thread_or_hook_and_callbacks_hear_it(tmp_path, error):
    before = _ours()  # (what another test in this process may have left)
    heard, failing = Heard(), Heard(raise_too=True)
    with pytest.raises(type(error)):
        gpufleet.fit(FailsAt(7, error), _data(), loss_fn=F.mse_loss,
                     callbacks=[failing, heard],
                     overrides={"run.out_dir": str(tmp_path), "run.max_steps": 20,
                                "data.batch_size": 4, "log.every": 2,
                                "monitor.system_interval_s": 0.05,
                                "checkpoint.save_final": False})
    assert heard.errors == [error] and not heard.ended  # another's failure in between
    assert failing.errors == [error]
    assert _ours() == before


def test_a_callback_failing_at_the_start_leaves_no_sampler_running(tmp_path):
    class FailsToStart(Heard):
        def on_fit_start(self, trainer) -> None:  # after the run's own sampler started
            raise RuntimeError("cannot start")

    before, cb = _ours(), FailsToStart()
    with pytest.raises(RuntimeError, match="cannot start"):
        gpufleet.fit(FailsAt(0, RuntimeError("unused")), _data(), loss_fn=F.mse_loss,
                     callbacks=[cb],
                     overrides={"run.out_dir": str(tmp_path), "run.max_steps": 5,
                                "data.batch_size": 4, "monitor.system_interval_s": 0.05})
    assert [str(e) for e in cb.errors] == ["cannot start"]
    assert _ours() == before


def test_a_failed_fleet_launch_lets_go_too(tmp_path):
    heard, before = Heard(), _ours()

    def loop(fleet):
        torch.manual_seed(0)
        net = FailsAt(3, RuntimeError("boom"))
        model, opt = fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        for x, y in fleet.setup_dataloaders(DataLoader(_data(), batch_size=8)):
            fleet.backward(F.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()

    fleet = gpufleet.Fleet(accelerator="cpu", run_dir=str(tmp_path / "run"),
                           callbacks=[heard],
                           overrides={"monitor.system_interval_s": 0.05})
    with pytest.raises(RuntimeError, match="boom"):
        fleet.launch(loop)
    assert [str(e) for e in heard.errors] == ["boom"] and not heard.ended
    assert _ours() == before
    assert (tmp_path / "run" / "crash" / "rank-0.txt").exists()


@pytest.mark.skipif(not HAS_MLFLOW, reason="mlflow is not installed (pip install mlflow)")
def test_the_mlflow_run_of_a_failed_fit_is_marked_failed(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "gpufleet-failed")
    with pytest.raises(RuntimeError, match="boom"):
        gpufleet.fit(FailsAt(7, RuntimeError("boom")), _data(), loss_fn=F.mse_loss,
                     overrides={"run.dir": str(tmp_path / "run"), "run.max_steps": 20,
                                "data.batch_size": 4, "log.every": 2, "log.progress": "off",
                                "monitor.sinks": "mlflow", "checkpoint.save_final": False})
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'run' / 'mlflow' / 'mlflow.db'}")
    [run] = client.search_runs(
        [client.get_experiment_by_name("gpufleet-failed").experiment_id])
    assert run.info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == \
        [2, 4, 6]  # what was logged before the failure stays
