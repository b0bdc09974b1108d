"""The launch side of the start-up overlap: torchrun started before the config is composed (warm_torchrun.py), its
ranks forked from it when nothing they read differs (rank_fork.py), the ranks' bytecode compiled beside it
(bytecode.py), and every helper process ended with the launcher (parent_death.py). The rank side's twin is
launcher/rank/startup/ (prewarm.py, forked_start.py)."""
