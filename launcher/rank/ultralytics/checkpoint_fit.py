"""A run's checkpoints, opened and matched to its network before a resume starts any rank:
`python -m launcher.rank.ultralytics.checkpoint_fit RUN_DIR`.

The launcher never imports Ultralytics, so it runs this module as a subprocess (launch/resume_checkpoints.py). Each
of weights/last.pt, last.prev.pt and best.pt that exists is loaded as the ranks load it (checkpoint_io.load) and its
weights compared, tensor by tensor, with the network the ranks build for the run (build.network). It prints one JSON
object on its last line: {"last.pt": null, "last.prev.pt": "is unreadable (...)", ...}, null for a checkpoint that
would do; {"error": "..."} when the network itself cannot be built (the ranks will say why).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from launcher.plan.settings import Settings
from launcher.rank.loop.checkpoint_io import RESUME_KEY, CheckpointError, load, mismatch
from launcher.run_folder import RunFolder

FILES = ("last.pt", "last.prev.pt", "best.pt")


def weights_of(name: str, ckpt: dict) -> dict:
    """The state dict the ranks would load: last.pt's full-precision resume state, best.pt's EMA."""
    if name == "best.pt":
        return (ckpt.get("ema") or ckpt["model"]).float().state_dict()
    from launcher.rank.loop.state import upgrade

    return upgrade(ckpt)["model"]


def reason(name: str, path: Path, expected: dict | None) -> str | None:
    """Why `path` cannot be used (without its name), or None."""
    try:
        ckpt = load(path)
    except CheckpointError as e:
        return str(e).replace(f"checkpoint {path} ", "", 1)
    if name != "best.pt" and ckpt.get(RESUME_KEY) is None:
        return "holds no resume state (a finished run's final weights?)"
    return mismatch(expected, weights_of(name, ckpt)) if expected is not None else None


def network_weights(folder: RunFolder) -> dict:
    from launcher.rank.ultralytics import build

    cfg, plan = folder.load()
    settings = Settings.of(cfg)
    hyp = build.hyperparameters(settings, plan, folder.path, 0)
    net, _ = build.network(hyp, build.dataset_info(hyp), settings.model.weights)
    return net.state_dict()


def main(argv: list[str] | None = None) -> int:
    folder = RunFolder(Path((argv or sys.argv[1:])[0]))
    try:
        expected = network_weights(folder)
    except Exception as e:  # the checkpoints are still opened; the ranks report what the network lacks
        expected, error = None, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    else:
        error = None
    result = {name: reason(name, folder.weights / name, expected) for name in FILES if (folder.weights / name).exists()}
    print(json.dumps({**result, **({"error": error} if error else {})}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
