import importlib.util
import sys
import time

import pytest
import torch
import torch.nn.functional as F

import gpufleet
import toyjob
from gpufleet.config import Config, config_to_dict
from gpufleet.core.callbacks import Callback
from gpufleet.errors import ConfigError
from gpufleet.monitor import sinks
from gpufleet.monitor.sinks import build_sinks
from gpufleet.train.checkpoint.rundir import named

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
HAS_MLFLOW = importlib.util.find_spec("mlflow") is not None


def test_no_sinks_by_default(tmp_path):
    assert build_sinks("", tmp_path, {}) == [] and build_sinks(" , ", tmp_path, {}) == []


def test_an_unknown_sink_names_the_choices(tmp_path):
    with pytest.raises(ConfigError, match=r"monitor.sinks: unknown value 'wandbb'. Did you "
                                          r"mean 'wandb'\? Valid: wandb, .*tensorboard"):
        build_sinks("tensorboard,wandbb", tmp_path, {})


@pytest.mark.parametrize("name, module, package", [
    ("mlflow", "mlflow", "mlflow"), ("wandb", "wandb", "wandb"),
    ("tensorboard", "torch.utils.tensorboard", "tensorboard")])
def test_a_missing_package_is_named_before_training(tmp_path, monkeypatch, name, module,
                                                    package):
    # None in sys.modules makes `import` fail as it does when the package is not installed.
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ConfigError, match=f"the {name} sink needs the '{package}' package, "
                                          f"which is not installed here.*Run `pip install "
                                          f"{package}`, or leave {name} out of monitor.sinks"):
        build_sinks(f" {name.upper()} ", tmp_path, {})


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard is not installed "
                                                "(pip install tensorboard)")
def test_tensorboard_gets_train_and_eval_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    [sink] = build_sinks("tensorboard", run_dir, config_to_dict(Config()))
    assert sink.essential is False  # a failing sink is reported, training goes on
    torch.manual_seed(0)
    result = gpufleet.fit(
        toyjob.make_model(), toyjob.make_data(), toyjob.make_data(32), loss_fn=F.mse_loss,
        overrides={"run.dir": str(run_dir), "run.max_steps": 10, "log.every": 5,
                   "run.eval_every": 5, "log.progress": "off", "checkpoint.save_final": False,
                   "monitor.system_interval_s": 0.05},
        callbacks=[sink, SlowSteps()])
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"train/loss", "train/lr", "train/samples_per_s", "eval/loss"} <= set(tags)
    # The system sampler's newest sample goes along with every log interval.
    assert {"system/cpu_pct", "system/ram_used_mb", "system/proc_rss_mb"} <= set(tags)
    assert [e.step for e in events.Scalars("system/ram_used_mb")] == [5, 10]
    assert all(e.value > 0 for e in events.Scalars("system/ram_used_mb"))
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert loss == [(s, pytest.approx(v, rel=1e-6)) for s, v in result.losses]
    assert [e.step for e in events.Scalars("eval/loss")] == [5, 10]
    if "phases" in next(iter(_train_records(run_dir))):
        assert "phases/data_ms" in tags
    [config] = events.Tensors("config/text_summary")
    assert b'"out_dir": "runs"' in config.tensor_proto.string_val[0]


class SlowSteps(Callback):
    """Steps of the toy model take well under a millisecond: long enough steps give the
    system sampler (every 0.05 s) time to take a sample before each log interval."""

    def on_step_end(self, trainer, step):
        time.sleep(0.03)


def _train_records(run_dir):
    import json

    return [json.loads(x) for x in open(run_dir / "metrics.jsonl") if '"train"' in x]


def test_flatten_metrics_keeps_numbers_only():
    metrics = {"kind": "train", "time": 1.0, "step": 5, "loss": 1.5, "skipped": True,
               "phases": {"data": 0.002, "forward": 0.01}, "rank_phases": [{"rank": 0}],
               "note": "x"}
    assert sinks.flatten_metrics(metrics) == {
        "train/loss": 1.5, "phases/data_ms": 2.0, "phases/forward_ms": 10.0}
    assert sinks.flatten_config({"optim": {"lr": 0.1}, "run": {"name": "a"}}) == {
        "optim.lr": 0.1, "run.name": "a"}


def _fit_with(sink, run_dir, steps=6):
    torch.manual_seed(0)
    return gpufleet.fit(
        toyjob.make_model(), toyjob.make_data(), toyjob.make_data(32), loss_fn=F.mse_loss,
        overrides={"run.dir": str(run_dir), "run.max_steps": steps, "log.every": 3,
                   "run.eval_every": 3, "log.progress": "off", "checkpoint.save_final": False,
                   "monitor.system_interval_s": 0.05},
        callbacks=[sink, SlowSteps()])


@pytest.mark.skipif(not HAS_MLFLOW, reason="mlflow is not installed (pip install mlflow)")
def test_mlflow_logs_to_a_sqlite_store_in_the_run_dir_by_default(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "gpufleet-test")
    run_dir = tmp_path / "run"
    # The run's name as gpufleet gives it (a bare Config() has none until then).
    [sink] = build_sinks("mlflow", run_dir, config_to_dict(named(Config())))
    result = _fit_with(sink, run_dir)
    assert result.callback_errors == {}
    client = mlflow.MlflowClient(f"sqlite:///{run_dir / 'mlflow' / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("gpufleet-test").experiment_id])
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert run.data.params["run.name"] == "gpt-stdlib"
    loss = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in loss] == [(s, pytest.approx(v, rel=1e-6))
                                                 for s, v in result.losses]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/loss")] == [3, 6]
    assert "system/ram_used_mb" in run.data.metrics
    assert mlflow.get_tracking_uri() != client.tracking_uri  # the user's mlflow untouched


@pytest.mark.skipif(not HAS_MLFLOW, reason="mlflow is not installed (pip install mlflow)")
def test_a_sink_that_cannot_log_is_named_in_the_result_and_summary(tmp_path, monkeypatch,
                                                                   capsys, caplog):
    from gpufleet.cli import _print_summary

    # MLflow 3 refuses its old file store: the sink fails to open, training goes on.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    run_dir = tmp_path / "run"
    [sink] = build_sinks("mlflow", run_dir, {})
    result = _fit_with(sink, run_dir, steps=3)
    assert result.steps == 3
    assert list(result.callback_errors) == ["mlflow"]
    assert "filesystem tracking backend" in result.callback_errors["mlflow"]
    assert any(r.levelname == "ERROR" and "MLflowSink failed in on_fit_start" in r.message
               for r in caplog.records)
    _print_summary(result)
    out = capsys.readouterr().out
    assert "mlflow failed" in out and "on_fit_start: MlflowException" in out


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard is not installed "
                                                "(pip install tensorboard)")
def test_tensorboard_gets_what_an_own_loop_logs(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    fleet = gpufleet.Fleet(accelerator="cpu", run_dir=str(tmp_path / "run"),
                           overrides={"monitor.sinks": "tensorboard"})
    model, optimizer = fleet.setup(*_model_and_optimizer())
    for step in range(3):
        fleet.backward(model(torch.ones(2, 4)).square().mean())
        optimizer.step()
        fleet.log("my/accuracy", 0.5 + step / 10)
    fleet.finish()
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("my/accuracy")] == \
        [(1, 0.5), (2, 0.6), (3, 0.7)]


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)
