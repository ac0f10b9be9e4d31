"""The accumulating loop of tests/fleet/test_accelerate_parity.py on the 2 ranks torchrun
starts, under Accelerate's ``Accelerator`` or gpufleet's ``Fleet`` (``sys.argv[1]``:
``accelerate`` or ``fleet``), with a shuffling loader in Accelerate's order. Rank 0
saves the micro-batches after which the optimizer stepped, the sync flags and the
weights to ``sys.argv[2]``."""

import sys

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(14, 4, generator=g), torch.randn(14, 1, generator=g))


def accumulating_loop(prepare, backward, accumulate, sync, epochs: int = 2):
    """Accelerate's documented loop: step, zero_grad on every micro-batch inside
    accumulate(model); 14 samples in batches of 2 shuffled, 3 micro-batches a step."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(5)  # the loader's generator is seeded from here, at prepare
    model, opt, loader = prepare(net, opt, DataLoader(_data(), batch_size=2, shuffle=True))
    inner = getattr(opt, "optimizer", opt)
    seen, syncs, stepped = [], [], []
    inner.register_step_post_hook(lambda *_: stepped.append(len(seen)))
    for _ in range(epochs):
        for x, y in loader:
            with accumulate(model):
                seen.append(x[0, 0].item())
                backward(F.mse_loss(model(x), y))
                syncs.append(sync())
                opt.step()
                opt.zero_grad()
    return {"stepped": stepped, "syncs": syncs, "seen": seen,
            "weights": [p.detach().clone() for p in net.parameters()]}


def main(which: str, out: str) -> None:
    if which == "accelerate":
        from accelerate import Accelerator

        acc = Accelerator(cpu=True, gradient_accumulation_steps=3)
        result = accumulating_loop(acc.prepare, acc.backward, acc.accumulate,
                                   lambda: acc.sync_gradients)
        rank = acc.process_index
    else:
        import gpufleet

        fleet = gpufleet.Fleet(accelerator="cpu", gradient_accumulation_steps=3,
                               run_dir=out + ".run")

        def prepare(m, o, d):
            model, opt = fleet.setup(m, o)
            return model, opt, fleet.setup_dataloaders(d, order="accelerate")

        result = accumulating_loop(prepare, fleet.backward, fleet.accumulate,
                                   lambda: fleet.sync_gradients)
        rank = fleet.global_rank
        fleet.finish()
    if rank == 0:
        torch.save(result, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
