"""The rank's side of the start-up overlap: nvJPEG started on a thread beside the set-up (prewarm.py), and a rank
forked from the warm torchrun made into a fresh one (forked_start.py). The launch side's twin is launcher/launch/
(warm_torchrun.py, rank_fork.py, bytecode.py, parent_death.py)."""
