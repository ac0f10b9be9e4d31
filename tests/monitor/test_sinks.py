import importlib.util
import sys

import pytest
import torch
import torch.nn.functional as F

import gpufleet
import toyjob
from gpufleet.config import Config, config_to_dict
from gpufleet.errors import ConfigError
from gpufleet.monitor import sinks
from gpufleet.monitor.sinks import build_sinks

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


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
                   "run.eval_every": 5, "log.progress": "off", "checkpoint.save_final": False},
        callbacks=[sink])
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"train/loss", "train/lr", "train/samples_per_s", "eval/loss"} <= set(tags)
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert loss == [(s, pytest.approx(v, rel=1e-6)) for s, v in result.losses]
    assert [e.step for e in events.Scalars("eval/loss")] == [5, 10]
    if "phases" in next(iter(_train_records(run_dir))):
        assert "phases/data_ms" in tags
    [config] = events.Tensors("config/text_summary")
    assert b'"out_dir": "runs"' in config.tensor_proto.string_val[0]


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
