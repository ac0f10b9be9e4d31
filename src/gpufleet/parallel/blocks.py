"""Which modules of a model are its blocks: one rule for FSDP ``auto`` wrapping and for
activation checkpointing ``every:K``.

A block is a unit the model repeats inside an ``nn.ModuleList`` or ``nn.Sequential``:
the transformer blocks of a GPT (one ModuleList), the residual blocks of a ResNet
(spread over four Sequential stages), the linear layers of an MLP written as one
Sequential. The rule:

1. Candidates are the direct children, with parameters, of every ``nn.ModuleList`` and
   ``nn.Sequential`` in the model. A child is known by its class; a child that is
   itself a Sequential/ModuleList by its class and the classes of its children.
2. Of the kinds that occur at least twice, the one holding the most parameters in
   total wins; on a tie the more numerous kind, then the one nearer the root.
3. The blocks are that kind's instances in model order, outermost only.

Example:
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    >>> find_blocks(net)
    ['0', '2']
"""

from __future__ import annotations

from collections import defaultdict

from torch import nn

_CONTAINERS = (nn.ModuleList, nn.Sequential)


def find_blocks(model: nn.Module) -> list[str]:
    """The qualified names of ``model``'s blocks in model order (see the module rule).

    Returns an empty list when no kind of module repeats inside a container.
    """
    kinds: dict[tuple, list[str]] = defaultdict(list)
    modules = dict(model.named_modules())
    for name, container in modules.items():
        if not isinstance(container, _CONTAINERS):
            continue
        for child_name, child in container.named_children():
            if _numel(child):
                kinds[_kind(child)].append(f"{name}.{child_name}" if name else child_name)
    repeated = {kind: names for kind, names in kinds.items() if len(names) >= 2}
    if not repeated:
        return []

    def score(kind: tuple) -> tuple[int, int, int]:
        names = repeated[kind]
        total = sum(_numel(modules[n]) for n in names)
        return total, len(names), -min(n.count(".") for n in names)

    best = max(repeated, key=score)
    picked: list[str] = []
    for name in repeated[best]:  # named_modules order is model order
        if not any(name.startswith(p + ".") for p in picked):
            picked.append(name)
    return picked


def describe_blocks(model: nn.Module, names: list[str]) -> str:
    """``"8 x BasicBlock: layer1.0, layer1.1, ..."`` for a log line."""
    if not names:
        return "none"
    modules = dict(model.named_modules())
    kinds = sorted({type(modules[n]).__name__ for n in names})
    shown = ", ".join(names[:8]) + (" ..." if len(names) > 8 else "")
    return f"{len(names)} x {'/'.join(kinds)}: {shown}"


def _kind(module: nn.Module) -> tuple:
    if isinstance(module, _CONTAINERS):
        return (type(module).__name__, *(type(c).__name__ for c in module.children()))
    return (type(module).__name__,)


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
