"""Shared pieces of the benchmarks: machine description, running a script as a subprocess, tables."""

import argparse
import functools
import importlib.util
import json
import os
import platform
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

REPO = Path(__file__).resolve().parent.parent
FRAMEWORK = REPO / "framework"
BENCH = REPO / "bench"
RESULTS = REPO / "bench" / "results"
MANIFEST = RESULTS / "manifest.yaml"


def results_path(benchmark: str, question: str, name: str) -> Path:
    """Where a result lives: bench/results/<benchmark>/<question>/<name>.json, <benchmark> the script that wrote it and
    <question> what it was run to answer (a page of the docs, bench/results/manifest.yaml says which). Each benchmark's
    default --output follows it; a result the docs show is listed in the manifest under `<question>/<name>`."""
    return RESULTS / benchmark / question / f"{name}.json"


def label_column(path: Path, column: str) -> np.ndarray:
    """One column of a labels.sqlite (session, global_step, ...) per label, in read_label_file's order."""
    import sqlite3

    db = sqlite3.connect(f"file:{path.resolve()}?mode=ro", uri=True)
    values = [row[0] for row in db.execute(f"SELECT {column} FROM labels ORDER BY id")]
    db.close()
    return np.array(values)


def objective_run_labels(workdir: Path, run: str, refuse=None) -> tuple[dict, dict, np.ndarray, np.ndarray]:
    """A run taught by a --teacher-objective, from --workdir/runs/<run>: its settings (args.json), labelled segments and
    labels (read_label_file) and the objective's reward of each of their steps (N, k, L), zero where masked. A run
    without labels.sqlite or an objective is refused in one line, as is one `refuse(settings)` names a reason for
    (checked before the labels are read)."""
    import gymnasium as gym

    from cleanrlhf_utils.feedback import read_label_file
    from cleanrlhf_utils.objectives import load_objective, segment_rewards

    folder = workdir / "runs" / run
    if not (folder / "labels.sqlite").exists():
        raise SystemExit(f"--runs {run}: {folder / 'labels.sqlite'} is missing (a run's labels live there)")
    settings = json.loads((folder / "args.json").read_text())
    if not settings.get("teacher_objective"):
        raise SystemExit(f"--runs {run} was taught by its env's reward, not a --teacher-objective: its labels judge no objective")
    reason = refuse(settings) if refuse else None
    if reason:
        raise SystemExit(f"--runs {run} {reason}")
    objective = load_objective(settings["teacher_objective"])
    env = gym.make(settings["env_id"])  # a "module:Id" env: gym.make imports the module that registers it
    action_dim = env.action_space.shape[0]
    env.close()
    segments, labels = read_label_file(folder / "labels.sqlite")
    if len(segments["masks"]) == 0:
        raise SystemExit(f"--runs {run} has no labels")
    masks = segments["masks"].astype(bool)
    rewards = segment_rewards(objective, {**segments, "masks": masks}, segments["obs_actions"].shape[-1] - action_dim)
    return settings, segments, labels, rewards


def correlation(a: np.ndarray, b: np.ndarray) -> float | None:
    """Pearson's r of two series; None where it is undefined (fewer than three points, or either one constant)."""
    return float(np.corrcoef(a, b)[0, 1]) if len(a) > 2 and a.std() > 0 and b.std() > 0 else None


def task_name(env_id: str) -> str:
    """An env id as a results name says it: `Hopper-v5` -> `hopper`, `dm_control/walker-walk-v0` -> `walker-walk`."""
    name = env_id.rsplit("/", 1)[-1].rsplit(":", 1)[-1]
    return re.sub(r"-v\d+$", "", name).lower()


@dataclass(frozen=True)
class Result:
    """One entry of bench/results/manifest.yaml: a results file and where the docs show it."""

    name: str
    """`<question>/<result>`: what the pages' table markers name and the generated pages' anchors follow"""
    file: str
    """the file, relative to bench/results: `<benchmark>/<question>/<result>.json`"""
    task: str
    setting: str
    feeds: tuple[str, ...]
    """`suite` (the results table of README.md and docs/benchmarks/index.md) and the pages whose table markers name it"""

    @property
    def benchmark(self) -> str:
        return self.file.split("/")[0]

    @property
    def question(self) -> str:
        return self.file.split("/")[1]


