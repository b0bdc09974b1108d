#!/usr/bin/env bash
# Issue 17 on the H200 machine: train.batch_per_device=auto against batch 64, 3 epochs each of yolov8s at 640 px on
# the benchmark data (shapes_bench), each with and without PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, then the
# GPU tests of the auto batch. Prints per run the chosen batch, the peak GPU memory (torch's reserved and allocated,
# NVML's), the allocator's retries and the steady-state images/s, from summary.json.
# Usage: bash docs/benchmarks/h200-auto-batch/run.sh OUT_DIR
set -uo pipefail
out=$1
mkdir -p "$out"
export DDP_LAUNCH_CACHE=/tmp/ddp-launch-cache PYTHONUNBUFFERED=1
run() {  # name, the batch setting, then PYTORCH_CUDA_ALLOC_CONF (empty: unset)
  local name=$1 batch=$2 alloc=${3:-} start=$(date +%s)
  echo "===== $name =====" >> "$out/train.log"
  env ${alloc:+PYTORCH_CUDA_ALLOC_CONF=$alloc} \
  ddp-launch gpus=1 model=yolov8s train.imgsz=640 train.batch_per_device=$batch train.epochs=3 data=shapes_bench \
    hydra.run.dir=/tmp/auto-batch-$name >> "$out/train.log" 2>&1
  echo "$name: exit $? in $(( $(date +%s) - start )) s"
  cp /tmp/auto-batch-$name/summary.json "$out/$name.json" 2>/dev/null
  cp /tmp/auto-batch-$name/logs/rank0.log "$out/$name.rank0.log" 2>/dev/null
  python3 - "$out/$name.json" <<'PY'
import json, sys
try:
    s = json.load(open(sys.argv[1]))
except OSError:
    sys.exit("  no summary.json")
a = s.get("auto_batch") or {}
ips = s["images_per_s"]
print(f"  batch {s['batch_per_device']}, global {s['global_batch']}, lr0 {s['lr0']:.4g}; peak reserved "
      f"{s['memory_peak_reserved_gib']:.1f} GiB ({100 * s['memory_peak_reserved_gib'] / s['memory_total_gib']:.0f} % of "
      f"{s['memory_total_gib']:.1f}), allocated {s['memory_peak_allocated_gib']:.1f}, NVML {s['memory_peak_gib']} GiB; "
      + (f"{ips:.0f} images/s" if ips else f"images/s: too few steps ({s['steps_measured']} measured)"))
print(f"  allocator retries {s.get('memory_alloc_retries')}; reserved after each set-up part: "
      + ", ".join(f"{p['part']} {p.get('reserved_gib')}" for p in (s.get("timeline") or {}).get("setup", [])))
if a:
    print(f"  why: {a['memory_per_image_mib']} MiB per image + {a['fixed_mib']} MiB fixed, limit {a['limit_gib']} GiB "
          f"of {a['total_gib']} GiB, held to {a.get('held_gib')} GiB; measured " + ", ".join(f"{c['batch']}: {c['peak_gib']}" for c in a["candidates"]))
PY
}
run auto auto
python3 -m pytest -m gpu tests -k auto -q -s 2>&1 | tee "$out/gpu-tests.log" | tail -15
run auto-expandable auto expandable_segments:True
run batch64 64
run batch64-expandable 64 expandable_segments:True
