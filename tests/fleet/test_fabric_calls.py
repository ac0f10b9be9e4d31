"""Fabric's call forms on Fleet: a Fabric loop's lines that once raised TypeError or
silently did something else (``launch()`` without a function, ``backward``'s keywords,
a scheduler built before ``setup``, the arguments of ``seed_everything``, ``barrier``,
``save``, ``load``, ``setup``, ``clip_gradients`` and the collectives)."""

from __future__ import annotations

import importlib.util
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import gpufleet
from gpufleet.errors import CheckpointError, ConfigError


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def test_backward_takes_fabrics_keywords(tmp_path):
    """Two losses on one graph: fabric.backward(l1, retain_graph=True) passes the
    keyword on to loss.backward; on Fleet it was a TypeError."""
    fleet = gpufleet.Fleet(accelerator="cpu", run_dir=str(tmp_path / "run"))
    model = fleet.setup(_net())
    out = model(torch.ones(2, 4))
    fleet.backward(out.sum(), retain_graph=True, model=model)
    fleet.backward(out.mean())  # the graph is still there
    expected = _net()
    expected(torch.ones(2, 4)).sum().mul(1.5).backward()
    for ours, theirs in zip(model.parameters(), expected.parameters(), strict=True):
        assert torch.allclose(ours.grad, theirs.grad)
    first, *_, head = model.parameters()
    before = [p.grad.clone() for p in model.parameters()]
    fleet.backward(model(torch.ones(2, 4)).sum(), inputs=[head])  # only into `inputs`
    assert torch.equal(first.grad, before[0])
    assert not torch.equal(head.grad, before[-1])
    fleet.finish()


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_backward_with_create_graph_lets_a_loop_differentiate_the_gradients(tmp_path):
    """A gradient penalty: backward(create_graph=True), then a loss on the gradients
    themselves, as plain PyTorch (and Fabric, which passes the keyword on) computes it."""
    def penalised(net, backward):
        out = net(torch.ones(2, 4)).sum()
        backward(out, create_graph=True)
        penalty = sum(p.grad.square().sum() for p in net.parameters())
        backward(penalty)
        return [p.grad.clone() for p in net.parameters()]

    fleet = gpufleet.Fleet(accelerator="cpu", run_dir=str(tmp_path / "run"))
    ours = penalised(fleet.setup(_net()), fleet.backward)
    theirs = penalised(_net(), lambda t, **kw: t.backward(**kw))
    for a, b in zip(ours, theirs, strict=True):
        assert torch.allclose(a, b)
    fleet.finish()


def test_call_reaches_every_callback_that_has_the_hook(tmp_path):
    """Fabric(callbacks=[...]) then fabric.call("on_train_epoch_end", ...): plain objects,
    each called where it has the method, in order; the run's own hooks pass them by."""
    heard = []

    class Epochs:
        def on_train_epoch_end(self, loss, *, epoch):
            heard.append(("epochs", loss, epoch))

    class Other:
        on_train_epoch_end = "not a method"

        def on_validation_end(self, metrics):  # takes only the keyword it names
            heard.append(("other", metrics))

        def on_fit_start(self):  # Lightning's hook name, also one of gpufleet's
            heard.append(("fit start",))

    fleet = gpufleet.Fleet(accelerator="cpu", run_dir=str(tmp_path / "run"),
                           callbacks=[Epochs(), Other(), Epochs()])
    net = _net()
    model, opt = fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    fleet.backward(model(torch.ones(2, 4)).sum())
    opt.step()  # the run's own hooks start here: a plain object is not theirs
    with pytest.warns(UserWarning, match="Skipping the callback `Other.on_train_epoch_end`"):
        fleet.call("on_train_epoch_end", 0.5, epoch=1)  # (as Fabric warns)
    fleet.call("on_validation_end", metrics=2.0, epoch=1)
    fleet.call("on_nothing_has")
    fleet.call("on_fit_start")
    assert heard == [("epochs", 0.5, 1), ("epochs", 0.5, 1), ("other", 2.0),
                     ("fit start",)]
    fleet.finish()
    single = gpufleet.Fleet(accelerator="cpu", run_dir=str(tmp_path / "one"),
                            callbacks=Other())  # one object, as Fabric takes it
    single.call("on_validation_end", metrics=3.0)
    assert heard[-1] == ("other", 3.0)
    single.finish()


