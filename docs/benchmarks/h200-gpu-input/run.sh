#!/usr/bin/env bash
# Issue 13 on the H200 machine, in one invocation: the GPU input pipeline's own cost (profile_input.py), then
# ddp-bench with the input on the GPU and on the CPU (one invocation each: bench.variants) beside Ultralytics'
# trainer at 640 px, the same two confined to 4 cores, the same two at 320 px, and the shipped default on 16 cores
# again (the spread).
# Usage: bash docs/benchmarks/h200-gpu-input/run.sh OUT_DIR [STEPS]
set -uo pipefail
out=$1; steps=${2:-60}
mkdir -p "$out"
export DDP_LAUNCH_CACHE=/tmp/ddp-launch-cache PYTHONUNBUFFERED=1
cell() {  # name, then the command's words; imgsz=N before it for another image size
  local name=$1; shift
  local bench="model=yolov8s train.imgsz=${imgsz:-640} train.batch_per_device=64 bench.sizes=[1] bench.modes=[ddp] bench.warmup_steps=15 bench.steps=$steps"
  local start=$(date +%s)
  echo "===== $name =====" >> "$out/bench.log"
  "$@" $bench hydra.run.dir=/tmp/bench-$name >> "$out/bench.log" 2>&1
  echo "$name: exit $? in $(( $(date +%s) - start )) s"
  cp /tmp/bench-$name/bench.json "$out/$name.json" 2>/dev/null
  cp /tmp/bench-$name/bench.md "$out/$name.md" 2>/dev/null
  grep -E "^\| (ultralytics|ddp) x1" /tmp/bench-$name/bench.md
}
python3 docs/benchmarks/h200-gpu-input/profile_input.py "$out" > "$out/profile.log" 2>&1; echo "profile: exit $?"
both='bench.variants={gpu:["loader.augment_on=gpu"],cpu:["loader.augment_on=cpu"]}'
cell gpu-cpu-ultralytics ddp-bench bench.baseline=ultralytics "$both"
cell gpu-cpu-4-cores taskset -c 0-3 ddp-bench "$both"
imgsz=320 cell gpu-cpu-320px ddp-bench "$both"
cell default-16-cores ddp-bench
