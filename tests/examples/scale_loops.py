"""Own loops at scale, run on each of 2 ranks inside tests/examples/own_loop_ranks.py's
``twin`` launch (one launch checks them all; tests/examples/test_own_loop.py reads what
each rank saw): a pipeline under GPipe and 1F1B through ``fleet.forward_backward``
(with an evaluation forward, a refused training forward, and a save and load),
model_parallel with the plain calls, a GAN of two models and two optimizers under
fsdp, and a stream (an IterableDataset) read by 2 ranks x 2 workers, stopped and
resumed through fleet.save/load. Each rank computes its single-process reference
itself."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, IterableDataset

import gpufleet

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import dcgan

STEPS = 4


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 1))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 4, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def _reference(steps: int, optimizer) -> nn.Module:
    """The plain loop, one process, the whole batch each step."""
    model = _net()
    opt = optimizer(model.parameters())
    for step in range(steps):
        x, y = _batch(step)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def _pipeline_fleet(out: Path, name: str, schedule: str) -> gpufleet.Fleet:
    return gpufleet.Fleet(accelerator="cpu", strategy="pipeline", run_dir=str(out / name),
                          overrides={"parallel.pipeline.schedule": schedule})


def _train(fleet, model, opt, first: int, steps: int) -> list[float]:
    losses = []
    for step in range(first, first + steps):
        loss = fleet.forward_backward(model, _batch(step), F.mse_loss)
        fleet.clip_gradients(model, opt, max_norm=100.0)  # the stages' norm, joined
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def pipeline(out: Path) -> dict:
    """2 stages x 4 micro-batches: 4 SGD steps under each schedule, then an evaluation
    forward and a training forward; under 1F1B also AdamW, saved after 2 steps and
    loaded into a fresh loop of other weights, which takes the same last 2 steps."""
    seen: dict = {}
    for schedule in ("gpipe", "1f1b"):
        fleet = _pipeline_fleet(out, f"pp-{schedule}", schedule)
        net = _net()
        model, opt = fleet.setup(net, _sgd(net.parameters()))
        losses = _train(fleet, model, opt, 0, STEPS)
        model.eval()
        with torch.no_grad():
            output = model(_batch(99)[0])  # every stage in turn, on every rank
        model.train()
        try:
            model(_batch(0)[0])
            refused = ""
        except gpufleet.ConfigError as e:
            refused = str(e)
        seen[schedule] = {"losses": losses, "stage": dict(model.state_dict()),
                          "output": output, "refused": refused}
        fleet.finish()
    ref = _reference(STEPS, _sgd)
    seen["reference"] = dict(ref.state_dict())
    with torch.no_grad():
        seen["reference_output"] = ref(_batch(99)[0])
    seen["reference_losses"] = _reference_losses()
    # save and load: AdamW, a checkpoint of the whole model from 2 stages
    fleet = _pipeline_fleet(out, "pp-save", "1f1b")
    net = _net()
    model, opt = fleet.setup(net, _adamw(net.parameters()))
    _train(fleet, model, opt, 0, 2)
    fleet.save(out / "pp.ck", {"model": model, "optimizer": opt, "step": 2})
    _train(fleet, model, opt, 2, 2)
    seen["uninterrupted"] = dict(model.state_dict())
    fleet.finish()
    again = _pipeline_fleet(out, "pp-load", "1f1b")
    torch.manual_seed(7)  # other weights: the load must replace them
    net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                        nn.Linear(16, 1))
    model, opt = again.setup(net, _adamw(net.parameters()))
    state = {"model": model, "optimizer": opt, "step": 0}
    again.load(out / "pp.ck", state)
    _train(again, model, opt, 2, 2)
    seen["resumed"] = dict(model.state_dict())
    seen["resumed_step"] = state["step"]
    again.finish()
    seen["adamw_reference"] = dict(_reference(STEPS, _adamw).state_dict())
    return seen


def _reference_losses() -> list[float]:
    model, losses = _net(), []
    opt = _sgd(model.parameters())
    for step in range(STEPS):
        loss = F.mse_loss(model(_batch(step)[0]), _batch(step)[1])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def model_parallel(out: Path, rank: int) -> dict:
    """The modules placed by a device map, replicated over 2 ranks (each half of the
    batch), with the plain calls: forward, backward, step."""
    fleet = gpufleet.Fleet(accelerator="cpu", strategy="model_parallel",
                           run_dir=str(out / "mp"),
                           overrides={"parallel.device_map": {"2": "cpu"}})
    net = _net()
    model, opt = fleet.setup(net, _sgd(net.parameters()))
    for step in range(STEPS):
        x, y = _batch(step)
        fleet.backward(F.mse_loss(model(x[rank::2]), y[rank::2]))
        opt.step()
        opt.zero_grad()
    seen = {"weights": dict(model.state_dict()),
            "reference": dict(_reference(STEPS, _sgd).state_dict())}
    fleet.finish()
    return seen


def _whole(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (COLLECTIVE under fsdp: an all-gather each)."""
    return {n: p.full_tensor().detach().clone() for n, p in model.module.named_parameters()}


