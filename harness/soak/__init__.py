"""The soak run (run.py) and its parts: config, load, faults, monitor, records, report."""
