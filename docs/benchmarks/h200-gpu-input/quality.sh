#!/usr/bin/env bash
# Issue 13 on the H200 machine: mAP after the same epochs with the GPU input pipeline, the CPU pipeline and
# Ultralytics' own trainer, 3 seeds each, interleaved (seed by seed) in one invocation, on the benchmark dataset
# (conf/data/shapes_bench.yaml: 4,096 train / 256 val textured 640x480 JPEGs, generated on the machine).
# Usage: bash docs/benchmarks/h200-gpu-input/quality.sh OUT_DIR [EPOCHS] [IMGSZ] [SEEDS] [SIDES]
#   e.g. quality.sh OUT 8 320 "2" "cpu ultralytics" adds seed 2 of two sides to an earlier invocation's runs
set -uo pipefail
out=$1; epochs=${2:-10}; imgsz=${3:-320}; seeds=${4:-"0 1 2"}; sides=${5:-"gpu cpu ultralytics"}; close=3
mkdir -p "$out"
export DDP_LAUNCH_CACHE=/tmp/ddp-launch-cache PYTHONUNBUFFERED=1
here=$(dirname "$0")
common="data=shapes_bench model=yolov8s gpus=1 train.imgsz=$imgsz train.batch_per_device=64 train.epochs=$epochs train.close_mosaic=$close"
for seed in $seeds; do
  yaml=""
  for side in $sides; do
    [ "$side" = ultralytics ] && continue
    dir=/tmp/quality-$side-$seed
    ddp-launch $common seed=$seed loader.augment_on=$side hydra.run.dir=$dir > "$out/$side-$seed.log" 2>&1
    python3 -c "import json,sys; s=json.load(open('$dir/summary.json')); print(json.dumps({'side': '$side', 'seed': $seed, 'map50': s['map50'], 'map50_95': s['map50_95'], 'images_per_s': s.get('images_per_s')}))" | tee -a "$out/quality.jsonl"
    yaml=$dir/data.yaml  # the dataset as ddp-launch resolved it (the generated data YAML)
  done
  case " $sides " in *" ultralytics "*) ;; *) continue ;; esac
  [ -n "$yaml" ] || { ddp-launch $common seed=$seed train.epochs=1 hydra.run.dir=/tmp/quality-data > /dev/null 2>&1; yaml=/tmp/quality-data/data.yaml; }
  python3 "$here/ultralytics_train.py" "$yaml" /tmp/quality-ultralytics $seed $epochs $imgsz $close > "$out/ultralytics-$seed.log" 2>&1
  tail -1 "$out/ultralytics-$seed.log" | tee -a "$out/quality.jsonl"
done