class Manifest(NamedTuple):
    """bench/results/manifest.yaml, read."""

    questions: dict[str, str]
    """question -> the page that answers it"""
    results: dict[str, Result]
    """short name -> its entry, in the file's order"""
    tables: dict[str, dict]
    """name -> a summary table (`columns`, and `rows` of `groups` and `cells`), as written"""


def read_manifest(manifest: Path = MANIFEST) -> Manifest:
    """bench/results/manifest.yaml, refusing an entry whose file does not follow the layout of `results_path` or its
    name, and a summary table whose rows do not fit its columns or pool a result it does not list."""
    import yaml

    data = yaml.safe_load(manifest.read_text())
    questions, results = dict(data["questions"]), {}
    for name, entry in data["results"].items():
        result = Result(name, entry["file"], str(entry["task"]), str(entry["setting"]), tuple(entry.get("feeds", ())))
        benchmark, question, stem = (result.file.removesuffix(".json").split("/") + ["", ""])[:3]
        if result.file != f"{benchmark}/{question}/{stem}.json" or name != f"{question}/{stem}":
            raise ValueError(f"{manifest}: {name}: its file must be <benchmark>/{name}.json, not {result.file}")
        if question not in questions:
            raise ValueError(f"{manifest}: {name}: question {question!r} is not among its questions")
        results[name] = result
    tables = dict(data.get("tables") or {})
    for table, spec in tables.items():
        for row in spec["rows"]:
            if not all(isinstance(cell, str | int | float) for cell in row["cells"]):
                raise ValueError(f"{manifest}: table {table}: a cell that is not text (quote a cell holding `: `)")
            if len(row["cells"]) != len(spec["columns"]):
                raise ValueError(f"{manifest}: table {table}: a row of {len(row['cells'])} cells under {len(spec['columns'])} columns")
            for group in row.get("groups", {}).values():
                for name in group if isinstance(group, list) else group["results"]:
                    if name not in results:
                        raise ValueError(f"{manifest}: table {table}: it pools {name}, which is not among its results")
    return Manifest(questions, results, tables)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a feedback server a benchmark starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine_info() -> dict:
    import torch

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    # BENCH_COMMIT: a copy of the tree whose .git is missing or stale (one sent to a lent GPU machine) says its commit
    commit = os.environ.get("BENCH_COMMIT", "")
    try:
        commit = commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "unknown"
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "platform": platform.platform(),
        "commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def start_script(script: str, flags: list[str], workdir: Path, threads: int = 1, log: Path | None = None) -> subprocess.Popen:
    """Starts framework/<script> with one torch thread (two runs side by side use a 2-core machine best). bench/ is on
    its import path, after the script's own folder: a run can then build an env a module here registers
    (`--env-id ant_without_contact_forces:AntWithoutContactForces-v5`), as the benchmark itself can."""
    return start_process([str(FRAMEWORK / script), "--no-progress-bar", *flags], workdir, threads, log, import_from=BENCH)


