"""What both console scripts (`ddp-launch`, `ddp-bench`) share: where the Hydra configs are, how a task's outcome
becomes an exit code, and that only `main()` exits, so that a Hydra sweep runs every one of its jobs; what Hydra
may write into a run folder before the task sees it (RunFolderGuard)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import open_dict, read_write

from launcher.plan.keys import conf_dir  # the unknown-key check reads the same files
from launcher.problems import PlanError
from launcher.run_folder import RunFolder, nearest_folder, writable

EXIT_PLAN_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C


class Jobs:
    """The jobs of one invocation (a Hydra sweep runs several): each announced as it starts, its exit code kept; the
    worst code is the invocation's, and a sweep ends with a table of its jobs."""

    def __init__(self):
        self.codes: list[int] = []
        self.rows: list[tuple[int, str, int, Path]] = []  # (job number, overrides, exit code, run folder)
        self.sweep_size: int | None = None
        self._current: tuple[int, str] | None = None

    def announce(self, hydra_cfg, run_dir: Path) -> None:
        """In a sweep, a line before each job: its number, its overrides, its run folder."""
        from hydra.types import RunMode

        if hydra_cfg.mode != RunMode.MULTIRUN:
            return
        if self.sweep_size is None:
            self.sweep_size = sweep_size(sys.argv[1:])
        overrides = " ".join(hydra_cfg.overrides.task)
        self._current = (int(hydra_cfg.job.num), overrides)
        of = f" of {self.sweep_size}" if self.sweep_size else ""
        print(f"\n==== sweep job {self._current[0] + 1}{of}: {overrides or '(no overrides)'} -> {run_dir} ====",
              flush=True)

    def run(self, action, run_dir: Path | None = None) -> int:
        """`action()`'s exit code; a PlanError is the user's to fix: its message, no traceback, exit code 2."""
        try:
            code = action()
        except PlanError as e:
            print(f"ERROR: {e}", file=sys.stderr, flush=True)
            code = EXIT_PLAN_ERROR
        except KeyboardInterrupt:
            if run_dir is not None:
                RunFolderGuard.remove_if_refused(run_dir)
            interrupted()
        self.codes.append(code)
        if self._current is not None and run_dir is not None:
            self.rows.append((*self._current, code, run_dir))
        return code

    def exit(self) -> None:
        if self.rows:
            print("\n" + sweep_table(self.rows), flush=True)
        sys.exit(max(self.codes, default=0))  # --help, --cfg: no job ran


def interrupted() -> None:
    """Ctrl-C before any rank started (composing, planning, checking the data; a run's torchrun forwards it instead):
    one line and exit code 130 at once. A check's threads may be blocked in a read (a slow file system): nothing
    waits for them, and the warm torchrun is told to go."""
    from launcher.launch.startup.warm_torchrun import warm

    warm.discard()
    print(f"\n{Path(sys.argv[0]).name}: stopped by Ctrl-C (SIGINT) before any rank started", file=sys.stderr,
          flush=True)
    sys.stdout.flush()
    os._exit(EXIT_INTERRUPTED)


def override_key(override: str) -> str:
    """The config key a command-line override sets (`+train.extra.degrees=10` -> train.extra.degrees)."""
    return override.split("=", 1)[0].lstrip("+~")


def unreadable_overrides(args: list[str]) -> list[str]:
    """A line per command-line override that Hydra's grammar cannot read (a path with a space or a character outside
    ASCII, unquoted), saying how to quote it; Hydra's own message comes without the hint."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser, lines = OverridesParser.create(), []
    for arg in (a for a in args if "=" in a and not a.startswith("-")):
        try:
            parser.parse_override(arg)
        except Exception as e:  # noqa: BLE001 - Hydra's grammar errors have no type of their own
            key, value = arg.split("=", 1)
            lines.append(f"{arg!r} cannot be read ({str(e).strip().splitlines()[0]}): quote the value (each value of a "
                         f"sweep), the quotes kept from the shell: '{key}=\"{value}\"'")
    return lines


def sweep_size(args: list[str]) -> int | None:
    """How many jobs a sweep's overrides make (the product of each swept key's values); None if Hydra cannot say."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides([a for a in args if "=" in a and not a.startswith("-")])
        size = 1
        for override in parsed:
            if override.is_sweep_override():
                size *= len(list(override.sweep_string_iterator()))
        return size
    except Exception:  # noqa: BLE001 - a count in a progress line, never a reason to stop
        return None


