"""Built-in models."""

from gpufleet.models.gpt import GPT, GPTConfig, build_gpt

__all__ = ["GPT", "GPTConfig", "build_gpt"]
