"""What a rank runs over its components: a training run or a ddp-bench cell, each a hook list in one place (runs.py),
and the hooks around a step (hooks.py; progress.py, the progress line; train_batches.py, train_batch<N>.jpg)."""
