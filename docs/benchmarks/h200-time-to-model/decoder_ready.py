"""How long a rank waits before it can decode its first batch: torchvision's image operators loaded alone
(launcher/rank/data/torchvision_ops.py) against `import torchvision.io`, each in a fresh process after the rank's own
imports.

    python3 docs/benchmarks/h200-time-to-model/decoder_ready.py ops
    python3 docs/benchmarks/h200-time-to-model/decoder_ready.py torchvision

Run alternately, twice each (results-2026-12-04-packed/decoder-ready.log has what the H200 machine printed).
"""

import sys
import time

t0 = time.perf_counter()
import launcher.rank.run.runs  # noqa: E402,F401 - the rank's imports
import torch  # noqa: E402

t1 = time.perf_counter()
torch.empty(1, device="cuda")
t2 = time.perf_counter()
if sys.argv[1] == "ops":
    from launcher.rank.data import torchvision_ops

    torchvision_ops.load()
    enc = torchvision_ops.encode_jpeg(torch.full((3, 480, 640), 114, dtype=torch.uint8))
    t3 = time.perf_counter()
    torchvision_ops.decode_jpegs_cuda([enc] * 64, torch.device("cuda", 0))
else:
    from torchvision.io import decode_jpeg, encode_jpeg

    enc = encode_jpeg(torch.full((3, 480, 640), 114, dtype=torch.uint8))
    t3 = time.perf_counter()
    decode_jpeg([enc] * 64, device="cuda")
torch.cuda.synchronize()
t4 = time.perf_counter()
print(f"{sys.argv[1]:12s} rank imports {t1 - t0:.2f} s, cuda {t2 - t1:.2f} s, decoder ready {t3 - t2:.3f} s, "
      f"first decode {t4 - t3:.2f} s; torchvision imported: {'torchvision' in sys.modules}")