def test_loggers_receive_what_log_dict_logs(tmp_path):
    """Fabric(loggers=...): each logger's log_metrics gets what the loop logs, beside
    metrics.jsonl; Lightning's CSVLogger writes it to its file (when installed)."""
    class Mine:
        def __init__(self):
            self.seen = []

        def log_metrics(self, metrics, step):
            self.seen.append((metrics, step))

    mine = Mine()
    loggers = [mine]
    csv = None
    if importlib.util.find_spec("lightning") is not None:
        from lightning.fabric.loggers import CSVLogger

        csv = CSVLogger(str(tmp_path / "csv"), name="run")
        loggers.append(csv)
    fleet = gpufleet.Fleet(accelerator="cpu", run_dir=str(tmp_path / "run"), loggers=loggers)
    assert fleet.logger is mine and fleet.loggers == loggers
    fleet.log("acc", torch.tensor(0.25), step=3)
    fleet.log_dict({"loss": 1.5})
    assert mine.seen == [({"acc": 0.25}, 3), ({"loss": 1.5}, None)]  # Fabric's step
    fleet.finish()
    if csv is not None:
        csv.finalize("success")
        assert "acc" in (Path(csv.log_dir) / "metrics.csv").read_text()
    with pytest.raises(ConfigError, match="has no log_metrics"):
        gpufleet.Fleet(accelerator="cpu", run_dir=str(tmp_path / "bad"), loggers=object())
    plain = gpufleet.Fleet(accelerator="cpu", run_dir=str(tmp_path / "none"))
    with pytest.raises(ConfigError, match="has no loggers"):
        _ = plain.logger
    plain.finish()


def test_a_scheduler_built_before_setup_reaches_training(tmp_path, caplog):
    """Fleet wraps the optimizer it is given, as Fabric does, so a scheduler built on it
    before setup steps the learning rate training uses (and nothing warns)."""
    fleet = gpufleet.Fleet(accelerator="cpu", run_dir=str(tmp_path / "run"))
    net = _net()
    early = torch.optim.SGD(net.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(early, step_size=1, gamma=0.5)
    with caplog.at_level("WARNING", logger="gpufleet.fleet.setup"):
        model, opt = fleet.setup(net, early)
    assert "scheduler" not in caplog.text
    fleet.backward(model(torch.ones(2, 4)).sum())
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)  # the one training reads
    fleet.finish()


def test_launch_without_a_function_on_a_rank_does_nothing(tmp_path):
    """A Fabric script's first line after Fabric(...) is fabric.launch(); it was a
    TypeError on Fleet."""
    fleet = gpufleet.Fleet(accelerator="cpu", devices=1, run_dir=str(tmp_path / "run"))
    assert fleet.launch() is None
    model = fleet.setup(_net())
    fleet.backward(model(torch.ones(2, 4)).sum())  # the loop goes on as Fabric's would
    fleet.finish()


def test_launch_passes_keywords_on_as_fabrics_does(tmp_path):
    fleet = gpufleet.Fleet(accelerator="cpu", devices=1, run_dir=str(tmp_path / "run"))
    assert fleet.launch(lambda f, a, *, b: (f.world_size, a, b), 1, b=2) == (1, 1, 2)


def _fleet(tmp_path, name: str = "run", **kwargs) -> gpufleet.Fleet:
    return gpufleet.Fleet(accelerator="cpu", run_dir=str(tmp_path / name), **kwargs)


def _data() -> TensorDataset:
    return TensorDataset(torch.arange(16.0).view(8, 2), torch.zeros(8, 1))


