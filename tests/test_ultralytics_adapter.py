"""Where rank/ultralytics/ re-states a rule of Ultralytics' trainer instead of calling it, the two agree: the optimizer's
parameter groups."""

from __future__ import annotations

import pytest

from tests.test_ddp_equivalence import make_model_and_batch


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_the_parameter_groups_are_ultralytics_own(name):
    """ddp-launch re-states BaseTrainer.build_optimizer's rule; here it is compared with Ultralytics' own."""
    from types import SimpleNamespace

    from ultralytics.engine.trainer import BaseTrainer

    from launcher.rank.ultralytics.build import optimizer

    model, _ = make_model_and_batch()
    ours = optimizer(model, name, lr=0.01, momentum=0.9, weight_decay=5e-4)
    stand_in = SimpleNamespace(args=SimpleNamespace(lr0=0.01), data={"nc": 3})
    theirs = BaseTrainer.build_optimizer(stand_in, model, name={"sgd": "SGD", "adamw": "AdamW"}[name], lr=0.01,
                                         momentum=0.9, decay=5e-4)
    assert type(ours) is type(theirs)
    keys = ("lr", "weight_decay", "param_group", "momentum", "nesterov", "betas")
    assert len(ours.param_groups) == len(theirs.param_groups) == 3
    for a, b in zip(ours.param_groups, theirs.param_groups):
        assert [id(p) for p in a["params"]] == [id(p) for p in b["params"]]
        assert {k: a.get(k) for k in keys} == {k: b.get(k) for k in keys}


def test_the_class_weights_are_ultralytics_own():
    """cls_pw > 0: inverse class frequency to that power, classes without labels at the mean, normalised to mean 1."""
    from types import SimpleNamespace

    import numpy as np
    from ultralytics.models.yolo.detect import DetectionTrainer

    from launcher.rank.ultralytics.build import class_weights

    labels = [{"cls": np.array([[0.0], [0.0], [2.0]])}, {"cls": np.array([[0.0], [3.0]])}]  # class 1 has none
    model, _ = make_model_and_batch()
    hyp = SimpleNamespace(cls_pw=0.5)
    class_weights(model, hyp, labels, nc=4)
    counts = np.bincount(np.concatenate([lb["cls"].flatten() for lb in labels]).astype(int), minlength=4).astype(np.float32)
    theirs = DetectionTrainer.compute_class_weights(SimpleNamespace(args=hyp), counts)
    np.testing.assert_allclose(model.class_weights.numpy(), theirs / theirs.mean(), rtol=1e-6)


SEED_CASES = [(0, 1, True), (1, 2, True), (0, 2, False)]  # (rank, world, deterministic)
SEED_STATE = """
import json, os, random, sys
from types import SimpleNamespace
import numpy as np, torch
ours, cases = sys.argv[1] == "1", json.loads(sys.argv[2])
states = []
for rank, world, deterministic in cases:  # one after another in this process, as the other side does them
    if ours:
        from launcher.rank.ultralytics.build import seed
        seed(SimpleNamespace(seed=7, deterministic=deterministic), rank, world)
    else:
        from ultralytics.utils.torch_utils import init_seeds
        init_seeds(7 + 1 + (rank if world > 1 else -1), deterministic=deterministic)
    states.append({
        "draws": [random.random(), float(np.random.rand()), float(torch.rand(1))],
        "algorithms": [torch.are_deterministic_algorithms_enabled(),
                       torch.is_deterministic_algorithms_warn_only_enabled()],
        "cudnn": torch.backends.cudnn.deterministic,
        "fill": torch.utils.deterministic.fill_uninitialized_memory,
        "env": [os.environ.get("CUBLAS_WORKSPACE_CONFIG"), os.environ.get("PYTHONHASHSEED")],
        "inductor_imported": "torch._inductor" in sys.modules,
    })
print(json.dumps(states))
"""


def test_the_seeds_and_deterministic_switches_are_ultralytics_own_without_importing_inductor():
    """build.seed re-states init_seeds: the same draws and switches, for rank 0 of 1, rank 1 of 2 and without the
    deterministic switches, without the import of torch._inductor that torch.use_deterministic_algorithms makes (1-2
    s of every rank's start-up). Each side in a fresh process, the cases one after another in it."""
    import json
    import subprocess
    import sys

    def states(ours: bool) -> list[dict]:
        args = [str(int(ours)), json.dumps(SEED_CASES)]
        out = subprocess.run([sys.executable, "-c", SEED_STATE, *args], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    ours, theirs = states(True), states(False)
    assert [s.pop("inductor_imported") for s in ours] == [False] * len(SEED_CASES)
    for s in theirs:
        s.pop("inductor_imported")
    assert ours == theirs
    assert [s["algorithms"] for s in ours] == [[d, d] for _, _, d in SEED_CASES]
    assert ours[0]["draws"] != ours[1]["draws"]  # another rank, other draws
