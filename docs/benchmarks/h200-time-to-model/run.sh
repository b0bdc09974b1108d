#!/usr/bin/env bash
# Issue 14 on the H200 machine: the time to a trained model, Ultralytics' own trainer against ddp-launch's defaults
# (ddp-bench +experiment=time_to_model: yolov8s, 640 px, batch 64, 10 epochs, validation after every epoch, seeds 0
# and 1, on 8,000 / 800 photo-like 640x480 JPEGs generated once under $DDP_LAUNCH_CACHE). Copies bench.json, bench.md,
# bench.png, the data YAML and every side's logs into OUT_DIR.
# Usage: bash docs/benchmarks/h200-time-to-model/run.sh OUT_DIR [--smoke] [OVERRIDE ...]
#   --smoke: 800 / 80 images, 2 epochs, one seed (a few minutes: the whole path, not the figures)
#   OVERRIDE: more ddp-bench overrides, e.g. bench.seeds=[0,1,2] or train.epochs=5
set -uo pipefail
out=$1; shift
smoke=()
if [ "${1:-}" = "--smoke" ]; then
  shift
  smoke=(data.synthetic.train_images=800 data.synthetic.val_images=80 train.epochs=2 train.close_mosaic=1 "bench.seeds=[0]")
fi
mkdir -p "$out"
export DDP_LAUNCH_CACHE=/tmp/ddp-launch-cache PYTHONUNBUFFERED=1
run=/tmp/bench-time-to-model-$(date +%s)
start=$(date +%s)
ddp-bench +experiment=time_to_model data=shapes_time_to_model "${smoke[@]}" "$@" hydra.run.dir="$run" \
  > "$out/bench.log" 2>&1
code=$?
echo "time_to_model: exit $code in $(( $(date +%s) - start )) s (run folder $run)"
cp "$run"/bench.json "$run"/bench.md "$run"/bench.png "$run"/data.yaml "$out"/ 2>/dev/null
for side in "$run"/*-seed*/; do
  name=$(basename "$side")
  mkdir -p "$out/$name"
  cp "$side"console.log "$out/$name/" 2>/dev/null
  cp "$side"run/summary.json "$side"run/results.csv "$side"run/logs/rank0.log "$out/$name/" 2>/dev/null
  cp "$side"result.json "$side"side.json "$side"ultralytics/results.csv "$out/$name/" 2>/dev/null
done
sed -n '/^| side/,/^Verdict/p' "$out/bench.md" 2>/dev/null
exit $code
