"""A fresh process's first batched nvJPEG decode against its second (issue 14: the first batch's part of the start-up).

One random 640x480 image encoded as a JPEG, decoded 64 at a time on the GPU with torchvision, as the training input
does. Usage: python first_decode.py [--warm] (prints the imports', CUDA's initialisation's and the decodes' times);
--warm: the rank's start-up warm-up (launcher/rank/prewarm.py) first, timed on its own.
"""

from __future__ import annotations

import time


def timed(fn) -> float:
    import torch

    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    import sys

    start = time.perf_counter()
    import torch

    imports = time.perf_counter() - start
    cuda_init = timed(lambda: torch.empty(1, device="cuda"))
    warm = ""
    if "--warm" in sys.argv:
        from launcher.rank.startup.prewarm import Prewarm

        begun = time.perf_counter()
        prewarm = Prewarm(torch.device("cuda", 0), decode_batch=64).start()
        begun = time.perf_counter() - begun
        prewarm.join()
        warm = f"warm-up: torchvision's import {begun:.2f} s, then a decode of 64 on a thread {prewarm.seconds:.2f} s, "
    start = time.perf_counter()
    from torchvision.io import decode_jpeg, encode_jpeg

    imports_tv = time.perf_counter() - start
    data = encode_jpeg((torch.rand(3, 480, 640) * 255).to(torch.uint8), quality=90)
    first = timed(lambda: decode_jpeg([data] * 64, device="cuda"))
    second = timed(lambda: decode_jpeg([data] * 64, device="cuda"))
    single = timed(lambda: decode_jpeg([data], device="cuda"))
    print(f"import torch {imports:.2f} s, cuda init {cuda_init:.2f} s, {warm}import torchvision.io {imports_tv:.2f} s, "
          f"first batched decode of 64 {first * 1e3:.0f} ms, "
          f"second {second * 1e3:.0f} ms, one image {single * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
