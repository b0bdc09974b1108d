"""launcher=slurm: plan for the allocation, write RUN_DIR/job.sbatch (a pure function of the plan), submit it.

The script asks for `slurm.nodes` nodes with one task each; that task is `python -m launcher.launch.environments.
slurm_job RUN_DIR` (slurm_job.py), which starts torchrun for its node's ranks, handles the time-limit signal and
requeues the job.

Two languages share job.sbatch. The `#SBATCH` lines are read by sbatch, not bash: to bash they are comments, and
sbatch splits them on blanks, honours "double quotes" and backslash escapes, and treats an unquoted `#` as the start
of a comment. So directive values are written in sbatch's quoting (`sbatch_quote`) and the body in the shell's
(`shlex.quote`). A newline would end the comment line and make the rest shell code, so values holding one are
refused. `slurm.setup` is the one exception: its lines are shell code by design (module loads) and run as written.
"""

from __future__ import annotations

import copy
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from launcher.inputs.ultralytics_files import allowed_outside_window, installed_version
from launcher.launch.environments.slurm_job import JOB_MODULE, node_torchrun_command, rendezvous_port
from launcher.launch.logs import say
from launcher.launch.run_lock import RunLock
from launcher.machine.hardware import Gpu, Hardware, bytecode_kept
from launcher.plan.plan import LaunchPlan
from launcher.problems import PlanError, Problem
from launcher.run_folder import RunFolder

SCRIPT_NAME = "job.sbatch"
LOG_NAME = "slurm.out"  # the job's own log, one per run folder: a requeued (or resubmitted) job appends to it
# The signals each node's launcher turns into a checkpoint. USR1 reaches every process of the job step; the launcher
# starts torchrun with USR1 ignored (inherited through exec), so only the launcher acts on it. TERM is what SLURM
# sends at the limit itself and on preemption: every process gets it and every one of them stops cleanly.
WARNING_SIGNALS = ("USR1", "TERM")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
STRING_KEYS = ("partition", "mem", "time", "account", "qos", "constraint", "job_name", "python")
LIST_KEYS = ("extra", "setup", "export", "srun_args", "exec_prefix")


# --- configuration ----------------------------------------------------------------------------------------------
def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_problem(value, key: str, minimum: int) -> Problem | None:
    if not _is_int(value) or value < minimum:
        return Problem(f"{key}={value!r}: expected an integer >= {minimum}")
    return None


def _has_line_break(text: str) -> bool:
    return any(c in text for c in "\n\r\0")


def check_config(cfg: dict) -> list[Problem]:
    """Every problem with `slurm.*` and with the top-level keys that SLURM decides instead."""
    s = cfg["slurm"]
    problems = [
        p
        for p in (
            _int_problem(s.get("nodes"), "slurm.nodes", 1),
            _int_problem(s.get("gpus_per_node"), "slurm.gpus_per_node", 0),
            _int_problem(s.get("cpus_per_task"), "slurm.cpus_per_task", 1),
        )
        if p
    ]
    for key in STRING_KEYS:
        value = s.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            problems.append(Problem(f"slurm.{key}={value!r}: expected a string or null"))
        elif _has_line_break(str(value)):
            problems.append(Problem(f"slurm.{key}: a line break cannot be written into an sbatch directive"))
    for key in LIST_KEYS:
        items = s.get(key)
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            problems.append(Problem(f"slurm.{key}={items!r}: expected a list of strings"))
        elif any(_has_line_break(i) for i in items):
            problems.append(Problem(f"slurm.{key}: one item per line; an item holds a line break"))
    if isinstance(s.get("extra"), list):
        for d in s["extra"]:
            if isinstance(d, str) and not d.startswith("-"):
                problems.append(Problem(f"slurm.extra item {d!r}: an sbatch option, starting with '-' (e.g. --exclusive)"))
    if isinstance(s.get("export"), list):
        for name in s["export"]:
            if isinstance(name, str) and not ENV_NAME.fullmatch(name):
                problems.append(Problem(f"slurm.export item {name!r}: an environment variable name"))
    for key in ("requeue", "submit"):
        if not isinstance(s.get(key), bool):
            problems.append(Problem(f"slurm.{key}={s.get(key)!r}: expected true or false"))
    problems += _signal_problems(s.get("signal"))

    nodes = s.get("nodes")
    if cfg.get("nnodes", 1) not in (1, nodes):
        problems.append(Problem(f"nnodes={cfg.get('nnodes')} with launcher=slurm: the node count is slurm.nodes={nodes}"))
    if cfg.get("node_rank", 0) != 0:
        problems.append(Problem("node_rank with launcher=slurm: each node's rank is decided in the job; leave it unset"))
    return problems


