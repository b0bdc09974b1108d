"""ddp-bench: what N devices buy, single vs DataParallel vs DDP, measured side by side in one invocation."""