def test_seed_everything_takes_fabrics_arguments_and_returns_the_seed(tmp_path, caplog,
                                                                     monkeypatch):
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    monkeypatch.delenv("PL_SEED_WORKERS", raising=False)
    fleet = _fleet(tmp_path)
    with caplog.at_level("INFO", logger="gpufleet.fleet.seeding"):
        assert fleet.seed_everything(5, workers=True, verbose=True) == 5
    assert "seed set to 5" in caplog.text
    first = torch.rand(2)
    caplog.clear()
    with caplog.at_level("INFO", logger="gpufleet.fleet.seeding"):
        assert fleet.seed_everything(seed=5, verbose=False) == 5
    assert torch.equal(torch.rand(2), first) and not caplog.text
    assert fleet.seed_everything() == 5  # the seed chosen before (PL_GLOBAL_SEED)
    monkeypatch.delenv("PL_GLOBAL_SEED")
    assert fleet.seed_everything() == 0  # Fabric's default seed
    fleet.finish()


def test_seed_everything_seeds_the_workers_of_later_loaders_per_rank(tmp_path, monkeypatch):
    """Fabric's workers=True (its default): loaders set up afterwards seed their workers
    from the rank too; a worker_init_fn of your own stays; workers=False adds none."""
    from gpufleet.fleet.seeding import seed_rank_worker

    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    monkeypatch.delenv("PL_SEED_WORKERS", raising=False)
    fleet = _fleet(tmp_path)
    fleet.seed_everything(0)
    seeded = fleet.setup_dataloaders(DataLoader(_data(), batch_size=4))
    assert seeded.loader.worker_init_fn.func is seed_rank_worker
    assert seeded.loader.worker_init_fn.keywords == {"rank": 0}

    def own(worker_id):
        return None

    kept = fleet.setup_dataloaders(DataLoader(_data(), batch_size=4, worker_init_fn=own))
    assert kept.loader.worker_init_fn is own
    fleet.seed_everything(0, workers=False)
    assert fleet.setup_dataloaders(DataLoader(_data(), batch_size=4)).loader.worker_init_fn \
        is None
    fleet.finish()


def _draws(init, worker_id: int, rank: int) -> tuple:
    """What a worker of ``rank`` draws after ``init`` (a worker_init_fn) seeded it."""
    torch.manual_seed(1234 + worker_id)  # what a DataLoader worker starts with
    init(worker_id, rank=rank)
    return torch.rand(2).tolist(), random.random(), np.random.rand()


def test_each_ranks_workers_draw_their_own_numbers_run_after_run():
    from gpufleet.fleet.seeding import seed_rank_worker

    draws = {(w, r): _draws(seed_rank_worker, w, r) for w, r in ((0, 0), (1, 0), (1, 1))}
    assert len(set(map(str, draws.values()))) == 3  # per worker and per rank
    assert _draws(seed_rank_worker, 1, 1) == draws[1, 1]  # the same, run after run
    plain = _draws(lambda w, rank: None, 1, 0), _draws(lambda w, rank: None, 1, 1)
    assert plain[0][0] == plain[1][0]  # without it, ranks' workers draw alike (torch)


def test_barrier_takes_a_name(tmp_path):
    """The name reaches the hang report's ring on several ranks (test_group_and_named_
    barrier_on_two_ranks); alone, there is nothing to wait for."""
    fleet = _fleet(tmp_path)
    fleet.barrier("epoch-end")
    fleet.barrier(name=None)
    fleet.finish()


def _saved(tmp_path, **save_kwargs) -> tuple[gpufleet.Fleet, torch.nn.Module, Path]:
    fleet = _fleet(tmp_path, "saver")
    model = fleet.setup(_net())
    path = fleet.save(tmp_path / "ck.pt", {"model": model, "epoch": 3}, **save_kwargs)
    return fleet, model, path


def test_load_without_a_state_returns_what_was_saved(tmp_path):
    fleet, model, path = _saved(tmp_path)
    draw = torch.rand(1)
    whole = fleet.load(path)
    assert whole.keys() == {"model", "epoch"} and whole["epoch"] == 3
    assert whole["model"].keys() == model.state_dict().keys()
    assert fleet.load(path, {}).keys() == whole.keys()  # Fabric: an empty state is none
    torch.manual_seed(7)
    after = torch.rand(1)
    torch.manual_seed(7)
    fleet.load(path)
    assert torch.equal(torch.rand(1), after) and not torch.equal(after, draw)  # RNG left
    fleet.finish()