def _signal_problems(spec) -> list[Problem]:
    if spec is None:
        return []
    m = re.fullmatch(r"(B:|R:|RB:|BR:)?(?:SIG)?([A-Z0-9]+)(?:@(\d+))?", str(spec))
    if not m:
        return [Problem(f"slurm.signal={spec!r}: expected SIGNAL@SECONDS, e.g. USR1@90, or null")]
    problems = []
    if m.group(1) and "B" in m.group(1):
        problems.append(
            Problem(
                f"slurm.signal={spec!r}: B: sends the signal only to the batch shell, which does not pass it on; "
                "leave B: out so it reaches each node's launcher"
            )
        )
    if m.group(2) not in WARNING_SIGNALS:
        problems.append(
            Problem(f"slurm.signal={spec!r}: the launcher checkpoints on {' or '.join(WARNING_SIGNALS)}; another signal kills the ranks")
        )
    return problems


def requested_gpus(cfg: dict):
    """`gpus=N` when given, else slurm.gpus_per_node: what each node asks SLURM for and what the plan assumes.
    (`gpus=auto` would count the GPUs of the machine running ddp-launch, usually a login node without any.)"""
    gpus = cfg.get("gpus", "auto")
    return cfg["slurm"]["gpus_per_node"] if gpus == "auto" else gpus


def planning_config(cfg: dict) -> dict:
    """The config the plan (and the ranks) use under SLURM: topology from `slurm.*`. Raises PlanError.

    The plan is a pure function of the config (make_plan), so SLURM's answers are written into the config rather than
    patched into the plan: nnodes = slurm.nodes, gpus = the GPUs per node requested, node_rank 0 (in the job every node
    takes its rank at the rendezvous). The rendezvous itself is decided in the job (slurm_job.py): the plan marks it
    "slurm" and checks no address or port on the login node.
    """
    problems = check_config(cfg)
    if problems:
        raise PlanError(problems)
    planned = copy.deepcopy(cfg)
    gpus = requested_gpus(cfg)
    planned["gpus"] = gpus  # not an integer: make_plan says so
    if _is_int(gpus):
        planned["slurm"]["gpus_per_node"] = gpus
    planned["nnodes"] = cfg["slurm"]["nodes"]
    planned["node_rank"] = 0
    return planned


def allocation_hardware(cfg: dict) -> Hardware:
    """One node of the allocation as SLURM will grant it: the GPUs and cores asked for (sbatch refuses otherwise)."""
    gpus = requested_gpus(cfg) if _is_int(requested_gpus(cfg)) else cfg["slurm"]["gpus_per_node"]
    return Hardware(
        gpus=tuple(Gpu(i, "slurm-allocated", 0.0) for i in range(gpus)),
        cpu_count=cfg["slurm"]["cpus_per_task"],
        nccl_available=gpus > 0,  # the allocation's nodes are GPU nodes with a CUDA build of torch
        ultralytics_version=installed_version(),  # the nodes run this installation (the shared filesystem)
        ultralytics_allowed=allowed_outside_window(),
        bytecode_kept=bytecode_kept(),  # ... and the same install's bytecode, or none
    )


# --- the script ---------------------------------------------------------------------------------------------------
def sbatch_quote(value: str) -> str:
    """A value for an `#SBATCH` line, read back by sbatch exactly: double quotes, with `\\` and `"` escaped.

    (Backslash-blank does not work: sbatch 22.05 ends a word at a blank before it looks at the escape.)
    """
    if _has_line_break(value):
        raise ValueError(f"a line break cannot be written into an sbatch directive: {value!r}")
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def output_pattern(path: Path) -> str:
    """`path` as an sbatch filename pattern: a literal % is written %%, except that a backslash anywhere in the name
    already turns every replacement symbol off (sbatch's rule), % included."""
    text = str(path)
    return text if "\\" in text else text.replace("%", "%%")


def export_names(slurm_cfg: dict, env: dict[str, str]) -> list[str]:
    """What srun passes to the job step: the allowlist from your environment, plus what the script itself sets."""
    return sorted(set(slurm_cfg["export"]) | set(env))


