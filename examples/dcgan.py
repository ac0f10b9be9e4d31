"""A DCGAN-style GAN on generated images: two models, two optimizers, one training step.

The generator turns a latent vector into an 8x8 image with transposed convolutions; the
discriminator scores an image with strided convolutions and LeakyReLU; both train with
Adam (lr 2e-4, beta1 0.5) on binary cross-entropy, as in DCGAN. The images are made
here (soft blobs at random places, no download), and so are the latent vectors: each
sample is ``(image, z)``, so the same seed gives the same run on any number of ranks.
BatchNorm is left out, so that 2 ranks of a batch of B train exactly as 1 process of 2B.

The training step returns one loss per model, named after it. In ``both`` mode each
step trains both models: the discriminator on real against generated images, the
generator on fooling it (each loss's backward reaches its own model only). In
``alternate`` mode even steps train the discriminator and odd steps the generator.
:func:`train_plain` is the same training written in plain PyTorch.

    python examples/dcgan.py                       # gpufleet, 1 process
    python examples/dcgan.py --nproc 2             # gpufleet starts 2 ranks (ddp)
    python examples/dcgan.py --plain               # the plain PyTorch loop
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

import gpufleet

SIZE, LATENT, SAMPLES = 8, 8, 256


class Blobs(Dataset):
    """``(image, z)`` pairs: a soft blob on an 8x8 image in [-1, 1], and a latent
    vector for the generator, both drawn once from ``seed``."""

    def __init__(self, samples: int = SAMPLES, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        centre = torch.rand(samples, 2, 1, 1, generator=g) * (SIZE - 1)
        width = 1.0 + 1.5 * torch.rand(samples, 1, 1, generator=g)
        axis = torch.arange(SIZE, dtype=torch.float32)
        dist2 = (axis.view(1, SIZE, 1) - centre[:, 0]) ** 2 + \
            (axis.view(1, 1, SIZE) - centre[:, 1]) ** 2
        self.images = (2 * torch.exp(-dist2 / (2 * width ** 2)) - 1).unsqueeze(1)
        self.latents = torch.randn(samples, LATENT, generator=g)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.latents[i]


class Generator(nn.Module):
    """Latent vector -> 1x8x8 image in [-1, 1]."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.ConvTranspose2d(LATENT, width * 2, 4, 1, 0), nn.ReLU(),   # 4x4
            nn.ConvTranspose2d(width * 2, width, 4, 2, 1), nn.ReLU(),    # 8x8
            nn.Conv2d(width, 1, 3, 1, 1), nn.Tanh())

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z.view(len(z), LATENT, 1, 1))


class Discriminator(nn.Module):
    """1x8x8 image -> one logit (real: high)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, width, 4, 2, 1), nn.LeakyReLU(0.2),             # 4x4
            nn.Conv2d(width, width * 2, 4, 2, 1), nn.LeakyReLU(0.2),     # 2x2
            nn.Flatten(), nn.Linear(width * 2 * 4, 1))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.net(image).squeeze(1)


def build_models(seed: int = 0) -> dict[str, nn.Module]:
    torch.manual_seed(seed)
    return {"generator": Generator(), "discriminator": Discriminator()}


def adam(params) -> torch.optim.Optimizer:
    """DCGAN's optimizer, one per model."""
    return torch.optim.Adam(params, lr=2e-4, betas=(0.5, 0.999))


def _bce(logits: torch.Tensor, real: bool) -> torch.Tensor:
    target = torch.ones_like(logits) if real else torch.zeros_like(logits)
    return F.binary_cross_entropy_with_logits(logits, target)


def discriminator_loss(gen: nn.Module, disc: nn.Module, real: torch.Tensor,
                       z: torch.Tensor) -> torch.Tensor:
    fake = gen(z).detach()
    return _bce(disc(real), True) + _bce(disc(fake), False)


def generator_loss(gen: nn.Module, disc: nn.Module, z: torch.Tensor) -> torch.Tensor:
    return _bce(disc(gen(z)), True)


def both_step(models, batch, step):
    """Both models every step; the losses named after the models they train."""
    real, z = batch
    gen, disc = models["generator"], models["discriminator"]
    return {"discriminator": discriminator_loss(gen, disc, real, z),
            "generator": generator_loss(gen, disc, z)}


def alternate_step(models, batch, step):
    """The discriminator on even steps, the generator on odd ones."""
    real, z = batch
    gen, disc = models["generator"], models["discriminator"]
    if step % 2 == 0:
        return {"discriminator": discriminator_loss(gen, disc, real, z)}
    return {"generator": generator_loss(gen, disc, z)}


STEPS = {"both": both_step, "alternate": alternate_step}


def train_plain(steps: int, batch_size: int, mode: str = "both"
                ) -> tuple[dict[str, nn.Module], list[dict[str, float]]]:
    """The same training in plain PyTorch, one process; returns the models and each
    step's losses."""
    models = build_models()
    gen, disc = models["generator"], models["discriminator"]
    opt_g, opt_d = adam(gen.parameters()), adam(disc.parameters())
    loader = DataLoader(Blobs(), batch_size=batch_size, shuffle=False, drop_last=True)
    losses: list[dict[str, float]] = []
    batches = iter(loader)
    for step in range(steps):
        try:
            real, z = next(batches)
        except StopIteration:
            batches = iter(loader)
            real, z = next(batches)
        row = {}
        if mode == "both" or step % 2 == 0:
            opt_d.zero_grad()
            d_loss = discriminator_loss(gen, disc, real, z)
            d_loss.backward()
            row["discriminator"] = d_loss.item()
        if mode == "both" or step % 2 == 1:
            opt_g.zero_grad()
            g_loss = generator_loss(gen, disc, z)
            # The generator's loss goes through the discriminator: only the generator's
            # gradients are wanted from it.
            g_loss.backward(inputs=list(gen.parameters()))
            row["generator"] = g_loss.item()
        if "discriminator" in row:
            opt_d.step()
        if "generator" in row:
            opt_g.step()
        losses.append(row)
    return models, losses


def train_gpufleet(steps: int, batch_size: int, mode: str = "both", nproc: int = 1,
                   overrides: dict | None = None
                   ) -> tuple[dict[str, nn.Module], gpufleet.FitResult]:
    """The same training through gpufleet: two models, an optimizer factory called per
    model, and the training step."""
    models = build_models()
    result = gpufleet.fit(
        models, Blobs(), training_step=STEPS[mode], optimizer=adam,
        overrides={"run.max_steps": steps, "data.batch_size": batch_size,
                   "data.shuffle": False, "dist.nproc": nproc, "run.eval_every": 0,
                   "log.every": 1, **(overrides or {})})
    return models, result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plain", action="store_true", help="run the plain PyTorch loop")
    p.add_argument("--nproc", type=int, default=1, help="gpufleet: ranks to start")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank")
    p.add_argument("--mode", choices=sorted(STEPS), default="both")
    args = p.parse_args()
    if args.plain:
        _, losses = train_plain(args.steps, args.batch_size, args.mode)
        last = losses[-1]
    else:
        _, result = train_gpufleet(args.steps, args.batch_size, args.mode, args.nproc)
        last = {"loss": result.final_loss}
        print(f"run directory {result.run_dir}")
    print("last step: " + ", ".join(f"{k} {v:.4f}" for k, v in last.items()
                                    if not math.isnan(v)))


if __name__ == "__main__":
    main()
