"""Hand-written Triton kernels with their PyTorch twins: the network's layers (kernels.py: bias and SiLU, nearest
upsampling, channel concatenation; batchnorm_silu.py: the Conv blocks' training BatchNorm and SiLU as one function),
the validation's sequential scans (scans.py: NMS and matching), and the one rule for where Triton runs
(triton_use.py). Nothing here imports another room of the rank."""
