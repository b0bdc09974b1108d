"""A rank's input: the sampler, the DataLoader pipeline with fetch-ahead, core binding, the node-shared image cache,
and the GPU augmentation with its CPU half (the workers' bytes: encoded.py; the decoders: torchvision_ops.py)."""
