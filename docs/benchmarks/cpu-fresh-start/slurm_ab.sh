#!/usr/bin/env bash
# slurm_ab.sh [ROUNDS] [OUT_DIR]: the start-up of a SLURM job's ranks, forked from the node's warm torchrun (the
# default) against fresh interpreters (DDP_LAUNCH_FORK_RANKS=0, passed to the task through slurm.export), alternately,
# ROUNDS rounds (default 3), each a 1-epoch 2-rank CPU job on the local cluster (slurm/local-cluster.sh start; export
# SLURM_CONF as it says). slurm.setup stamps the task's start in the run folder, just before srun; prints each job's
# first step after it, with torchrun's hand-over, the rank's start and the end of its imports (summary.json).
set -euo pipefail
rounds=${1:-3}
work=${2:-$(mktemp -d /tmp/slurm-ab-XXXX)}
mkdir -p "$work"
: "${SLURM_CONF:?start the local cluster (slurm/local-cluster.sh start) and export SLURM_CONF}"
export DDP_LAUNCH_CACHE=${DDP_LAUNCH_CACHE:-$work/cache}

one() {  # one RUN_DIR FORK
  local d=$1
  DDP_LAUNCH_FORK_RANKS=$2 ddp-launch launcher=slurm gpus=0 nproc=2 slurm.cpus_per_task=2 train.epochs=1 \
    data.synthetic.train_images=64 data.synthetic.val_images=16 train.imgsz=64 train.batch_per_device=8 \
    "slurm.setup=[\"date +%s.%N > $d/task_start\"]" \
    "slurm.export=[PATH,HOME,USER,LOGNAME,LANG,LC_ALL,TZ,TMPDIR,DDP_LAUNCH_FORK_RANKS,DDP_LAUNCH_CACHE]" \
    hydra.run.dir="$d" > "$d.submit.log" 2>&1
  while squeue -h | grep -q .; do sleep 1; done
  python - "$d" <<'PY'
import json, pathlib, sys
d = pathlib.Path(sys.argv[1])
stamps = json.loads((d / "summary.json").read_text())["timeline"]["stamps"]
start = float((d / "task_start").read_text())
how = "forked" if "forked from torchrun" in (d / "logs" / "rank0.log").read_text().splitlines()[0] else "fresh"
print(f"{d.name:>10} ({how}): first step {stamps['first_step'] - start:.2f} s after the task's start; torchrun's "
      f"hand-over {stamps['torchrun_start'] - start:.2f} s, the rank's start {stamps['rank_start'] - start:.2f} s, "
      f"its imports done {stamps['imports_done'] - start:.2f} s")
PY
}

one "$work/prime" 1 > /dev/null  # the dataset generated once
for r in $(seq 1 "$rounds"); do
  one "$work/forked-$r" 1
  one "$work/fresh-$r" 0
done
