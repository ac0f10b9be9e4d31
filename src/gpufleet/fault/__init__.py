"""Surviving faults: agreed non-finite step skipping, the hang watchdog, crash reports
and the NCCL settings that make failures visible."""