def sweep_table(rows: list[tuple[int, str, int, Path]]) -> str:
    """The sweep's jobs at its end: number, outcome and exit code, the metric its task is judged on (mAP50-95; mask
    or pose mAP50-95, top-1 for a classifier), run folder, overrides."""
    from launcher.plan.task_rules import rules

    lines = [f"sweep: {len(rows)} job(s)", f"{'job':<5}{'outcome':<13}{'result':<24}{'run folder':<50} overrides"]
    for number, overrides, code, run_dir in rows:
        summary = RunFolder(run_dir).summary() or {}
        outcome = {0: "finished" if summary else "planned", EXIT_PLAN_ERROR: "refused"}.get(code, "failed")
        metric = rules(summary.get("task")).quality
        score = "-" if summary.get(metric.key) is None else f"{metric.words} {summary[metric.key]:.4f}"
        lines.append(f"{number + 1:<5}{f'{outcome} ({code})':<13}{score:<24}{str(run_dir):<50} {overrides}")
    return "\n".join(lines)


def translated_or_exit(argv: list[str]):
    """`argv` with Ultralytics' keys in ddp-launch's terms (plan/ultralytics_keys.py); a key that cannot apply ends the
    invocation here, before Hydra composes: a line per key saying what to type, exit code 2."""
    from launcher.plan.ultralytics_keys import translate

    translation = translate(argv)
    unreadable = unreadable_overrides(translation.argv)
    if unreadable:
        from launcher.launch.startup.warm_torchrun import warm

        warm.discard()
        print("\n".join(f"ERROR: {line}" for line in unreadable), file=sys.stderr, flush=True)
        sys.exit(EXIT_PLAN_ERROR)
    if translation.problems:
        from launcher.launch.startup.warm_torchrun import warm

        warm.discard()
        print(f"ERROR: {PlanError(translation.problems)}", file=sys.stderr, flush=True)
        sys.exit(EXIT_PLAN_ERROR)
    return translation


# --- the run folder, before Hydra writes into it ------------------------------------------------------------------
class RunFolderGuard(Callback):
    """Hydra creates the run folder and writes its records (.hydra/) before the task runs. Here, just before: a folder
    that already holds a run gets no new records (a refused launch or a dry run changes nothing in it), and a folder
    that cannot be created (a read-only current directory, file system) is not attempted, so that the task says what
    to change instead of Hydra's traceback. Configured in conf/config.yaml (hydra.callbacks)."""

    existed: dict[Path, Path] = {}  # the run (or sweep) folder Hydra was given -> the nearest folder that existed
    moved: dict[Path, Path] = {}  # the existing folder Hydra was given instead -> the folder meant

    def on_run_start(self, config, **kwargs) -> None:
        self._guard(config, "run")

    def on_multirun_start(self, config, **kwargs) -> None:
        self._guard(config, "sweep")

    def _guard(self, config, key: str) -> None:
        meant = Path(str(config.hydra[key].dir)).resolve()
        self.existed[meant] = nearest_folder(meant)
        if key == "run" and RunFolder(meant).is_run():
            with read_write(config.hydra), open_dict(config.hydra):
                config.hydra.output_subdir = None
        elif not writable(meant):
            instead = nearest_folder(meant)
            with read_write(config.hydra), open_dict(config.hydra):
                config.hydra.output_subdir = None
                config.hydra[key].dir = str(instead)
            self.moved[instead] = meant

    @classmethod
    def meant(cls, output_dir: Path) -> Path:
        """The folder a job was meant to run in, for the folder Hydra ran it in."""
        output_dir = Path(output_dir).resolve()
        for instead, meant in cls.moved.items():
            if output_dir == instead or instead in output_dir.parents:
                return meant / output_dir.relative_to(instead)
        return output_dir

    @classmethod
    def remove_if_refused(cls, run_dir: Path) -> None:
        """A refused launch leaves no folder of its own behind: the folder this invocation made for it (or its sweep)
        is removed when it holds nothing but Hydra's records, and so are the empty folders made on the way to it
        (runs/<date>/). A folder that existed before is never touched."""
        run_dir = Path(run_dir).resolve()
        given = next((d for d in cls.existed if run_dir == d or d in run_dir.parents), None)
        if given is None or cls.existed[given] == given or not run_dir.is_dir():
            return  # not Hydra's folder, or one that existed before (a sweep's: so may its job folders)
        if any(p.name != ".hydra" for p in run_dir.iterdir()):
            return
        before = cls.existed[given]
        shutil.rmtree(run_dir, ignore_errors=True)
        for parent in run_dir.parents:
            if parent == before or any(parent.iterdir()):
                break
            parent.rmdir()


