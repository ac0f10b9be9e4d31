"""Fabric's call forms on Fleet: a Fabric loop's lines that once raised TypeError or
silently did something else (``launch()`` without a function, ``backward``'s keywords,
a scheduler built before ``setup``)."""

from __future__ import annotations

import torch

import gpufleet


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


def test_a_scheduler_built_before_setup_is_named(tmp_path, caplog):
    """Fabric wraps the optimizer it is given, so a scheduler built before setup still
    reaches training; Fleet rebuilds it, and that scheduler would silently not."""
    fleet = gpufleet.Fleet(accelerator="cpu", run_dir=str(tmp_path / "run"))
    net = _net()
    early = torch.optim.SGD(net.parameters(), lr=0.1)
    torch.optim.lr_scheduler.StepLR(early, step_size=1)
    with caplog.at_level("WARNING", logger="gpufleet.fleet.setup"):
        fleet.setup(net, early)
    assert "scheduler was built on this SGD before fleet.setup" in caplog.text
    caplog.clear()
    model = fleet.setup_module(_net())
    with caplog.at_level("WARNING", logger="gpufleet.fleet.setup"):
        fleet.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    assert "scheduler" not in caplog.text  # none built: nothing to say
    fleet.finish()


def test_launch_without_a_function_on_a_rank_does_nothing(tmp_path):
    """A Fabric script's first line after Fabric(...) is fabric.launch(); it was a
    TypeError on Fleet."""
    fleet = gpufleet.Fleet(accelerator="cpu", devices=1, run_dir=str(tmp_path / "run"))
    assert fleet.launch() is None
    model = fleet.setup(_net())
    fleet.backward(model(torch.ones(2, 4)).sum())  # the loop goes on as Fabric's would
    fleet.finish()
