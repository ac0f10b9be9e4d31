"""The non-finite step guard: a step whose gradients or loss are not finite is skipped
and recorded."""