def sbatch_script(slurm_cfg: dict, plan: LaunchPlan, run_dir: Path, env: dict[str, str], python: str) -> str:
    """The text of job.sbatch. Pure: the same inputs give the same bytes (tests/golden/ holds examples)."""
    s = slurm_cfg
    run_dir = Path(run_dir)
    nodes = plan.nnodes
    directives: list[str] = []

    def directive(option: str, value=None) -> None:
        if value is None:
            directives.append(f"#SBATCH {option}")
        elif isinstance(value, int):
            directives.append(f"#SBATCH {option}={value}")
        else:
            directives.append(f"#SBATCH {option}={sbatch_quote(str(value))}")

    directive("--job-name", s["job_name"] or "ddp-launch")
    directive("--nodes", nodes)
    directive("--ntasks-per-node", 1)  # one launcher per node; torchrun under it starts the node's ranks
    directive("--cpus-per-task", s["cpus_per_task"])
    if plan.gpus_per_node > 0:
        directive("--gpus-per-node", plan.gpus_per_node)
    for key, option in (
        ("mem", "--mem"),
        ("time", "--time"),
        ("partition", "--partition"),
        ("account", "--account"),
        ("qos", "--qos"),
        ("constraint", "--constraint"),
    ):
        if s.get(key) is not None:
            directive(option, str(s[key]))
    if s.get("signal"):
        directive("--signal", str(s["signal"]))
    directive("--requeue" if s["requeue"] else "--no-requeue")
    directive("--open-mode", "append")  # a requeued job appends to its log instead of truncating it
    directive("--output", output_pattern(run_dir / LOG_NAME))
    # Only these names are taken from the environment of whoever runs sbatch (SLURM_* always are), never all of it.
    directives.append("#SBATCH --export=" + (",".join(s["export"]) if s["export"] else "NONE"))
    directives += [f"#SBATCH {sbatch_quote(d)}" for d in s["extra"]]

    srun_options = [
        f"--nodes={nodes}",
        f"--ntasks={nodes}",
        "--ntasks-per-node=1",
        f"--cpus-per-task={s['cpus_per_task']}",  # srun 22.05 does not inherit it from the allocation
        "--kill-on-bad-exit=1",  # one node's launcher failing stops the others instead of leaving them waiting
        "--export=" + ",".join(export_names(s, env)),
        *s["srun_args"],
    ]
    command = [*s["exec_prefix"], python, "-m", JOB_MODULE, str(run_dir)]
    lines = [
        "#!/bin/bash",
        "# Written by ddp-launch (launcher=slurm). Submit it again with: sbatch " + shlex.quote(str(run_dir / SCRIPT_NAME)),
        f"# {nodes} node(s) x {plan.nproc_per_node} rank(s); on each node the job task runs torchrun, checkpoints on",
        "# the warning signal and requeues the job, which resumes from weights/last.pt in the same run folder.",
        *directives,
        "",
        "set -eo pipefail",
    ]
    if s["setup"]:
        lines += ["", "# slurm.setup, as written", *s["setup"]]
    lines += ["", "# the ranks' environment (also named in srun --export below)"]
    lines += [f"export {k}={shlex.quote(str(v))}" for k, v in sorted(env.items())]
    lines += ["", f"cd {shlex.quote(str(run_dir))}"]
    lines += ["srun " + "".join(f"{shlex.quote(o)} \\\n  " for o in srun_options) + " ".join(map(shlex.quote, command)), ""]
    return "\n".join(lines)


def script_python(slurm_cfg: dict) -> str:
    return slurm_cfg.get("python") or sys.executable


# --- submitting ---------------------------------------------------------------------------------------------------
def submission_problems(cfg: dict, run_dir: Path) -> list[Problem]:
    """Checked before anything is written: the run folder fits in a script; a submission needs sbatch here."""
    problems = run_dir_problems(run_dir)
    if cfg["slurm"].get("submit") and shutil.which("sbatch") is None:
        problems.append(
            Problem(
                "launcher=slurm: sbatch is not on PATH here. Run ddp-launch on a login node, or write the script only "
                "with slurm.submit=false",
                environment=True,
            )
        )
    return problems


def run_dir_problems(run_dir: Path) -> list[Problem]:
    if _has_line_break(str(run_dir)):
        return [Problem(f"the run folder {str(run_dir)!r} holds a line break, which a job script cannot carry")]
    return []