def test_load_strict_false_loads_what_fits_and_names_what_it_skipped(tmp_path, caplog):
    fleet, model, path = _saved(tmp_path)
    bigger = torch.nn.Sequential(*_net(), torch.nn.Linear(1, 1))  # one layer more
    for p in bigger.parameters():
        torch.nn.init.zeros_(p)
    state = {"model": bigger, "step": 0}
    with pytest.raises(CheckpointError, match=r"holds no 'step'.*strict=False"):
        fleet.load(path, state)
    with caplog.at_level("WARNING", logger="gpufleet.fleet.state"):
        rest = fleet.load(path, state, strict=False)
    assert rest == {"epoch": 3} and state["step"] == 0  # left as it was
    assert torch.equal(bigger[0].weight, model.module[0].weight)  # loaded where it fits
    assert torch.equal(bigger[3].weight, torch.zeros(1, 1))
    assert "'step' (not in the file)" in caplog.text
    assert "missing keys 3.weight, 3.bias" in caplog.text
    smaller = torch.nn.Sequential(torch.nn.Linear(4, 8))
    caplog.clear()
    with caplog.at_level("WARNING", logger="gpufleet.fleet.state"):
        fleet.load(path, {"model": smaller}, False)
    assert "unexpected keys 2.weight, 2.bias" in caplog.text
    assert torch.equal(smaller[0].bias, model.module[0].bias)
    fleet.finish()


def test_load_reads_weights_only_and_refuses_to_do_otherwise(tmp_path):
    fleet, _, path = _saved(tmp_path)
    assert fleet.load(path, weights_only=True)["epoch"] == 3
    assert fleet.load(path, weights_only=None)["epoch"] == 3
    with pytest.raises(ConfigError, match=r"load\(weights_only=False\).*nothing in a file"):
        fleet.load(path, weights_only=False)
    fleet.finish()


def test_save_keeps_what_filter_chooses(tmp_path):
    fleet, model, path = _saved(tmp_path, filter={"model": lambda name, _: "bias" in name})
    saved = fleet.load(path)
    assert list(saved["model"]) == ["0.bias", "2.bias"] and saved["epoch"] == 3
    fleet.save(path, {"model": model, "epoch": 3}, filter={"model": lambda *_: False})
    assert fleet.load(path) == {"epoch": 3}  # nothing kept: the key is left out, as Fabric
    with pytest.raises(ConfigError, match=r"keys \{'optimizer'\} are not present in the "
                                          "state keys"):
        fleet.save(path, {"model": model}, filter={"optimizer": lambda *_: True})
    with pytest.raises(TypeError, match="give a function"):  # (TypeError: as Fabric's)
        fleet.save(path, {"model": model}, filter={"model": True})
    fleet.finish()


def test_setup_takes_move_to_device_where_nothing_would_move(tmp_path):
    fleet = _fleet(tmp_path)
    model = fleet.setup(module=_net(), move_to_device=False)  # on the CPU, as the run
    fleet.backward(model(torch.ones(2, 4)).sum())
    assert fleet.setup_module(module=_net(), move_to_device=False).module is not None
    on_meta = torch.nn.Linear(4, 1, device="meta")
    with pytest.raises(ConfigError, match=r"move_to_device=False\): the model has tensors "
                                          r"on meta and this rank trains on cpu"):
        fleet.setup_module(on_meta, move_to_device=False)
    fleet.finish()


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def test_clip_gradients_takes_norm_type(tmp_path):
    fleet = _fleet(tmp_path)
    net = _net()
    model, optimizer = fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    reference = _net()
    for norm_type in (float("inf"), 1.0, "inf"):
        optimizer.zero_grad()
        reference.zero_grad()
        fleet.backward(model(torch.full((2, 4), 10.0)).sum())
        reference(torch.full((2, 4), 10.0)).sum().backward()
        norm = fleet.clip_gradients(model, optimizer, max_norm=0.5, norm_type=norm_type)
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5,
                                                  norm_type=float(norm_type))
        assert torch.equal(norm, expected), norm_type
        assert all(torch.equal(a, b) for a, b in zip(_grads(model), _grads(reference)))
    with pytest.raises(ConfigError, match="norm_type=0"):
        fleet.clip_gradients(model, optimizer, max_norm=0.5, norm_type=0)
    fleet.finish()


