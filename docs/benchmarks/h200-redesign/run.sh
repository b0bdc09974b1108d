#!/usr/bin/env bash
# Issue 12 on the H200 machine: ddp-bench's shipped-defaults cell for the commit before the redesign (804ebd6, put in
# .oldcode/ with `git archive 804ebd6 launcher conf | tar -x -C .oldcode`) and for this tree, alternately, twice each,
# in one invocation of this script. Usage: bash docs/benchmarks/h200-redesign/run.sh OUT_DIR [STEPS]
set -uo pipefail
out=$1; steps=${2:-60}
mkdir -p "$out"
export DDP_LAUNCH_CACHE=/tmp/ddp-launch-cache PYTHONUNBUFFERED=1
bench="model=yolov8s train.imgsz=640 train.batch_per_device=64 bench.sizes=[1] bench.modes=[ddp] bench.baseline=ultralytics bench.warmup_steps=15 bench.steps=$steps"
for round in 1 2; do
  for code in old new; do
    root=$PWD; [ "$code" = old ] && root=$PWD/.oldcode
    dir=/tmp/bench-$code-$round
    start=$(date +%s)
    echo "===== $code round $round =====" >> "$out/bench.log"
    PYTHONPATH=$root:/tmp/site python3 -m launcher.bench.cli $bench hydra.run.dir=$dir >> "$out/bench.log" 2>&1
    echo "$code round $round: exit $? in $(( $(date +%s) - start )) s"
    cp "$dir/bench.json" "$out/$code-$round.json" 2>/dev/null
    grep -E "^\| (ultralytics|ddp) x1" "$dir/bench.md"
  done
done
