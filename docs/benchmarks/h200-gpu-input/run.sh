#!/usr/bin/env bash
# Issue 13 on the H200 machine, in one invocation: the GPU input pipeline's own cost (profile_input.py), then
# ddp-bench's shipped-defaults cell with the input on the GPU and on the CPU (one invocation: bench.variants) beside
# Ultralytics' trainer, then the GPU-input cell confined to 4 cores and the 16-core cell again (the spread).
# Usage: bash docs/benchmarks/h200-gpu-input/run.sh OUT_DIR [STEPS]
set -uo pipefail
out=$1; steps=${2:-60}
mkdir -p "$out"
export DDP_LAUNCH_CACHE=/tmp/ddp-launch-cache PYTHONUNBUFFERED=1
bench="model=yolov8s train.imgsz=640 train.batch_per_device=64 bench.sizes=[1] bench.modes=[ddp] bench.warmup_steps=15 bench.steps=$steps"
cell() {  # name, then the command's words
  local name=$1; shift
  local start=$(date +%s)
  echo "===== $name =====" >> "$out/bench.log"
  "$@" $bench hydra.run.dir=/tmp/bench-$name >> "$out/bench.log" 2>&1
  echo "$name: exit $? in $(( $(date +%s) - start )) s"
  cp /tmp/bench-$name/bench.json "$out/$name.json" 2>/dev/null
  cp /tmp/bench-$name/bench.md "$out/$name.md" 2>/dev/null
  grep -E "^\| (ultralytics|ddp) x1" /tmp/bench-$name/bench.md
}
python3 docs/benchmarks/h200-gpu-input/profile_input.py "$out" > "$out/profile.log" 2>&1; echo "profile: exit $?"
cell gpu-cpu-ultralytics ddp-bench bench.baseline=ultralytics 'bench.variants={gpu:["loader.augment_on=gpu"],cpu:["loader.augment_on=cpu"]}'
cell gpu-4-cores taskset -c 0-3 ddp-bench
cell gpu-16-cores ddp-bench
