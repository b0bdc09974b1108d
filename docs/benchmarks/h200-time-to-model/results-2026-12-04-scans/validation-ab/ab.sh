#!/usr/bin/env bash
# The validation and end-of-run A/B of the twelfth session, on one machine in one call: the build before (OLD_TREE:
# `git archive 703d9f1 launcher conf pyproject.toml | tar -x -C OLD_TREE`) and the working tree, alternately, twice,
# each a 3-epoch yolov8s run on the time-to-model data (close_mosaic 1, so that best.pt is an earlier epoch's and
# the final validation and the stripping of best.pt run too). Prints each run's per-epoch training and validation
# seconds and its end (final validation, final weights) from summary.json, and its rank log's validation lines.
# Usage, from the repository root, with ddp-launch installed: bash .../ab.sh OUT_DIR OLD_TREE
set -u
out=$1 old=$(cd "$2" && pwd)
export DDP_LAUNCH_CACHE=/tmp/ddp-launch-cache PYTHONUNBUFFERED=1
args="gpus=1 model=yolov8s model.cfg=yolov8s.yaml model.weights=null data=shapes_time_to_model train.imgsz=640
  train.epochs=3 train.batch_per_device=64 train.close_mosaic=1 train.val_interval=1 optim.name=sgd optim.base_lr=0.01
  seed=0 paths.cache=/tmp/ddp-launch-cache"
mkdir -p "$out"
for round in 1 2; do
  for side in old new; do
    dir=$PWD pp=${PYTHONPATH:-}
    [ $side = old ] && dir=$old pp=$old:${PYTHONPATH:-}
    (cd "$dir" && PYTHONPATH=$pp python3 -m launcher.cli $args hydra.run.dir=/tmp/run-$side-$round \
      > "$out/console-$side-$round.log" 2>&1)
    echo "$side round $round: exit $?"
    python3 - /tmp/run-$side-$round/summary.json <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
tl = s["timeline"]; st = tl["stamps"]
print("  end parts: final val", round(st["final_val_end"] - st["final_val_start"], 3), "weights",
      round(st["weights_end"] - st["weights_start"], 3), "map50-95", s["map50_95"])
for e in tl["epochs"]:
    print("  epoch", e["epoch"], "train", round(e["train_end"] - e["train_start"], 3), "val",
          round(e.get("val_end", 0) - e.get("val_start", 0), 3))
PY
    grep -h "validation:" /tmp/run-$side-$round/logs/rank0.log
    cp /tmp/run-$side-$round/logs/rank0.log "$out/rank0-$side-$round.log"
  done
done
