#!/usr/bin/env bash
# ab_switches.sh [ROUNDS] [OUT_DIR]: this checkout's start-up three ways, alternately, ROUNDS rounds (default 3), all
# with one bytecode folder compiled by a first run: "cold", torchrun started once the plan is made
# (DDP_LAUNCH_WARM_START=0); "fresh", the warm torchrun starting the ranks as fresh interpreters
# (DDP_LAUNCH_FORK_RANKS=0); "forked", the defaults (ranks forked from the warm torchrun). RUN_ARGS replaces the
# run's overrides as in ab.sh, e.g. on the GPU machine:
#   RUN_ARGS="gpus=1 data=shapes train.epochs=1" bash ab_switches.sh 3
# Prints each run's time from the command to the first step and the timeline's parts, and how its rank started.
set -euo pipefail
rounds=${1:-3}
here=$(git rev-parse --show-toplevel 2>/dev/null || pwd); work=${2:-$(mktemp -d /tmp/fresh-start-XXXX)}
mkdir -p "$work"
python=$(command -v python)
read -r -a args <<< "${RUN_ARGS:-gpus=0 train.epochs=1 train.imgsz=64 data.synthetic.train_images=64 data.synthetic.val_images=16}"

one() {  # one NAME [VAR=VALUE]
  local out=$work/$1
  (cd "$here" && env "${@:2}" PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" "$python" -m launcher.cli "${args[@]}" \
    paths.cache="$work/cache" paths.bytecode="$work/bytecode" hydra.run.dir="$out" > "$work/$1.log" 2>&1)
  "$python" "$here/docs/benchmarks/cpu-fresh-start/first_step.py" "$out/summary.json" "$1"
  echo "           rank 0: $(head -1 "$out/logs/rank0.log")"
}

one prime > /dev/null  # the dataset generated and the bytecode compiled once
for r in $(seq 1 "$rounds"); do
  one "cold-$r" DDP_LAUNCH_WARM_START=0
  one "fresh-$r" DDP_LAUNCH_FORK_RANKS=0
  one "forked-$r"
done
