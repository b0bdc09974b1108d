"""launcher=slurm without a cluster: the sbatch text (golden files), its quoting, the per-node torchrun command, the
plan's topology from slurm.*, and what `ddp-launch launcher=slurm` writes and prints.

Regenerate the golden files after an intended change with `DDP_LAUNCH_UPDATE_GOLDEN=1 pytest tests/test_slurm_script.py`
and read the diff.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import stat
import subprocess
from pathlib import Path

import pytest

from launcher.launch.environments import slurm
from launcher.launch.environments import slurm_job as job
from launcher.plan.plan import make_plan
from launcher.problems import PlanError
from tests.conftest import REPO, compose_config, ddp_launch

GOLDEN = REPO / "tests" / "golden"
PYTHON = "/opt/ddp-launch/bin/python"
ENV = {"OMP_NUM_THREADS": "4", "YOLO_OFFLINE": "1", "YOLO_CONFIG_DIR": "/cache/ultralytics"}
# Quotes of both kinds, blanks, a command separator, command substitutions, a comment sign, sbatch's % patterns.
HOSTILE = "it's \"x\"; $(touch PWNED) `touch PWNED` #1 %j"


def slurm_plan(overrides: list[str], settings: dict | None = None):
    """The planned config and plan for `launcher=slurm` plus overrides; `settings` replace slurm.* values directly
    (hostile strings need no Hydra quoting that way)."""
    cfg = compose_config(["launcher=slurm", *overrides])
    cfg["slurm"].update(settings or {})
    cfg = slurm.planning_config(cfg)
    plan, problems = make_plan(cfg, slurm.allocation_hardware(cfg))
    assert not problems, [p.message for p in problems]
    return cfg, plan


def script_for(overrides: list[str], run_dir: str, settings: dict | None = None, env=ENV) -> str:
    cfg, plan = slurm_plan(overrides, settings)
    return slurm.sbatch_script(cfg["slurm"], plan, Path(run_dir), env, PYTHON)


CASES = {  # name: (overrides, slurm.* values, run folder)
    "one_node": (["gpus=0", "nproc=2", "slurm.cpus_per_task=2"], {}, "/scratch/runs/2026-11-29/15-06-23"),
    "two_nodes_x4_gpus": (
        [
            "slurm.nodes=2",
            "slurm.gpus_per_node=4",
            "slurm.cpus_per_task=32",
            "slurm.partition=gpu",
            "slurm.account=vision",
            "slurm.qos=high",
            "slurm.constraint=a100|h100",
            "slurm.mem=256G",
            "slurm.time=12:00:00",
            "slurm.extra=['--exclusive','--mail-type=END']",
            "slurm.setup=['module load cuda/12.4']",
        ],
        {},
        "/scratch/runs/coco-2x4",
    ),
    "hostile": (
        ["gpus=1"],
        {"job_name": HOSTILE, "account": HOSTILE, "partition": "a b", "extra": ["--comment=" + HOSTILE]},
        f"/scratch/{HOSTILE}/run",
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_script_matches_its_golden_file_and_is_valid_bash(name, tmp_path):
    overrides, settings, run_dir = CASES[name]
    text = script_for(overrides, run_dir, settings)
    golden = GOLDEN / f"{name}.sbatch"
    if os.environ.get("DDP_LAUNCH_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()
    (tmp_path / "job.sbatch").write_text(text)
    check = subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def example_scripts() -> dict[str, str]:
    """slurm/README.md's table: example script -> the ddp-launch command that writes it."""
    text = (REPO / "slurm" / "README.md").read_text()
    return dict(re.findall(r"^\| `([\w-]+\.sbatch)` \| `(ddp-launch [^`]+)`", text, re.M))


def test_the_example_scripts_in_slurm_are_what_their_commands_write():
    examples = example_scripts()
    for name, command in examples.items():
        args = shlex.split(command)[1:]
        run_dir = next(a.split("=", 1)[1] for a in args if a.startswith("hydra.run.dir="))
        cfg, plan = slurm_plan([a for a in args if not a.startswith(("hydra.", "launcher="))])
        text = slurm.sbatch_script(cfg["slurm"], plan, Path(run_dir), plan.env, slurm.script_python(cfg["slurm"]))
        if os.environ.get("DDP_LAUNCH_UPDATE_GOLDEN"):
            (REPO / "slurm" / name).write_text(text)
        assert text == (REPO / "slurm" / name).read_text(), name
    assert examples and set(examples) == {p.name for p in (REPO / "slurm").glob("*.sbatch")}


