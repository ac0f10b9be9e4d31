"""Fabric's lines for building a model and bringing in its weights, on Fleet:
``init_module(empty_init=)``, ``init_tensor``, ``load_raw`` of a plain PyTorch file, and
``setup(model, optimizer, scheduler=)``; each was an AttributeError or TypeError."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import gpufleet
from gpufleet.errors import CheckpointError, ConfigError
from gpufleet.fleet.init import _SkipInit


def _fleet(tmp_path, name: str = "run") -> gpufleet.Fleet:
    return gpufleet.Fleet(accelerator="cpu", run_dir=str(tmp_path / name))


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8),
                               torch.nn.Linear(8, 1))


def test_init_module_builds_as_usual_and_empty_init_draws_nothing(tmp_path):
    fleet = _fleet(tmp_path)
    torch.manual_seed(0)
    plain = _net()
    torch.manual_seed(0)
    with fleet.init_module():
        built = _net()
    for a, b in zip(plain.parameters(), built.parameters(), strict=True):
        assert torch.equal(a, b) and b.device == fleet.device
    state = torch.get_rng_state()
    with fleet.init_module(empty_init=True):
        empty = _net()
        after = torch.rand(1)  # your own draws inside the block still draw
    assert not torch.equal(torch.get_rng_state(), state)
    torch.set_rng_state(state)
    assert torch.equal(torch.rand(1), after)  # the model's init drew no number before it
    assert [p.shape for p in empty.parameters()] == [p.shape for p in plain.parameters()]
    with fleet.init_tensor():
        assert torch.zeros(2).device == fleet.device
    fleet.finish()


@pytest.mark.parametrize("name,shape,kwargs", [
    ("uniform_", (4, 4), {}), ("normal_", (4, 4), {}), ("trunc_normal_", (4, 4), {}),
    ("constant_", (4, 4), {"val": 0.5}), ("ones_", (4, 4), {}), ("zeros_", (4, 4), {}),
    ("xavier_uniform_", (4, 4), {}), ("xavier_normal_", (4, 4), {}),
    ("kaiming_uniform_", (4, 4), {}), ("kaiming_normal_", (4, 4), {}),
    ("orthogonal_", (4, 4), {}), ("orthogonal_", (2, 8), {}), ("orthogonal_", (8, 2), {}),
    ("eye_", (4, 4), {}), ("sparse_", (4, 4), {"sparsity": 0.5}), ("dirac_", (4, 4, 3), {}),
    # a rejection loop over scratch tensors (narrow bounds) must still end
    ("trunc_normal_", (1000,), {"a": -0.1, "b": 0.1}),
    ("trunc_normal_", (1000,), {"a": -2.0, "b": 2.0})])
def test_empty_init_leaves_every_init_function_undone(name, shape, kwargs):
    """Some of torch.nn.init's functions hand themselves to torch's override hook,
    the others write into the tensor from inside torch/nn/init.py: both are skipped,
    while their scratch tensors (orthogonal_'s, trunc_normal_'s) are computed."""
    tensor = torch.full(shape, 7.0)
    with _SkipInit():
        out = getattr(torch.nn.init, name)(tensor, **kwargs)
        elsewhere = torch.ones(2).mul_(3)  # outside torch.nn.init: done as usual
    assert out is tensor and torch.equal(tensor, torch.full(shape, 7.0))
    assert torch.equal(elsewhere, torch.full((2,), 3.0))


def test_load_raw_reads_a_plain_pytorch_file_into_a_set_up_model(tmp_path, caplog):
    torch.manual_seed(1)
    trained = _net()
    torch.save(trained.state_dict(), tmp_path / "plain.pt")
    fleet = _fleet(tmp_path)
    with fleet.init_module(empty_init=True):
        model = _net()
    model, opt = fleet.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    fleet.load_raw(tmp_path / "plain.pt", model)
    for a, b in zip(trained.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    fleet.backward(F.mse_loss(model(torch.ones(2, 4)), torch.zeros(2, 1)))
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    fresh = torch.optim.SGD(_net().parameters(), lr=0.5)
    fleet.load_raw(tmp_path / "opt.pt", fresh)
    assert fresh.param_groups[0]["lr"] == 0.1
    bigger = torch.nn.Sequential(*_net(), torch.nn.Linear(1, 1))
    with pytest.raises(CheckpointError, match="does not fit this Sequential"):
        fleet.load_raw(tmp_path / "plain.pt", bigger)
    with caplog.at_level("WARNING", logger="gpufleet.fleet.state"):
        fleet.load_raw(tmp_path / "plain.pt", bigger, strict=False)
    assert "missing keys 3.weight, 3.bias" in caplog.text
    assert torch.equal(bigger[0].weight, trained[0].weight)
    fleet.finish()


def test_load_raw_refuses_what_is_not_a_safe_state_dict(tmp_path):
    fleet = _fleet(tmp_path)
    model = fleet.setup(_net())
    damaged = tmp_path / "damaged.pt"
    damaged.write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match="could not be read as a state dict"):
        fleet.load_raw(damaged, model)
    assert damaged.read_bytes() == b"not a torch file"  # left as it was
    with pytest.raises(CheckpointError, match="does not exist"):
        fleet.load_raw(tmp_path / "missing.pt", model)
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match="holds a list, not a state dict"):
        fleet.load_raw(tmp_path / "list.pt", model)
    torch.save(model.state_dict(), tmp_path / "ok.pt")
    with pytest.raises(ConfigError, match=r"load_raw\(weights_only=False\)"):
        fleet.load_raw(tmp_path / "ok.pt", model, weights_only=False)
    with pytest.raises(ConfigError, match="neither a model nor an optimizer"):
        fleet.load_raw(tmp_path / "ok.pt", {"model": model})
    fleet.finish()


def _warm_then_halve(opt):
    sched = torch.optim.lr_scheduler
    return sched.SequentialLR(opt, [sched.LinearLR(opt, 0.1, 1.0, total_iters=3),
                                    sched.StepLR(opt, step_size=2, gamma=0.5)],
                              milestones=[3])


def _losses_and_lrs(step_fn, model, opt, sched) -> tuple[list[float], list[float]]:
    torch.manual_seed(3)
    x, y = torch.randn(7, 2, 4), torch.randn(7, 2, 1)
    losses, lrs = [], []
    for i in range(7):
        loss = F.mse_loss(model(x[i]), y[i])
        step_fn(loss)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
        lrs.append(opt.param_groups[0]["lr"])
    return losses, lrs


def test_setup_takes_a_scheduler_built_before_it_as_fabric_does(tmp_path, caplog):
    """model, optimizer, scheduler = fabric.setup(model, optimizer, scheduler=scheduler):
    the scheduler, chained ones too, steps the optimizer that trains, step for step
    as in plain PyTorch, and no warning says it would not."""
    torch.manual_seed(0)
    plain = _net()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    expected = _losses_and_lrs(lambda loss: loss.backward(), plain, opt,
                               _warm_then_halve(opt))
    fleet = _fleet(tmp_path)
    torch.manual_seed(0)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level("WARNING", logger="gpufleet.fleet.setup"):
        model, opt, sched = fleet.setup(model, opt, scheduler=_warm_then_halve(opt))
    assert "scheduler" not in caplog.text
    assert _losses_and_lrs(fleet.backward, model, opt, sched) == expected
    other = torch.optim.SGD(_net().parameters(), lr=0.1)
    net = _net()
    with pytest.raises(ConfigError, match="not built on an optimizer given to this setup"):
        fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.1),
                    scheduler=torch.optim.lr_scheduler.StepLR(other, 1))
    fleet.finish()


def test_load_raw_refuses_a_sharded_model_and_names_the_order_that_works(tmp_path):
    """A plain state dict holds whole tensors; fsdp's parameters are DTensors (copying
    one into the other raised torch's "mixed torch.Tensor and DTensor")."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from gpufleet.fleet.state import load_raw_state

    net = _net()
    torch.save(net.state_dict(), tmp_path / "plain.pt")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)
    try:
        sharded = fully_shard(_net())
        with pytest.raises(ConfigError, match=r"is sharded.*before fleet\.setup"):
            load_raw_state(tmp_path / "plain.pt", sharded)
        with pytest.raises(ConfigError, match="is sharded"):
            load_raw_state(tmp_path / "plain.pt",
                           torch.optim.SGD(sharded.parameters(), lr=0.1))
    finally:
        dist.destroy_process_group()
    load_raw_state(tmp_path / "plain.pt", _net())  # whole: loads as before
