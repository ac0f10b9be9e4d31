"""GPU memory sizes the planner checks a layout against.

``--gpu`` names a device as ``<model>-<memory>`` (``h100-80gb``) or a plain number of
GiB (``80``). The usable share is less than the card's size: the CUDA context, the NCCL
buffers and the caching allocator's fragmentation take their part, so a layout is said
to fit when its estimate stays under :data:`USABLE_SHARE` of the memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpufleet.errors import ConfigError, unknown_choice
from gpufleet.resolve import auto_precision

GIB = 1024**3

#: Memory in GiB as the vendors' datasheets state it (80 GB HBM3 is reported by the
#: driver as about 79.6 GiB; the datasheet figure is kept, the usable share covers it).
GPU_MEMORY_GIB: dict[str, float] = {
    "h200-141gb": 141, "h100-94gb": 94, "h100-80gb": 80, "a100-80gb": 80,
    "a100-40gb": 40, "l40s-48gb": 48, "a10g-24gb": 24, "a10-24gb": 24, "l4-24gb": 24,
    "rtx4090-24gb": 24, "rtx3090-24gb": 24, "v100-32gb": 32, "v100-16gb": 16,
    "t4-16gb": 16,
}

#: Named GPUs without bfloat16 tensor cores (before Ampere): precision "auto" runs fp32.
NO_BF16 = frozenset({"v100-32gb", "v100-16gb", "t4-16gb"})

#: Share of a GPU's memory a training process can count on (context, NCCL buffers and
#: allocator fragmentation take the rest; 0.9 is the usual planning margin).
USABLE_SHARE = 0.9


@dataclass(frozen=True)
class Device:
    """A GPU the plan is checked against.

    Attributes:
        name: as given (``h100-80gb``), or ``"<N> GiB"``.
        memory_bytes: the card's memory.
        bf16: it has bfloat16 tensor cores (a size alone is taken to be a recent GPU).
    """

    name: str
    memory_bytes: int
    bf16: bool = True

    def precision(self, mode: str, preset: str = "gpt") -> str:
        """``precision.mode`` as a run on this GPU resolves it for the recipe ``preset``
        (:func:`gpufleet.resolve.auto_precision`): ``auto`` is bf16-mixed for the built-in
        GPT where the GPU has bfloat16, else fp32.

        Example:
            >>> [named_device(g).precision("auto") for g in ("h100-80gb", "t4-16gb")]
            ['bf16-mixed', 'fp32']
            >>> named_device("h100-80gb").precision("auto", preset="none")
            'fp32'
        """
        if mode == "bf16-mixed" and not self.bf16:
            raise ConfigError(f"precision.mode = 'bf16-mixed' on {self.name}, which has no "
                              "bf16 support (a run there is refused too). Plan fp16-mixed "
                              "or fp32.")
        if mode != "auto":
            return mode
        return auto_precision(preset, "cuda", self.bf16)

    @property
    def usable_bytes(self) -> int:
        """What a layout may use: :data:`USABLE_SHARE` of the memory."""
        return int(self.memory_bytes * USABLE_SHARE)


def named_device(text: str) -> Device:
    """The device ``--gpu`` names.

    Example:
        >>> named_device("h100-80gb").memory_bytes // GIB
        80
        >>> named_device("24").name
        '24 GiB'
    """
    key = text.strip().lower()
    if key in GPU_MEMORY_GIB:
        return Device(key, int(GPU_MEMORY_GIB[key] * GIB), bf16=key not in NO_BF16)
    try:
        gib = float(key.removesuffix("gib").removesuffix("gb"))
    except ValueError:
        raise ConfigError(unknown_choice("--gpu", text, GPU_MEMORY_GIB,
                                         "Or give the memory in GiB, e.g. --gpu 80.")) from None
    if gib <= 0:
        raise ConfigError(f"--gpu {text}: the memory must be a positive number of GiB.")
    return Device(f"{gib:g} GiB", int(gib * GIB))
