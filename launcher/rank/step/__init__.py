"""The training step: train_step, the optimizer and its schedule, CUDA graphs, and the DDP/DataParallel/compile
wrapping of what the step calls."""
