"""One block rule for FSDP auto wrapping and activation checkpointing every:K, logged."""

from __future__ import annotations

import logging

import torch
from torch import nn

from gpufleet.models import build_gpt
from gpufleet.parallel.activation_checkpointing import apply_activation_checkpointing
from gpufleet.parallel.blocks import find_blocks
from gpufleet.parallel.fsdp import blocks_to_shard


class BasicBlock(nn.Module):
    """A ResNet basic block, optionally with a downsampling shortcut."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                         nn.BatchNorm2d(cout)) if stride != 1 or cin != cout
                           else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return torch.relu(out + (self.downsample(x) if self.downsample is not None else x))


class TinyResNet(nn.Module):
    """ResNet-18's layout at toy width: four Sequential stages of two blocks each."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        widths = [(4, 4, 1), (4, 8, 2), (8, 16, 2), (16, 32, 2)]
        for i, (cin, cout, stride) in enumerate(widths, start=1):
            setattr(self, f"layer{i}", nn.Sequential(BasicBlock(cin, cout, stride),
                                                     BasicBlock(cout, cout)))
        self.fc = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        for i in range(1, 5):
            x = getattr(self, f"layer{i}")(x)
        return self.fc(x.mean(dim=(2, 3)))


RESNET_BLOCKS = [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]


def test_resnet_blocks_are_found_across_its_sequential_stages():
    assert find_blocks(TinyResNet()) == RESNET_BLOCKS


def test_gpt_blocks_are_its_transformer_blocks():
    gpt = build_gpt(n_layer=3, n_head=2, n_embd=16, block_size=8)
    blocks = find_blocks(gpt)
    assert len(blocks) == 3
    modules = dict(gpt.named_modules())
    assert {type(modules[n]).__name__ for n in blocks} == {"Block"}


def test_fsdp_auto_and_every_k_pick_from_the_same_blocks_and_log_them(caplog):
    net = TinyResNet()
    modules = dict(net.named_modules())
    with caplog.at_level(logging.INFO, logger="gpufleet"):
        sharded = blocks_to_shard(net, "auto")
        checkpointed = apply_activation_checkpointing(net, "every:2")
    assert sharded == [modules[n] for n in RESNET_BLOCKS]
    assert checkpointed == RESNET_BLOCKS[::2]  # layer1.0, layer2.0, layer3.0, layer4.0
    text = caplog.text
    assert "fsdp auto wrap: 8 x BasicBlock: layer1.0, layer1.1" in text
    assert "activation checkpointing (every:2) on 4 x BasicBlock: layer1.0, layer2.0" in text
    # The checkpointed ResNet still trains: forward and backward run through the blocks.
    net(torch.randn(2, 3, 8, 8)).sum().backward()
    assert net.layer1[0].conv1.weight.grad is not None


def test_a_large_unrepeated_layer_does_not_hide_the_repeated_blocks():
    # An embedding bigger than all blocks together is still not a block.
    net = nn.Sequential(nn.Embedding(5000, 16), nn.Linear(16, 16), nn.Linear(16, 16),
                        nn.LayerNorm(16))
    assert find_blocks(net) == ["1", "2"]
    assert find_blocks(nn.Sequential(nn.Linear(2, 2))) == []