def test_a_strategy_whose_ranks_hold_pieces_refuses_another_norm_type():
    from gpufleet.config import ParallelConfig
    from gpufleet.parallel import build_strategy
    from gpufleet.parallel.dims import ParallelDims

    strategy = build_strategy("single", ParallelConfig(), torch.device("cpu"))
    strategy.dims = ParallelDims(dp_shard=2)  # as fsdp over 2 ranks
    net = _net()
    net(torch.ones(1, 4)).sum().backward()
    with pytest.raises(ConfigError, match=r"norm_type=1\).*global L2 norm together only"):
        strategy.clip_grad_norm(net, 1.0, norm_type=1.0)


def test_clip_gradients_error_if_nonfinite_where_no_guard_skips_the_step(tmp_path):
    """Fabric's default raises on a non-finite norm; the first optimizer's step is
    watched by the non-finite guard, which skips it instead; another's is not."""
    fleet = _fleet(tmp_path)
    gen, disc = _net(), torch.nn.Linear(1, 1)
    gen, opt_g = fleet.setup(gen, torch.optim.SGD(gen.parameters(), lr=0.1))
    disc, opt_d = fleet.setup(disc, torch.optim.SGD(disc.parameters(), lr=0.1))
    fleet.backward(disc(gen(torch.ones(2, 4))).sum() * float("inf"))
    assert not torch.isfinite(fleet.clip_gradients(gen, opt_g, max_norm=1.0))  # guarded
    with pytest.raises(RuntimeError, match="norm of order 2 of the gradients is not finite"):
        fleet.clip_gradients(disc, opt_d, max_norm=1.0)
    fleet.clip_gradients(disc, opt_d, max_norm=1.0, error_if_nonfinite=False)
    opt_g.step()
    assert fleet.skipped_steps == 1
    fleet.finish()


def test_no_backward_sync_takes_fabrics_name(tmp_path):
    fleet = _fleet(tmp_path)
    model = fleet.setup(_net())
    with fleet.no_backward_sync(module=model, enabled=True):
        fleet.backward(model(torch.ones(2, 4)).sum())
    fleet.finish()


def test_collectives_take_fabrics_names(tmp_path):
    fleet = _fleet(tmp_path)
    assert fleet.all_reduce(data=torch.ones(2), group=None, reduce_op="sum").tolist() == [1, 1]
    assert fleet.all_reduce({"a": 2.0, "b": [torch.ones(1)]}) == {"a": 2.0,
                                                                  "b": [torch.ones(1)]}
    assert fleet.all_gather(data=torch.ones(2), group=None, sync_grads=False).shape == (1, 2)
    assert fleet.all_gather(torch.ones(2), True).shape == (1, 2)  # Fleet's sync_grads, 2nd
    assert fleet.broadcast(obj={"a": 1}, src=0) == {"a": 1}  # as it was
    with pytest.raises(ConfigError, match=r"all_reduce\(group=...\): this run has no "
                                          "torch.distributed process group"):
        fleet.all_reduce(1.0, group=object())
    with pytest.raises(ConfigError, match="reduce op twice"):
        fleet.all_reduce(1.0, "sum", reduce_op="max")
    with pytest.raises(ConfigError, match="reduce_op"):
        fleet.all_reduce(1.0, reduce_op=torch.distributed.ReduceOp.PRODUCT)
    fleet.finish()


