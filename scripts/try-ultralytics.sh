#!/usr/bin/env bash
# Try an Ultralytics release with ddp-launch: installs that release alone (no dependencies: this environment's torch
# and the rest stay) into a scratch folder under /tmp, puts it first on the path, and runs the tests of every reach
# rank/ultralytics/ makes into Ultralytics' internals (python -m tests.ultralytics_release_check), printing which
# reach broke; --train also trains 2 ranks on the CPU for an epoch. Nothing of the environment is changed.
#   scripts/try-ultralytics.sh 8.4.191            # the reach tests
#   scripts/try-ultralytics.sh 8.4.191 --train    # and a short real run
# Run it from a checkout, in the environment ddp-launch is installed in with its test extras (pip install -e '.[dev]').
# When a release passes, widen the window: NEWEST_VERSION (or OLDEST_VERSION) in launcher/inputs/ultralytics_files.py
# and the range in pyproject.toml; a difference the adapter must follow goes in launcher/rank/ultralytics/releases.py.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: scripts/try-ultralytics.sh VERSION [--train]}
train=${2:-}
target=${DDP_LAUNCH_TRY_DIR:-/tmp/ddp-launch-ultralytics/$version}

if [ ! -f "$target/ultralytics/__init__.py" ]; then
    rm -rf "$target" && mkdir -p "$target.wheel"
    python -m pip download --quiet --no-deps "ultralytics==$version" -d "$target.wheel"
    python -m pip install --quiet --no-deps --no-compile --target "$target" "$target.wheel"/ultralytics-*.whl
    rm -rf "$target.wheel" "$target/tests"  # some releases ship a top-level `tests` that would hide ddp-launch's
fi
export PYTHONPATH="$target:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export DDP_LAUNCH_ALLOW_ULTRALYTICS=${DDP_LAUNCH_ALLOW_ULTRALYTICS:-1}  # a release outside the window is the point
echo "ultralytics $(python -c 'import importlib.metadata as m; print(m.version("ultralytics"))') from $target"

status=0
python -m tests.ultralytics_release_check || status=$?
if [ "$train" = "--train" ]; then
    run=$(mktemp -d /tmp/ddp-launch-try-XXXXXX)
    if (cd "$run" && ddp-launch gpus=0 nproc=2 train.epochs=1 train.imgsz=64 train.batch_per_device=8 \
            train.close_mosaic=0 data.synthetic.train_images=32 data.synthetic.val_images=8 \
            data.synthetic.width=96 data.synthetic.height=96 paths.cache="$run/cache" > "$run/console.txt" 2>&1); then
        echo "ultralytics $version: a 2-rank CPU training of one epoch finished (console: $run/console.txt)"
    else
        tail -n 30 "$run/console.txt"
        echo "ultralytics $version: the 2-rank CPU training failed (console: $run/console.txt)"
        status=1
    fi
fi
exit $status
