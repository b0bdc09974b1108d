"""This rank among the others: its place and its process group (dist.py), the watchdog that names a hung rank
(heartbeat.py), stopping on a signal without losing work (signals.py), the tests' injected faults (faults.py), and
its own tagged lines (lines.py)."""
