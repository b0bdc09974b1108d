#!/usr/bin/env bash
# Issue 13 on the H200 machine: nvJPEG's batched decode through ddp-launch's binding (loader.jpeg_decoder=nvjpeg,
# queued on the input's high-priority stream) against torchvision's decode_jpeg (its own normal-priority stream and a
# host wait per batch): the decode alone beside a busy GPU (decode_under_load.py), then run.sh's training cell with
# the two decoders as bench.variants beside Ultralytics' trainer, then the shipped default confined to 4 cores.
# Usage: bash docs/benchmarks/h200-gpu-input/decoder.sh OUT_DIR [STEPS]
set -uo pipefail
out=$1; steps=${2:-60}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
export DDP_LAUNCH_CACHE=/tmp/ddp-launch-cache PYTHONUNBUFFERED=1
python3 "$here/decode_under_load.py" "$out" > "$out/decode.log" 2>&1; echo "decode_under_load: exit $?"; cat "$out/decode.log"
cell() {  # name, then the command's words
  local name=$1; shift
  local bench="model=yolov8s train.imgsz=640 train.batch_per_device=64 bench.sizes=[1] bench.modes=[ddp] bench.warmup_steps=15 bench.steps=$steps"
  local start=$(date +%s)
  echo "===== $name =====" >> "$out/bench.log"
  "$@" $bench hydra.run.dir=/tmp/bench-$name >> "$out/bench.log" 2>&1
  echo "$name: exit $? in $(( $(date +%s) - start )) s"
  cp /tmp/bench-$name/bench.json "$out/$name.json" 2>/dev/null
  cp /tmp/bench-$name/bench.md "$out/$name.md" 2>/dev/null
  grep -E "^\| (ultralytics|ddp) x1" /tmp/bench-$name/bench.md
}
cell decoders-ultralytics ddp-bench data=shapes_bench bench.baseline=ultralytics \
  'bench.variants={nvjpeg:["loader.jpeg_decoder=nvjpeg"],torchvision:["loader.jpeg_decoder=torchvision"]}'
[ -z "${SKIP_4_CORES:-}" ] && cell default-4-cores taskset -c 0-3 ddp-bench data=shapes_bench
if [ -n "${STEP_STREAM_AB:-}" ]; then  # the experiment: the steps on a stream of their own (off the legacy default)
  DDP_LAUNCH_STEP_STREAM=1 cell step-stream ddp-bench data=shapes_bench \
    'bench.variants={nvjpeg:["loader.jpeg_decoder=nvjpeg"],torchvision:["loader.jpeg_decoder=torchvision"]}'
fi
