"""The GPU input's loader alone, and nvJPEG's batched decode from four memory layouts (issue 13, 2026-12-04).

    python3 docs/benchmarks/h200-gpu-input/loader_probe.py BUILD_DIR   # BUILD_DIR: a checkout of ddp-launch

Generates 512 textured 640x480 JPEGs under /tmp/probe-data (no test uses them), then:
- the loader as training builds it (EncodedTrainDataset, 4 workers, prefetch 4, pinned batches), 60 batches of 64:
  images/s and the training process's CPU time per batch, without and with a synchronised batched decode;
- one batch of 64 decoded on an idle GPU from separate or packed, pageable or pinned tensors (20 decodes each);
- pinning a batch's bytes as one tensor against 64.
Run it once per build (the build before the packed batches, then this one) to compare them.
"""
import sys, time, glob, os
sys.path.insert(0, sys.argv[1])
import numpy as np, torch
from pathlib import Path
from torchvision.io import decode_jpeg, ImageReadMode
from launcher.inputs.shapes import ShapesSpec, ensure_dataset
from launcher.rank.data.encoded import EncodedTrainDataset, EncodedImages
y = ensure_dataset(Path("/tmp/probe-data"), ShapesSpec(train_images=512, val_images=8, width=640, height=480, max_objects=7, texture=True), log=lambda m: None)
files = sorted(glob.glob(str(y.parent / "images/train/*.jpg")))
n = len(files)
imgs = EncodedImages(files, np.zeros(n, np.float32), np.full((n, 4), 0.5, np.float32), np.arange(n + 1, dtype=np.int64))
ds = EncodedTrainDataset(imgs)
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
decode_jpeg([torch.frombuffer(bytearray(open(files[0], "rb").read()), dtype=torch.uint8)] * 64, device=dev)
who = os.path.basename(os.path.abspath(sys.argv[1]))
for decode in (False, True, False, True):
    sampler = [[(0, (b * 64 + j) % n) for j in range(64)] for b in range(60)]
    dl = torch.utils.data.DataLoader(ds, batch_sampler=sampler, num_workers=4, collate_fn=ds.collate_fn, prefetch_factor=4, pin_memory=True)
    it = iter(dl); next(it)
    t = time.perf_counter(); c = time.process_time(); k = 0; dec = 0.0
    for b in it:
        k += 1
        if decode:
            s = time.perf_counter()
            out = decode_jpeg(b.payloads, mode=ImageReadMode.RGB, device=dev); torch.cuda.synchronize()
            dec += time.perf_counter() - s
    dt = time.perf_counter() - t
    print(f"{who} loader{'+decode' if decode else ''}: {k*64/dt:.0f} img/s, main CPU {1000*(time.process_time()-c)/k:.2f} ms/batch, decode {1000*dec/k:.2f} ms/batch", flush=True)
# decode of one batch from four layouts, idle GPU
raw = [open(f, "rb").read() for f in files[:64]]
sep = [torch.frombuffer(bytearray(r), dtype=torch.uint8) for r in raw]
packed = torch.cat(sep); offs = np.cumsum([0] + [len(r) for r in raw])
views = lambda t: [t[offs[i]:offs[i + 1]] for i in range(64)]
forms = {"separate pageable": sep, "separate pinned": [s.pin_memory() for s in sep], "packed pageable": views(packed), "packed pinned": views(packed.pin_memory())}
for rep in range(2):
    for name, data in forms.items():
        torch.cuda.synchronize(); s = time.perf_counter()
        for _ in range(20):
            decode_jpeg(data, mode=ImageReadMode.RGB, device=dev)
        torch.cuda.synchronize()
        print(f"{who} decode {name}: {1000*(time.perf_counter()-s)/20:.2f} ms/batch", flush=True)
s = time.perf_counter()
for _ in range(20): packed.pin_memory()
print(f"{who} pin 7.7 MB: {1000*(time.perf_counter()-s)/20:.2f} ms; 64 separate: ", end="")
s = time.perf_counter()
for _ in range(20): [x.pin_memory() for x in sep]
print(f"{1000*(time.perf_counter()-s)/20:.2f} ms", flush=True)
