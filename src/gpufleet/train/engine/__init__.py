"""Building and stepping one rank's run: the Run, its build, its monitors, the log
interval, the callbacks' view and the result."""
