"""The training loop and what it needs: optimizer, checkpoints, callbacks, seeding."""
