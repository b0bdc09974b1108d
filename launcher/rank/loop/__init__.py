"""The training loop and what it stands on: the loop and its hook protocol (loop.py), where training stands and the
checkpoint built from every component (state.py), and checkpoint files read defensively (checkpoint_io.py). The
hooks themselves live beside the runs that order them (rank/run/) and in metrics/."""
