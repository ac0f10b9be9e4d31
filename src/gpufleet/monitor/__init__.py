"""Monitoring: metric sinks and the live display."""