def submit_job(cfg: dict, plan: LaunchPlan, run_dir: Path) -> int:
    """Write RUN_DIR/job.sbatch; submit it (slurm.submit=true) and say where its logs go. Returns the exit code."""
    s = cfg["slurm"]
    script = Path(run_dir) / SCRIPT_NAME
    script.write_text(sbatch_script(s, plan, run_dir, plan.env, script_python(s)))
    script.chmod(0o755)
    return sbatch(cfg, plan, run_dir)


def sbatch(cfg: dict, plan: LaunchPlan, run_dir: Path) -> int:
    """Submit RUN_DIR/job.sbatch (slurm.submit=true); `ddp-launch resume=RUN_DIR` of a SLURM run comes here too,
    its script written again first (the folder may have moved): the job resumes from the run's checkpoint."""
    s = cfg["slurm"]
    script = Path(run_dir) / SCRIPT_NAME
    cmd = ["sbatch", "--parsable", str(script)]
    if not s["submit"]:
        say(f"\nwrote {script} (slurm.submit=false: nothing submitted). Submit it with:")
        say("  " + " ".join(shlex.quote(c) for c in cmd[:1] + cmd[2:]))
        return 0
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        say(f"\nddp-launch: sbatch refused the job (exit code {result.returncode}); the script is {script}")
        say(result.stderr.strip())
        return result.returncode
    job_id = result.stdout.strip().split(";")[0]  # --parsable: "id" or "id;cluster"
    RunLock(Path(run_dir)).hand_to_job(job_id)  # the job holds the folder from now on
    log = Path(run_dir) / LOG_NAME
    say(f"\nsubmitted SLURM job {job_id}: {plan.nnodes} node(s) x {plan.nproc_per_node} rank(s)")
    if plan.nnodes > 1:  # the endpoint is decided in the job; the job id gives its port
        port = cfg["dist"]["master_port"] if _is_int(cfg["dist"].get("master_port")) else f"{rendezvous_port(int(job_id))}"
        say(f"rendezvous  c10d on the allocation's first host, port {port}")
    say(f"script      {script}")
    say(f"job log     {log}")
    say(f"rank logs   {Path(run_dir) / 'logs'}/rank<N>.log")
    say(f"follow it   squeue -j {job_id}; tail -f {shlex.quote(str(log))}")
    return 0


def dry_run_text(cfg: dict, plan: LaunchPlan, run_dir: Path) -> str:
    """What a dry run shows: the script, and the torchrun command node 0 would run in an example job."""
    s = cfg["slurm"]
    example = {"SLURM_JOB_ID": "12345", "SLURM_NNODES": str(plan.nnodes), "SLURM_NODEID": "0"}
    port = cfg["dist"]["master_port"] if _is_int(cfg["dist"].get("master_port")) else None
    cmd = node_torchrun_command(plan, run_dir, example, first_host="node001", port=port, python=script_python(s))
    return "\n".join(
        [
            f"sbatch script ({Path(run_dir) / SCRIPT_NAME}):",
            sbatch_script(s, plan, run_dir, plan.env, script_python(s)),
            "torchrun command on each node (here: node 0 of an example job 12345 on node001..):",
            " ".join(shlex.quote(c) for c in cmd),
        ]
    )


class SlurmEnvironment:
    """launcher=slurm: the plan is for the allocation's nodes; starting means submitting job.sbatch."""

    name = "slurm"

    def planning_config(self, cfg: dict) -> dict:
        return planning_config(cfg)

    def hardware(self, cfg: dict) -> Hardware:
        return allocation_hardware(cfg)  # the plan is for the nodes SLURM will give, not this login node

    def problems(self, cfg: dict, run_dir: Path) -> list[Problem]:
        return submission_problems(cfg, run_dir)

    def dry_run_text(self, cfg: dict, plan: LaunchPlan, run_dir: Path) -> str:
        return dry_run_text(cfg, plan, run_dir)

    def start(self, cfg: dict, plan: LaunchPlan, folder: RunFolder) -> int:
        return submit_job(cfg, plan, folder.path)

    def resume(self, cfg: dict, plan: LaunchPlan, folder: RunFolder) -> int:
        return submit_job(cfg, plan, folder.path)  # job.sbatch written for where the folder is now; resumes there