def start_process(
    argv: list[str], workdir: Path, threads: int = 1, log: Path | None = None, import_from: Path | None = None
) -> subprocess.Popen:
    """Starts `python argv...` in workdir with `threads` intra-op threads, headless, W&B offline. `import_from`: a folder
    the process imports from before the installed packages: another checkout's framework/ (another commit's modules
    instead of the installed ones), or bench/ (its own modules)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl")}
    env.setdefault("WANDB_MODE", "offline")
    if import_from is not None:
        env["PYTHONPATH"] = str(import_from)
    workdir.mkdir(parents=True, exist_ok=True)
    out = open(log, "w") if log else subprocess.DEVNULL
    return subprocess.Popen([sys.executable, *argv], cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_all(processes: list[subprocess.Popen], names: list[str]) -> None:
    for process, name in zip(processes, names):
        if process.wait() != 0:
            raise SystemExit(f"benchmark run {name} failed with exit code {process.returncode}")


def exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def run_pool(starts: list, names: list[str], parallel: int, poll_seconds: float = 2.0, grace_seconds: float = 300.0) -> None:
    """Runs the jobs (`starts`: callables that start one process each) `parallel` at a time, starting the next as soon
    as any finishes: runs of unequal length (a preference run and its baseline) keep every core busy, where batches
    would wait for the slowest of each. When one fails, the others are stopped as SIGTERM stops a run (it saves the
    checkpoint --resume-unfinished continues from); on Ctrl-C, which the terminal also sends the runs, they are given
    the time to save. SIGTERM to the benchmark alone (`kill`, a SLURM job's end) stops it as a failure does, then
    exits 143: Python's default would end it on the spot and leave its runs going on their own. What has not stopped
    after `grace_seconds` is killed."""
    pending, running, interrupted = list(zip(starts, names)), [], False
    terminate_on_sigterm = threading.current_thread() is threading.main_thread()  # only there can a handler be set
    previous_handler = signal.signal(signal.SIGTERM, exit_on_sigterm) if terminate_on_sigterm else None
    try:
        while pending or running:
            while pending and len(running) < parallel:
                start, name = pending.pop(0)
                running.append((start(), name))
            for process, name in list(running):
                if process.poll() is None:
                    continue
                running.remove((process, name))
                if process.returncode != 0:
                    raise SystemExit(f"benchmark run {name} failed with exit code {process.returncode}")
            time.sleep(poll_seconds if running else 0)
    except KeyboardInterrupt:
        interrupted = True  # not signalled again: a second signal would cut their saving short
        raise
    finally:
        if terminate_on_sigterm:  # a second SIGTERM while the runs save is ignored: it would cut the wait short
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stop_runs([process for process, _ in running], signal_them=not interrupted, grace_seconds=grace_seconds)
        if terminate_on_sigterm:
            signal.signal(signal.SIGTERM, previous_handler if previous_handler is not None else signal.SIG_DFL)


def stop_runs(processes: list[subprocess.Popen], signal_them: bool, grace_seconds: float) -> None:
    """Stops the runs still going: SIGTERM (where `signal_them`; the scripts save a checkpoint and exit, as on Ctrl-C),
    then up to `grace_seconds` for them to finish saving, then SIGKILL for what is left (a second Ctrl-C skips the
    wait)."""
    if signal_them:
        for process in processes:
            if process.poll() is None:
                process.terminate()
    deadline = time.monotonic() + grace_seconds
    try:
        for process in processes:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        pass
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def read_summary(workdir: Path, run_name: str) -> dict:
    return json.loads((workdir / "runs" / run_name / "summary.json").read_text())


def finished_run(workdir: Path, run_name: str, flag: str, files: tuple[str, ...] = ()) -> dict:
    """The settings (args.json) of a run under workdir that the analyses read from its files: its final checkpoint
    (models/<run>/latest) and `files` under runs/<run>; refused in one line, naming the flag, where one is missing."""
    needed = [
        workdir / "runs" / run_name / "args.json",
        workdir / "models" / run_name / "latest",
        *(workdir / "runs" / run_name / f for f in files),
    ]
    missing = [path for path in needed if not path.exists()]
    if missing:
        raise SystemExit(f"{flag} {run_name}: {missing[0]} is missing (a finished run under --workdir {workdir} has it)")
    return json.loads(needed[0].read_text())


@functools.cache
def script_module(script: str):
    """framework/<script> as a module: every script installs as one (`import sac`)."""
    return importlib.import_module(Path(script).stem)


# Settings that do not change what a run computes: a run started under another name or with a progress bar is the same run.
NOT_THE_RUN = ("run_name", "progress_bar", "checkpoint_frequency", "resume")  # settings that leave a run's numbers as they are

# The label-noise defences a preference run can have, and the script each runs: a defence is a variant file beside PEBBLE.
DEFENCE_SCRIPTS = {"none": "sac_rlhf.py", "rime": "sac_rlhf_rime.py", "smooth": "sac_rlhf_mistake_aware.py"}


# The variant of PEBBLE a benchmark's preference runs are, by a setting only that variant has (flag -> script).
VARIANT_BY_FLAG = {
    # SAC started afresh after a session that changed the reward a lot
    "--reset-agent-below-correlation": "sac_rlhf_agent_reset.py",
    # ratings read with a set of cut points per feedback session
    "--rating-cut-lr": str(BENCH / "session_rating_cuts.py"),
}


def preference_script(preference_flags: str) -> str:
    """The script a benchmark's preference runs are: PEBBLE (sac_rlhf.py), or the variant whose own setting the flags
    set (VARIANT_BY_FLAG); refused where they set two variants' settings."""
    flags = {token.split("=", 1)[0] for token in shlex.split(preference_flags)}
    scripts = [script for flag, script in VARIANT_BY_FLAG.items() if flag in flags]
    if len(scripts) > 1:
        both = " and ".join(scripts)
        raise SystemExit(f"--preference-flags {preference_flags!r} set two variants' settings ({both}): one at most")
    return scripts[0] if scripts else "sac_rlhf.py"


# Settings that belong to one defence: with another a run computed nothing with them, so they do not tell two runs apart
# (and a default that changed since, as --rime-warm-start-steps's did, leaves a finished run reusable).
ACTS_ONLY_WITH_ROBUST_LABELS = {"rime_": "rime", "robust_label_epsilon": "smooth", "label_mistake_rate": "smooth"}


def defence_of(settings: dict) -> str:
    """The defence a run had, from its recorded settings: its variant file's own settings (sac_rlhf_rime.py records
    RIME's, sac_rlhf_mistake_aware.py label_mistake_rate), or `robust_labels` where a result names it."""
    if "robust_labels" in settings:
        return settings["robust_labels"] or "none"
    if "label_mistake_rate" in settings:
        return "smooth"
    return "rime" if settings.get("exp_name", "").endswith("rime") or "rime_alpha" in settings else "none"


def acts_only_with(key: str) -> str | None:
    """The defence that setting `key` acts with alone (ACTS_ONLY_WITH_ROBUST_LABELS); None: it acts with any."""
    return next((defence for prefix, defence in ACTS_ONLY_WITH_ROBUST_LABELS.items() if key.startswith(prefix)), None)


def inert(key: str, settings: dict) -> bool:
    """Whether setting `key` computes nothing in a run with these `settings`."""
    defence = acts_only_with(key)
    return defence is not None and defence_of(settings) != defence


def run_settings(script: str, flags: list[str]) -> tuple[dict, set[str]]:
    """(every setting `script` reads from `flags`, its defaults included, as args.json records it; the names the flags
    set): the script's own parse of the command line, which brings in what its objective needs."""
    from cleanrlhf_utils.arguments import given_fields
    from cleanrlhf_utils.cli import command_line_args
    from cleanrlhf_utils.tracking import public_settings

    args_class = script_module(script).Args
    parsed = command_line_args(args_class, flags)
    return json.loads(json.dumps(public_settings(parsed), default=str)), given_fields(flags, args_class)


def agrees(wanted: dict, given: set[str], recorded: dict, besides: tuple[str, ...] = ()) -> bool:
    """Whether a run's args.json `recorded` holds the settings `wanted` (run_settings), NOT_THE_RUN, `besides` and the
    settings inert with the wanted --robust-labels aside. A setting the run does not record is newer than the run,
    which ran with its default: it agrees unless the flags set it."""
    if recorded.get("exp_name") != wanted.get("exp_name"):
        return False
    for key, value in wanted.items():
        if key in NOT_THE_RUN or key in besides or inert(key, wanted) or (key not in recorded and key not in given):
            continue
        if key not in recorded or recorded[key] != value:
            return False
    return True


def started_with(script: str, flags: list[str], recorded: dict) -> bool:
    """Whether the run whose args.json is `recorded` is `script` started with `flags`: every setting, defaults
    included, as the run recorded it (agrees)."""
    return recorded.get("exp_name") == Path(script).stem and agrees(*run_settings(script, flags), recorded)


def recorded_runs(workdir: Path) -> list[tuple[Path, dict]]:
    """(run directory, its args.json) of every run in `workdir`/runs, in name order."""
    return [(path.parent, json.loads(path.read_text())) for path in sorted((workdir / "runs").glob("*/args.json"))]


def earlier_run(workdir: Path, script: str, flags: list[str], finished: bool) -> Path | None:
    """A run directory in `workdir`/runs of `script` started with `flags`; where `finished`, one that ran to its end
    (a summary.json that is not an interrupted run's)."""
    wanted, given = run_settings(script, flags)
    for run, recorded in recorded_runs(workdir):
        if finished and not ran_to_its_end(run):
            continue
        if agrees(wanted, given, recorded):
            return run
    return None


def ran_to_its_end(run: Path) -> bool:
    """Whether the run directory has a summary.json that is not an interrupted run's."""
    summary = run / "summary.json"
    return summary.exists() and not json.loads(summary.read_text()).get("interrupted")


def resumable_run(workdir: Path, script: str, flags: list[str]) -> Path | None:
    """The run directory in `workdir`/runs of `script` started with `flags` that stopped before its end (killed, or
    Ctrl-C) and got furthest, by its last checkpoint (`workdir`/models/<run>/latest): --resume continues it exactly."""
    import torch

    wanted, given = run_settings(script, flags)
    furthest, furthest_step = None, -1
    for run, recorded in recorded_runs(workdir):
        checkpoint = workdir / "models" / run.name / "latest" / "checkpoint.pt"
        if ran_to_its_end(run) or not checkpoint.is_file() or not agrees(wanted, given, recorded):
            continue
        step = torch.load(checkpoint, map_location="cpu", weights_only=False)["loop"]["global_step"]
        if step > furthest_step:
            furthest, furthest_step = run, step
    return furthest


def resumed_flags(workdir: Path, script: str, flags: list[str]) -> tuple[list[str], str] | None:
    """--resume-unfinished: (the flags that continue the run of `script` started with `flags` that stopped furthest
    before its end, under its own name and from its last checkpoint; that name), or None where no such run stopped
    after a checkpoint (resumable_run)."""
    if (stopped := resumable_run(workdir, script, flags)) is None:
        return None
    name_at = flags.index("--run-name") + 1
    return [*flags[:name_at], stopped.name, *flags[name_at + 1 :], "--resume", f"models/{stopped.name}/latest"], stopped.name


def steps_count(text: str) -> int:
    """argparse type: a whole number of steps, 0 or more."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of steps (0 or more)")
    return int(text)


def add_resume_arguments(parser, checkpoint_frequency: int) -> None:
    """The flags with which a benchmark longer than one sitting continues where its runs stopped: one owner for both."""
    parser.add_argument(
        "--resume-unfinished",
        action="store_true",
        help="runs in --workdir that were started with the same flags and stopped before their end (the machine or the "
        "session went away, Ctrl-C) continue from their last checkpoint instead of starting again, under their own name",
    )
    parser.add_argument(
        "--checkpoint-frequency",
        type=steps_count,
        default=checkpoint_frequency,
        help="steps between each run's checkpoints (what --resume-unfinished continues from; they change no result; 0: none)",
    )


def longer_runs(workdir: Path, script: str, flags: list[str]) -> list[Path]:
    """Run directories in `workdir`/runs of `script` started with `flags` but a larger --total-timesteps, finished or
    not: a run's first N steps do not depend on how many follow (tests/test_end_to_end.py), so up to N they are the
    run `flags` asks for."""
    wanted, given = run_settings(script, flags)
    return [
        run
        for run, recorded in recorded_runs(workdir)
        if isinstance(recorded.get("total_timesteps"), int)
        and recorded["total_timesteps"] > wanted["total_timesteps"]
        and agrees(wanted, given, recorded, besides=("total_timesteps",))
    ]


# --rime-warm-start-steps was 1000 (RIME's) until it became 0, and results written before the benchmarks recorded it
# come from runs with those 1000 steps.
RIME_WARM_START_BEFORE_RECORDED = 1000


def defence_name(settings: dict, flip_default: float) -> str:
    """A run's --robust-labels as tables name it, from its recorded settings: a rime run always says its warm start
    (`rime (no warm start)`, `rime (warm start 1000 steps)`), so that a table reads the same whatever the scripts'
    default, and a flip threshold that is not the scripts' default (drop-only) is named beside it. A flip threshold
    recorded before the flag existed counts as the default; a warm start, as RIME's 1000 steps."""
    defence = defence_of(settings)
    if defence != "rime":
        return defence
    flip_tau = settings.get("rime_flip_tau", flip_default)
    warm = settings.get("rime_warm_start_steps", RIME_WARM_START_BEFORE_RECORDED)
    changed = [f"flip τ {flip_tau:g}"] if flip_tau != flip_default else []
    changed.append("no warm start" if warm == 0 else f"warm start {warm} steps")
    return f"rime ({', '.join(changed)})"


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = [max(len(c), *(len(fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)))


def fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return "" if value is None else str(value)


def spread(values: list) -> dict:
    """Median and interquartile range over seeds (None where no seed has the value)."""
    present = [value for value in values if value is not None]
    if not present:
        return {"median": None, "q25": None, "q75": None}
    q25, median, q75 = np.percentile(present, [25, 50, 75])
    return {"median": float(median), "q25": float(q25), "q75": float(q75)}


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))
    print(f"wrote {path}")