def test_two_nodes_ask_for_both_nodes_and_four_gpus_each():
    text = (GOLDEN / "two_nodes_x4_gpus.sbatch").read_text()
    assert "#SBATCH --nodes=2\n" in text and "#SBATCH --gpus-per-node=4\n" in text
    assert "#SBATCH --ntasks-per-node=1\n" in text  # one launcher per node, torchrun starts the 4 ranks
    assert "--nodes=2 \\\n  --ntasks=2 \\\n  --ntasks-per-node=1" in text
    assert "\nmodule load cuda/12.4\n" in text  # setup lines run as written


def test_a_hostile_job_name_and_run_folder_stay_inert_when_the_script_runs(tmp_path):
    """Run the script with a stand-in srun: no substitution runs, and srun gets every value byte for byte."""
    run_dir = tmp_path / HOSTILE / "run"
    run_dir.mkdir(parents=True)
    env = {**ENV, "YOLO_CONFIG_DIR": str(tmp_path / HOSTILE / "cache")}
    script = tmp_path / "job.sbatch"
    script.write_text(script_for(["gpus=1"], str(run_dir), {"job_name": HOSTILE, "account": HOSTILE}, env))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_srun = bin_dir / "srun"
    fake_srun.write_text(
        '#!/bin/bash\nprintf "%s\\0" "$@" > "$SRUN_ARGS"\nprintf "%s" "$YOLO_CONFIG_DIR" > "$SRUN_ENV"\n'
    )
    fake_srun.chmod(fake_srun.stat().st_mode | stat.S_IXUSR)
    args_file, env_file = tmp_path / "srun.args", tmp_path / "srun.env"
    result = subprocess.run(
        ["bash", str(script)],
        cwd=tmp_path,
        env={"PATH": f"{bin_dir}:{os.environ['PATH']}", "SRUN_ARGS": str(args_file), "SRUN_ENV": str(env_file)},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert not list(tmp_path.rglob("PWNED")) and not (run_dir / "PWNED").exists()
    argv = args_file.read_text().split("\0")[:-1]
    assert argv[-4:] == [PYTHON, "-m", "launcher.launch.environments.slurm_job", str(run_dir)]
    assert env_file.read_text() == env["YOLO_CONFIG_DIR"]


def test_sbatch_quoting_keeps_what_sbatch_would_split_or_cut():
    assert slurm.sbatch_quote('a b"c\\d#e') == '"a b\\"c\\\\d#e"'
    with pytest.raises(ValueError):
        slurm.sbatch_quote("two\nlines")


def test_a_percent_in_the_run_folder_is_not_read_as_a_slurm_pattern():
    assert slurm.output_pattern(Path("/r/50%/slurm.out")) == "/r/50%%/slurm.out"
    assert slurm.output_pattern(Path("/r/a\\b%/slurm.out")) == "/r/a\\b%/slurm.out"  # a backslash turns patterns off


def srun_exports(text: str) -> list[str]:
    words = text[text.index("\nsrun ") :].split()
    return next(w for w in words if w.startswith("--export=")).removeprefix("--export=").split(",")


def test_only_the_allowlist_leaves_your_environment():
    cfg, plan = slurm_plan(["gpus=0"])
    text = slurm.sbatch_script(cfg["slurm"], plan, Path("/r"), ENV, PYTHON)
    sbatch_export = next(line for line in text.splitlines() if line.startswith("#SBATCH --export="))
    assert sbatch_export == "#SBATCH --export=" + ",".join(cfg["slurm"]["export"])
    assert set(srun_exports(text)) == set(cfg["slurm"]["export"]) | set(ENV)
    assert "ALL" not in sbatch_export.removeprefix("#SBATCH --export=").split(",") and "ALL" not in srun_exports(text)


# --- topology from slurm.* ------------------------------------------------------------------------------------
def test_the_plan_takes_nodes_and_gpus_per_node_from_slurm():
    cfg, plan = slurm_plan(["slurm.nodes=2", "slurm.gpus_per_node=4", "slurm.cpus_per_task=32"])
    assert (cfg["nnodes"], cfg["gpus"]) == (2, 4)
    assert (plan.nnodes, plan.nproc_per_node, plan.world_size, plan.backend) == (2, 4, 8, "nccl")
    assert plan.cpus_per_node == 32


def test_gpus_given_on_the_command_line_win_and_are_what_sbatch_asks_for():
    cfg, plan = slurm_plan(["gpus=0", "nproc=2", "slurm.gpus_per_node=8"])
    assert (cfg["slurm"]["gpus_per_node"], plan.device, plan.world_size) == (0, "cpu", 2)
    assert "--gpus-per-node" not in slurm.sbatch_script(cfg["slurm"], plan, Path("/r"), ENV, PYTHON)


@pytest.mark.parametrize(
    "override,message",
    [
        ("nnodes=3", "the node count is slurm.nodes"),
        ("node_rank=1", "decided in the job"),
        ("slurm.nodes=0", "slurm.nodes=0"),
        ("slurm.signal=B:USR1@90", "only to the batch shell"),
        ("slurm.signal=USR2@90", "checkpoints on USR1 or TERM"),
        ("slurm.extra=[exclusive]", "starting with '-'"),
        ("slurm.export=[PATH,'A B']", "environment variable name"),
        ("slurm.requeue=maybe", "expected true or false"),
    ],
)
def test_bad_slurm_settings_are_refused_with_the_key_to_change(override, message):
    with pytest.raises(PlanError) as e:
        slurm.planning_config(compose_config(["launcher=slurm", override]))
    assert message in str(e.value)


def test_a_line_break_in_a_directive_value_is_refused():
    cfg = compose_config(["launcher=slurm"])
    cfg["slurm"]["job_name"] = "a\n#!/bin/sh\nrm -rf ~"
    with pytest.raises(PlanError, match="line break"):
        slurm.planning_config(cfg)


# --- each node's torchrun command (two nodes cannot run here) ----------------------------------------------------
def two_node_env(node_id: int) -> dict[str, str]:
    return {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_NODEID": str(node_id), "SLURM_JOB_NODELIST": "gpu[07-08]"}


def test_each_node_of_a_two_node_job_joins_one_rendezvous_that_node_0_serves():
    _, plan = slurm_plan(["slurm.nodes=2", "slurm.gpus_per_node=4", "slurm.cpus_per_task=32"])
    node0, node1 = (job.node_torchrun_command(plan, Path("/r"), two_node_env(n), "gpu07", python=PYTHON) for n in (0, 1))
    assert node0 == [
        PYTHON, "-m", "torch.distributed.run",
        "--nnodes", "2",
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "gpu07:24242",
        "--rdzv-conf", "is_host=1,join_timeout=600,read_timeout=600",
        "--rdzv-id", "4242",
        "--nproc-per-node", "4",
        "--max-restarts", "0",
        "--monitor-interval", "1",
        "--module", "launcher.rank.worker", "/r",
    ]  # fmt: skip
    assert node1 == [w.replace("is_host=1", "is_host=0") for w in node0]  # same endpoint and id; node 1 connects


def test_the_nodes_of_a_job_join_within_dist_timeout_s_and_say_for_whom_they_wait():
    _, plan = slurm_plan(["slurm.nodes=2", "slurm.gpus_per_node=4", "dist.timeout_s=45"])
    cmd = job.node_torchrun_command(plan, Path("/r"), two_node_env(0), "gpu07")
    # c10d's join and its reach for node 0's store, not torchrun's 600 s
    assert cmd[cmd.index("--rdzv-conf") + 1] == "is_host=1,join_timeout=45,read_timeout=45"
    waiting, refusal = job.job_rendezvous_wait(plan, 0, "gpu07:24242", "4242")
    assert waiting == "waiting for node 1 of 2 at gpu07:24242 (at most dist.timeout_s=45 s)"
    assert refusal.startswith("ddp-launch: refused: node 1 of 2 did not join at gpu07:24242 within dist.timeout_s=45 s")
    assert "sacct -j 4242" in refusal
    waiting, _ = job.job_rendezvous_wait(plan, 1, "gpu07:24242", "4242")
    assert waiting == "node 1 of 2: waiting for node 0 at gpu07:24242 (at most dist.timeout_s=45 s)"


def test_an_explicit_master_port_replaces_the_job_port():
    _, plan = slurm_plan(["slurm.nodes=2", "slurm.gpus_per_node=4"])
    cmd = job.node_torchrun_command(plan, Path("/r"), two_node_env(0), "gpu07", port=29400)
    assert cmd[cmd.index("--rdzv-endpoint") + 1] == "gpu07:29400"


def test_one_node_lets_the_kernel_pick_the_port():
    _, plan = slurm_plan(["gpus=0", "nproc=2"])
    env = {"SLURM_JOB_ID": "7", "SLURM_NNODES": "1", "SLURM_NODEID": "0"}
    cmd = job.node_torchrun_command(plan, Path("/r"), env, "localhost")
    assert cmd[cmd.index("--rdzv-endpoint") + 1] == "localhost:0"
    assert cmd[cmd.index("--nproc-per-node") + 1] == "2"


def test_a_job_with_another_node_count_than_planned_is_refused():
    _, plan = slurm_plan(["slurm.nodes=2", "slurm.gpus_per_node=4"])
    with pytest.raises(ValueError, match="planned for 2"):
        job.node_torchrun_command(plan, Path("/r"), {**two_node_env(0), "SLURM_NNODES": "3"}, "gpu07")


@pytest.mark.parametrize("job_id", [0, 1, 9999, 10000, 123456789])
def test_the_job_port_is_in_its_documented_range(job_id):
    assert 20000 <= job.rendezvous_port(job_id) < 30000  # below the kernel's ephemeral ports (32768+)


def test_consecutive_jobs_get_different_ports():
    assert len({job.rendezvous_port(i) for i in range(1000, 1100)}) == 100


@pytest.mark.parametrize(
    "code,signum,finished,node,requeue,expected",
    [
        (0, None, True, 0, True, ("done", 0)),
        (143, signal.SIGUSR1, True, 0, True, ("done", 0)),  # the signal came after the last epoch
        (1, signal.SIGUSR1, False, 0, True, ("requeue", 0)),
        (1, signal.SIGUSR1, False, 1, True, ("stopped", 0)),  # node 0 requeues the job
        (1, signal.SIGUSR1, False, 0, False, ("failed", 1)),
        (1, None, False, 0, True, ("failed", 1)),
        (0, None, False, 1, True, ("done", 0)),
    ],
)
def test_what_a_node_does_when_torchrun_ends(code, signum, finished, node, requeue, expected):
    assert job.decide(code, signum, finished, node, requeue) == expected


# --- through ddp-launch -----------------------------------------------------------------------------------------
def test_a_dry_run_prints_the_script_and_writes_nothing(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    result = ddp_launch(["launcher=slurm", "slurm.nodes=2", "slurm.gpus_per_node=4", "dry_run=true", f"hydra.run.dir={run_dir}"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --nodes=2" in result.stdout and "--rdzv-endpoint node001:" in result.stdout
    assert "dry run: nothing started" in result.stdout
    assert not (run_dir / "job.sbatch").exists() and not (run_dir / "plan.json").exists()


def test_submit_false_writes_the_script_prints_the_command_and_submits_nothing(tmp_path, cache_dir):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    spy = bin_dir / "sbatch"  # a stand-in that records being called
    spy.write_text(f"#!/bin/sh\ntouch {shlex.quote(str(tmp_path / 'sbatch-called'))}\necho 1\n")
    spy.chmod(0o755)
    run_dir = tmp_path / "run"
    result = ddp_launch(
        ["launcher=slurm", "gpus=0", "nproc=2", "slurm.submit=false", f"hydra.run.dir={run_dir}"],
        tmp_path,
        env={"PATH": f"{bin_dir}:{os.environ['PATH']}", "DDP_LAUNCH_TEST_SECRET": "hunter2"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert not (tmp_path / "sbatch-called").exists()
    script = run_dir / "job.sbatch"
    assert f"sbatch {script}" in result.stdout
    text = script.read_text()
    assert "hunter2" not in text and "DDP_LAUNCH_TEST_SECRET" not in text
    assert (run_dir / "plan.json").is_file() and (run_dir / "config.yaml").is_file()
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_the_ranks_environment_is_set_in_the_script_and_passed_by_srun(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    result = ddp_launch(["launcher=slurm", "gpus=0", "slurm.submit=false", f"hydra.run.dir={run_dir}"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    text = (run_dir / "job.sbatch").read_text()
    srun_export = srun_exports(text)
    for name in ("YOLO_OFFLINE", "YOLO_CONFIG_DIR", "OMP_NUM_THREADS", "PYTHONUNBUFFERED"):
        assert f"\nexport {name}=" in text and name in srun_export


def test_without_sbatch_a_real_submission_is_refused_before_anything_is_written(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    result = ddp_launch(["launcher=slurm", "gpus=0", f"hydra.run.dir={run_dir}"], tmp_path, env={"PATH": str(tmp_path)})
    assert result.returncode == 2
    assert "sbatch is not on PATH" in result.stderr and "slurm.submit=false" in result.stderr
    assert not (run_dir / "plan.json").exists()