# --- --help: every key with its comment, read from the config files themselves ------------------------------------
GROUPS = {  # the config groups a user picks from, and what each one chooses
    "model": "the network: a YOLO family and size from its YAML, or model=checkpoint model.weights=X.pt",
    "data": "the dataset: built-in synthetic shapes, COCO, VOC, or data=custom data.path=your data YAML",
    "launcher": "where the ranks run: local (torchrun here) or slurm (a batch job)",
    "experiment": "a whole recipe, added with +experiment=NAME",
    "bench": "ddp-bench's cells and how long each is measured",
}
SKIPPED_SECTIONS = ("defaults", "hydra")  # composition and Hydra's own settings: not the user's keys


def config_keys(path: Path, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, comment) for every key of a config file, from its lines: the comment after a key is its
    documentation (conf/ is written that way), so --help cannot drift from the files."""
    keys, stack = [], []  # stack: (indent, name) of the mappings the current line lies in
    for line in path.read_text().splitlines():
        body = line.split(" #", 1)[0].rstrip() if not line.lstrip().startswith("#") else ""
        if not body.strip() or body.lstrip().startswith("-") or ":" not in body:
            continue
        indent = len(body) - len(body.lstrip())
        name, _, value = body.strip().partition(":")
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path_parts = [n for _, n in stack] + [name]
        comment = line.split(" #", 1)[1].strip() if " #" in line else ""
        if path_parts[0] not in SKIPPED_SECTIONS and (value.strip() or comment):
            keys.append((prefix + ".".join(path_parts), value.strip(), comment))
        stack.append((indent, name))
    return keys


def help_text(app: str, description: str, *, groups: dict[str, str], files: list[tuple[Path, str]]) -> str:
    """What `app --help` prints: the app, its groups and their options, then every key with default and comment."""
    conf = Path(conf_dir())
    lines = [f"{app}: {description}", "", f"Usage: {app} [KEY=VALUE ...] [GROUP=OPTION ...] [+experiment=NAME]",
             f"       {app} -m KEY=A,B ...   (a sweep: one job per value)", "", "Config groups:"]
    for group, what in groups.items():
        options = sorted(p.stem for p in (conf / group).glob("*.yaml"))
        lines.append(f"  {group:<12} {what}\n      {', '.join(options)}")
    lines += ["", "Keys (default, then what it does):"]
    for path, prefix in files:
        for key, default, comment in config_keys(path, prefix):
            lines.append(f"  {key} = {default or '...'}" + (f"\n      {comment}" if comment else ""))
    lines += ["", f"{app} --cfg job prints the composed config; --hydra-help shows Hydra's own options."]
    return "\n".join(lines)


def print_help_if_asked(argv: list[str], app: str, description: str, *, groups: dict[str, str],
                        files: list[tuple[Path, str]]) -> bool:
    """`--help`/`-h`: this app's own help (Hydra's would list every config group, Hydra's among them)."""
    if "--help" not in argv and "-h" not in argv:
        return False
    print(help_text(app, description, groups=groups, files=files))
    return True
