"""Facts about this node: its GPUs, cores and process-group backends, and which TCP ports are free."""
