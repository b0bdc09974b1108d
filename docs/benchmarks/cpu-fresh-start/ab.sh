#!/usr/bin/env bash
# ab.sh OLD_COMMIT [ROUNDS] [COMPILED_ROUNDS]: a tiny CPU run's start-up with an empty bytecode folder, the build at
# OLD_COMMIT and this checkout alternately, ROUNDS rounds (default 3); then COMPILED_ROUNDS more (default 1) with
# each build's folder compiled. RUN_ARGS replaces the run's overrides (the tiny CPU run below), e.g. on the GPU
# machine: RUN_ARGS="gpus=1 data=shapes train.epochs=1" bash ab.sh OLD_COMMIT 3 3
# Prints the time from the command to the first step and the timeline's parts (summary.json). Run from the checkout,
# with the project installed (README).
set -euo pipefail
old=$1; rounds=${2:-3}; compiled=${3:-1}
here=$(git rev-parse --show-toplevel); work=$(mktemp -d /tmp/fresh-start-XXXX)
git -C "$here" worktree add -q "$work/old" "$old"
trap 'git -C "$here" worktree remove --force "$work/old"' EXIT
python=$(command -v python)
read -r -a args <<< "${RUN_ARGS:-gpus=0 train.epochs=1 train.imgsz=64 data.synthetic.train_images=64 data.synthetic.val_images=16}"

one() {  # one NAME ROOT BYTECODE_FOLDER
  local out=$work/$1
  (cd "$2" && PYTHONPATH="$2${PYTHONPATH:+:$PYTHONPATH}" "$python" -m launcher.cli "${args[@]}" \
    paths.cache="$work/cache" paths.bytecode="$3" hydra.run.dir="$out" > "$work/$1.log" 2>&1)
  "$python" "$here/docs/benchmarks/cpu-fresh-start/first_step.py" "$out/summary.json" "$1"
}

one prime "$here" "$work/bytecode-prime" > /dev/null  # the dataset, generated once
for r in $(seq 1 "$rounds"); do
  one "old-$r" "$work/old" "$work/bytecode-old-$r"
  one "new-$r" "$here" "$work/bytecode-new-$r"
done
for r in $(seq 1 "$compiled"); do
  one "old-compiled-$r" "$work/old" "$work/bytecode-old-1"
  one "new-compiled-$r" "$here" "$work/bytecode-new-1"
done
