"""Fault handling: the stall watchdog."""
