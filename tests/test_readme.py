"""The README's commands are a contract: each one is run here.

The main job (`ddp-launch`, no arguments) runs for real, exactly as written. Commands that train on the CPU run
for real too; commands that need GPUs or a dataset this machine lacks run as dry runs, which compose the config,
plan and validate (a dry run shows the plan and warns about what is missing here).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

from tests.conftest import REPO, ddp_launch, run_dir_of

README = (REPO / "README.md").read_text()
FRESH_MACHINE = re.findall(r"```bash\n(.+?)\n```", README)


def readme_commands(tool: str) -> list[str]:
    """Every `tool ...` command the README shows: in code blocks, and in `inline code` of the tables."""
    found = re.findall(rf"`({tool}(?: [^`]*)?)`", README)
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        for line in block.splitlines():
            line = line.strip()  # a block indented under a list item
            if line.startswith(f"{tool} ") or line == tool:
                found.append(line)
    return list(dict.fromkeys(found))


def needs_this_machine_lacks(cmd: str) -> bool:
    # launcher=slurm needs a cluster: its dry run prints the job script (tests/test_slurm_cluster.py submits for real);
    # data=my.yaml is the user's own data, trained at Ultralytics' 640 px for 100 epochs: planned here, with a stand-in
    return bool(re.search(r"gpus=[1-9]|device=\d", cmd)) or any(
        k in cmd for k in ("experiment=coco", "data=custom", "data=my.yaml", "launcher=slurm"))


def test_the_first_lines_are_the_two_fresh_machine_commands():
    install_and_run, install_and_test = FRESH_MACHINE[:2]
    assert install_and_run.endswith("&& ddp-launch") and "pip install ." in install_and_run
    assert install_and_test.endswith("&& pytest") and "pip install -e '.[dev]'" in install_and_test


def test_ci_runs_the_readme_test_command():
    ci = (REPO / ".ci" / "run").read_text()
    assert FRESH_MACHINE[1] in ci.splitlines()


@pytest.fixture(scope="module")
def main_job(tmp_path_factory, cache_dir):
    """The README's first command, as written: the built-in default."""
    command = FRESH_MACHINE[0].rsplit("&& ", 1)[1]
    assert command == "ddp-launch"
    result = ddp_launch(shlex.split(command)[1:], cwd=tmp_path_factory.mktemp("main-job"), timeout=1500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_the_main_job_runs_as_written(main_job):
    result = main_job
    summary = json.loads((run_dir_of(result) / "summary.json").read_text())
    assert summary["map50"] > 0.3  # it learned: the shapes are easy
    assert re.search(r"mAP50 0\.\d+\s+mAP50-95 0\.\d+", result.stdout)
    assert Path(summary["weights"]).is_file() and f"weights     {summary['weights']}" in result.stdout


@pytest.mark.parametrize("command", readme_commands("ddp-bench"))
def test_every_readme_benchmark_command(command, tmp_path, cache_dir):
    """On the CPU one runs for real (2 ranks, small enough) and its reports agree with each other; the GPU ones are
    dry runs: cells and their plans."""
    args = shlex.split(command)[1:]
    if "--help" in args:  # tests/test_help.py checks what it lists
        result = ddp_launch(args, cwd=tmp_path, timeout=120, tool="ddp-bench")
        assert result.returncode == 0 and result.stdout.startswith("ddp-bench: "), result.stdout + result.stderr
        return
    if "gpus=0" not in args:
        result = ddp_launch([*args, "dry_run=true"], cwd=tmp_path, timeout=300, tool="ddp-bench")
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert "dry run: nothing started" in result.stdout
        return
    out = tmp_path / "b"
    result = ddp_launch([*args, f"hydra.run.dir={out}"], cwd=tmp_path, timeout=900, tool="ddp-bench")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((out / "bench.json").read_text())
    md = (out / "bench.md").read_text()
    assert (out / "bench.png").stat().st_size > 0
    steps = int(next(a for a in args if a.startswith("bench.steps=")).split("=")[1])
    cells = {c["size"]: c for c in data["cells"]}
    assert set(cells) == {1, 2}
    for size, c in cells.items():
        assert c["images_per_s"] > 0 and c["efficiency"] == pytest.approx(c["speedup"] / size)
        assert c["steps_measured"] == steps  # the warm-up steps are not in the window
        row = next(line for line in md.splitlines() if line.startswith(f"| ddp x{size} |"))
        assert f"| {c['images_per_s']:.1f} |" in row and f"| {c['speedup']:.2f}x |" in row
        assert re.search(rf"\| {100 * c['efficiency']:.0f} % \|", row)
        assert c["verdict"] in row
    assert cells[1]["speedup"] == pytest.approx(1.0)
    assert data["environment"]["cpu_count"] >= 1 and "torch" in data["environment"]


# Commands run by another test, with more knobs: the test named runs the command's arguments first, as written.
RUN_ELSEWHERE = {
    "ddp-launch gpus=0 nproc=2 train.epochs=2": "tests/test_e2e_ddp.py",
    "ddp-launch -m dry_run=true seed=1,2,3": "tests/test_sweeps.py",
    "ddp-launch -m train.epochs=1 seed=1,2": "tests/test_sweeps.py",
    "ddp-launch log.integrations=[tensorboard]": "tests/test_tracking.py",
    "ddp-launch resume=RUN_DIR data.path=NEW": "tests/test_moved_runs.py",
    "ddp-launch gpus=0 nproc=2 model=yolov8n-seg.yaml train.epochs=2": "tests/test_e2e_tasks.py",
    "ddp-launch gpus=0 nproc=2 model=yolov8n-pose.yaml train.epochs=2": "tests/test_e2e_tasks.py",
    "ddp-launch gpus=0 nproc=2 model=yolov8n-obb.yaml train.epochs=2": "tests/test_e2e_tasks.py",
    "ddp-launch gpus=0 nproc=2 model=yolov8n-cls.yaml": "tests/test_e2e_tasks.py",
}


def test_the_commands_run_elsewhere_are_in_the_readme():
    assert set(RUN_ELSEWHERE) <= set(readme_commands("ddp-launch"))


@pytest.mark.slow
def test_resume_of_the_finished_main_job_says_so_and_exits_0(main_job, tmp_path):
    """`ddp-launch resume=RUN_DIR`, the README's placeholder made real: a finished run is not trained again."""
    run_dir = run_dir_of(main_job)
    before = (run_dir / "summary.json").read_text()
    result = ddp_launch([f"resume={run_dir}"], cwd=tmp_path, timeout=300)
    assert result.returncode == 0 and "already finished" in result.stdout, result.stdout + result.stderr
    assert (run_dir / "summary.json").read_text() == before


@pytest.mark.parametrize(
    "command",
    [c for c in readme_commands("ddp-launch") if c != "ddp-launch" and c not in RUN_ELSEWHERE and "resume=RUN_DIR" not in c],
)
def test_every_other_readme_command(command, tmp_path, cache_dir, checkpoint):
    args = shlex.split(command)[1:]
    if args[0].startswith("--"):  # --help, --version: tests/test_help.py and test_ultralytics_keys.py check them
        result = ddp_launch(args, cwd=tmp_path, timeout=120)
        assert result.returncode == 0 and result.stdout.startswith("ddp-launch"), result.stdout + result.stderr
        return
    if needs_this_machine_lacks(command):
        if "data=custom" in command:  # the README's placeholder path, made real
            args = [a for a in args if not a.startswith("data.path=")] + [f"data.path={_custom_yaml(tmp_path)}"]
        if "data=my.yaml" in command:  # the user's data and weights, in the current folder
            (tmp_path / "my.yaml").write_text(_custom_yaml(tmp_path).read_text().replace("path: .", "path: custom"))
            shutil.copy(checkpoint, tmp_path / "yolov8n.pt")
        args = [a for a in args if a != "dry_run=true"] + ["dry_run=true"]
        result = ddp_launch(args, cwd=tmp_path, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "dry run: nothing started" in result.stdout
        return
    tiny = [] if "dry_run=true" in args else ["train.imgsz=64", "data.synthetic.train_images=64", "data.synthetic.val_images=16"]
    result = ddp_launch(args + tiny, cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def _custom_yaml(tmp_path: Path) -> Path:
    root = tmp_path / "custom"
    for split in ("train", "val"):
        (root / "images" / split).mkdir(parents=True)
        (root / "images" / split / "a.jpg").write_bytes(b"")
    (root / "data.yaml").write_text("path: .\ntrain: images/train\nval: images/val\nnames: [thing]\n")
    return root / "data.yaml"