def test_group_and_named_barrier_on_two_ranks(tmp_path):
    """``group=``: a reduction and a gather (with gradients) over a group of both ranks
    and over a group of rank 1 alone (rank 0, outside it, is told so); a named barrier
    is named in the ring of collectives a hang report lists; ``fleet.strategy`` gives
    each rank's facts and Fabric's ``reduce_boolean_decision``; the ranks are started
    by calling a subclass's own ``run()``, which returns rank 0's result."""
    script = Path(__file__).with_name("fabric_ranks.py")
    done = subprocess.run([sys.executable, str(script), str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank-{r}.pt", weights_only=True) for r in (0, 1)]
    for seen in ranks:
        assert seen["sum"] == [3.0] and seen["old_form"] == 2.0
        assert seen["ops"] == [3.0, 1.5, 1.0, 1.5, 2.0]  # torch's ReduceOp, any case
        assert seen["mean"]["x"] == 1.5 and seen["mean"]["t"][0].tolist() == [0.5, 0.5]
        assert seen["gathered"] == [[2.0], [4.0]] and seen["grad"] == [4.0]
        assert seen["ring"][-1] == "barrier 'after-groups'"
    assert "rank 0 is not in that group" in ranks[0]["outside"]
    assert ranks[1]["alone"] == 5.0 and ranks[1]["alone_gather"] == [[3.0]]
    assert ranks[1]["alone_grad"] == [1.0]
    assert (tmp_path / "result.txt").read_text() == "0"  # a subclass's run(): rank 0's
    for rank, seen in enumerate(ranks):  # fleet.strategy: the facts, any / all ranks
        assert seen["strategy"] == ["cpu", 2, rank, True, False, True]
    accelerate = pytest.importorskip("accelerate")
    dealt = []  # the third epoch's batches of each rank, as Accelerate deals them
    for rank, seen in enumerate(ranks):  # order="accelerate": what prepare deals rank r
        torch.manual_seed(7)
        theirs = accelerate.data_loader.prepare_data_loader(
            DataLoader(list(range(35)), batch_size=4, shuffle=True), num_processes=2,
            process_index=rank, put_on_device=False)
        epochs = [[b.tolist() for b in theirs] for _ in range(3)]
        assert seen["accelerate_order"] == epochs[:2]
        dealt.append(epochs[2])
    # Accelerate's gather_for_metrics of the third epoch: each round's batches in rank
    # order, the completed last round's repeats cut off (35 values, each sample once)
    gathered = [i for k in range(len(dealt[0])) for rank in (0, 1) for i in dealt[rank][k]]
    for seen in ranks:
        assert seen["accelerate_metrics"] == gathered[:35]
        assert sorted(seen["accelerate_metrics"]) == list(range(35))
    for seen in ranks:  # Accelerate's gather_for_metrics: the padding duplicate dropped
        assert sorted(seen["for_metrics"]) == list(range(35))
        assert len(seen["plain"]) == 36


def test_save_refuses_the_files_own_keys(tmp_path):
    fleet = _fleet(tmp_path)
    for key in ("format", "_fleet"):
        with pytest.raises(ConfigError, match=f"state key '{key}' is the file's own"):
            fleet.save(tmp_path / "c.pt", {key: 3})
    assert not (tmp_path / "c.pt").exists()
    fleet.finish()


def test_a_fleet_never_finished_leaves_threads_that_stop(tmp_path):
    """A loop that never finishes its Fleet (a notebook, a test) leaves the watchdog and
    the system sampler running until exit; each is a daemon thread whose ``stop()``
    ends it, as a harness stops the daemon threads it finds (Lightning's tests do)."""
    import threading

    before = set(threading.enumerate())
    fleet = gpufleet.Fleet(accelerator="cpu", run_dir=str(tmp_path / "run"))
    net = _net()
    model, opt = fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    fleet.backward(model(torch.ones(2, 4)).sum())
    opt.step()  # the run's monitors start at the first step
    started = [t for t in set(threading.enumerate()) - before if t.name.startswith("gpufleet")]
    assert {t.name for t in started} >= {"gpufleet-watchdog", "gpufleet-system-sampler"}
    for thread in started:
        assert thread.daemon
        thread.stop()
        assert not thread.is_alive(), thread.name
    fleet.finish()  # still ends the run as usual (diagnosis, report)
    assert (fleet.run_dir / "diagnosis.json").is_file()
