#!/usr/bin/env bash
# A/B: bd04ddb (.devdata/old) against the working tree, alternately, twice: 3-epoch yolov8s runs on the ttm data
set -u
t0=$(date +%s)
. .devdata/setup.sh
out=$OUT/ab; mkdir -p $out
old=$(cd .devdata/old && pwd)
args="gpus=1 model=yolov8s model.cfg=yolov8s.yaml model.weights=null data=shapes_time_to_model train.imgsz=640
  train.epochs=3 train.batch_per_device=64 train.close_mosaic=1 train.val_interval=1 optim.name=sgd optim.base_lr=0.01
  seed=0 paths.cache=/tmp/ddp-launch-cache"
for round in 1 2; do
  for side in new old; do
    dir=$PWD pp=${PYTHONPATH:-}
    [ $side = old ] && dir=$old pp=$old:${PYTHONPATH:-}
    s=$(date +%s)
    (cd "$dir" && PYTHONPATH=$pp timeout 150 python3 -m launcher.cli $args hydra.run.dir=/tmp/run-$side-$round > "$out/console-$side-$round.log" 2>&1)
    echo "$side round $round: exit $? in $(( $(date +%s) - s )) s"
    grep -h "step 125/125" /tmp/run-$side-$round/logs/rank0.log | sed 's/.*| \([0-9.]* img\/s, data wait [0-9]*%\).*GPU busy \([0-9]*%\).*/  \1 busy \2/'
    cp /tmp/run-$side-$round/logs/rank0.log "$out/rank0-$side-$round.log"
  done
  [ $(( $(date +%s) - t0 )) -gt 420 ] && break
done
echo "ab done at $(( $(date +%s) - t0 )) s"
