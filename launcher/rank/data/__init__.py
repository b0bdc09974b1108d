"""A rank's input on the host: the sampler, the DataLoader pipeline with fetch-ahead, core binding, the node-shared
image cache, the collated batch (raw_batch.py), and the GPU input's CPU half (the workers' bytes: encoded.py; the
decoders: torchvision_ops.py). The GPU input itself is rank/gpu_data/."""