def gan_fsdp(out: Path) -> dict:
    """dcgan's generator and discriminator, each with its Adam, both sharded by fsdp,
    trained in pytorch/examples' DCGAN order (the discriminator's backward and step,
    then the generator's) on 2 ranks of 8, against the plain loop of 16."""
    fleet = gpufleet.Fleet(accelerator="cpu", strategy="fsdp", run_dir=str(out / "gan"))
    built = dcgan.build_models()
    gen, opt_g = fleet.setup(built["generator"], dcgan.adam(built["generator"].parameters()))
    disc, opt_d = fleet.setup(built["discriminator"],
                              dcgan.adam(built["discriminator"].parameters()))
    loader = fleet.setup_dataloaders(DataLoader(dcgan.Blobs(), batch_size=8))
    batches = iter(loader)
    for _ in range(STEPS):
        real, z = next(batches)
        opt_d.zero_grad()
        fleet.backward(dcgan.discriminator_loss(gen, disc, real, z))
        opt_d.step()
        opt_g.zero_grad()
        fleet.backward(dcgan.generator_loss(gen, disc, z))
        opt_g.step()
    try:  # the "both at once" form, whose inputs= FSDP2 cannot honour
        fleet.backward(dcgan.generator_loss(gen, disc, z), inputs=list(gen.parameters()))
        refused = ""
    except gpufleet.ConfigError as e:
        refused = str(e)
    seen = {"generator": _whole(gen), "discriminator": _whole(disc), "refused": refused}
    fleet.finish()
    plain = dcgan.build_models()
    pg, pd = plain["generator"], plain["discriminator"]
    plain_g, plain_d = dcgan.adam(pg.parameters()), dcgan.adam(pd.parameters())
    for real, z in list(DataLoader(dcgan.Blobs(), batch_size=16))[:STEPS]:
        plain_d.zero_grad()
        dcgan.discriminator_loss(pg, pd, real, z).backward()
        plain_d.step()
        plain_g.zero_grad()
        dcgan.generator_loss(pg, pd, z).backward()
        plain_g.step()
    seen["reference"] = {"generator": dict(pg.named_parameters()),
                         "discriminator": dict(pd.named_parameters())}
    seen["reference"] = {m: {n: p.detach() for n, p in ps.items()}
                         for m, ps in seen["reference"].items()}
    return seen


class Numbers(IterableDataset):
    """A stream of 50 numbered items (epoch e: 1000 e + i), with ``set_epoch``."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return (torch.tensor([1000.0 * self.epoch + i]) for i in range(50))


def _stream_loop(out: Path, name: str, stop_after: int = 0) -> tuple[list, bool]:
    """Two epochs of the stream, batches of 4, 2 workers a rank; with ``stop_after``
    the loop saves (loader and what it saw) after that many batches and stops. A loop
    whose checkpoint exists loads it first and goes on."""
    fleet = gpufleet.Fleet(accelerator="cpu", strategy="ddp", run_dir=str(out / name))
    loader = fleet.setup_dataloaders(DataLoader(Numbers(), batch_size=4, num_workers=2))
    state = {"loader": loader, "seen": [], "epoch": 0}
    checkpoint = out / "stream.ck"
    if checkpoint.exists():
        fleet.load(checkpoint, state)
    while state["epoch"] < 2:
        for batch in loader:
            state["seen"].append(batch.view(-1).tolist())
            if stop_after and len(state["seen"]) == stop_after:
                fleet.save(checkpoint, state)
                fleet.finish()
                return state["seen"], True
        state["epoch"] += 1
    fleet.finish()
    return state["seen"], False


def stream(out: Path) -> dict:
    whole, _ = _stream_loop(out, "stream-whole")
    first, stopped = _stream_loop(out, "stream-a", stop_after=7)  # mid-epoch 1
    resumed, _ = _stream_loop(out, "stream-b")
    return {"whole": whole, "first": first, "stopped": stopped, "resumed": resumed}


def everything(out: Path, rank: int) -> dict:
    return {"pipeline": pipeline(out), "model_parallel": model_parallel(out, rank),
            "gan": gan_fsdp(out), "stream": stream(out)}
