"""The build steps of the composition (rank/components.py), each a function that takes what it needs and returns
what it built: what the rank trains on (training_input.py), what it validates with (validation_build.py), what its
step calls (step_build.py), and the auto batch, measured on the same builders (batch_probe.py)."""
