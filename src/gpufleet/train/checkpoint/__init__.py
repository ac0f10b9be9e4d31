"""Checkpoints and the run directory: the file formats (single file and sharded), the
Checkpointer, background writes, keeping, migration and the run lock."""
