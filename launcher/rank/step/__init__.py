"""The training step: train_step, the optimizer and its schedule, CUDA graphs (the network's, graphed.py; the whole
step's, captured_step.py; the upsampling and the concatenations on Triton kernels inside them, triton_modules.py),
the batch probe (auto_batch.py), and the DDP/DataParallel/compile wrapping of what the step calls."""
