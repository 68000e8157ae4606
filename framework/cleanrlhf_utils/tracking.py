"""What a run says about itself: its name and start-up line, its settings (secrets as null), TensorBoard and W&B,
the progress bar, the feedback sessions' scalars, and runs/<run>/summary.json."""

import collections
import json
import math
import platform
import time
from dataclasses import asdict
from pathlib import Path


def run_name_env(env_id: str) -> str:
    """The env's part of a default run name: my_package.my_module:MyEnv-v0 -> MyEnv-v0, dm_control/walker-walk-v0 ->
    dm_control_walker-walk-v0."""
    return env_id.rpartition(":")[2].replace("/", "_")


def default_run_name(args) -> str:
    return f"{run_name_env(args.env_id)}__{args.exp_name}__{args.seed}__{int(time.time())}"


SECRET_ARGS = ("feedback_server_token",)
"""settings written as null wherever settings are stored (args.json, TensorBoard's hyperparameters, the W&B config,
checkpoints, sweep trials): the key stays, the value never leaves the process"""


def public_settings(args) -> dict:
    """asdict(args) with SECRET_ARGS as null: what may be written to a file, a log or a tracking service."""
    return {key: None if key in SECRET_ARGS else value for key, value in asdict(args).items()}


def machine() -> dict:
    """What a CPU computation's floating-point results depend on: the same seed, or the same policy file, gives the same
    numbers on a machine with the same description, and may not elsewhere."""
    import mujoco
    import numpy as np
    import torch

    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    return {
        "cpu": cpu or platform.processor(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "mujoco": mujoco.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def start_logging(args, run_name: str, run_dir: Path, resumed_step: int | None = None):
    """TensorBoard (plus W&B with --track) for a run; its settings also go to runs/<run>/args.json (SECRET_ARGS as null).
    `resumed_step`: the global step of the checkpoint a resumed run continues from. What the stopped process logged
    after it (a killed run got up to a checkpoint interval further; PrefPPO's Ctrl-C saves its iteration's start) is
    logged again by the resumed one, so TensorBoard is told to drop the old events from the step after it on
    (purge_step): else a curve holds those steps twice. The evaluation at the checkpoint's own step came before the
    checkpoint and stays."""
    from torch.utils.tensorboard import SummaryWriter

    run_dir.mkdir(parents=True, exist_ok=True)
    settings = public_settings(args)
    if args.track:
        import wandb

        wandb.init(
            project=args.wandb_project_name,
            entity=args.wandb_entity,
            sync_tensorboard=True,
            config=settings,
            name=run_name,
            save_code=True,
            dir=str(run_dir),
        )
    writer = SummaryWriter(str(run_dir), purge_step=None if resumed_step is None else resumed_step + 1)
    table = "\n".join(f"|{key}|{value}|" for key, value in settings.items())
    writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
    (run_dir / "args.json").write_text(json.dumps(settings, indent=2))
    return writer


def stop_logging(args, writer) -> None:
    writer.close()
    if args.track:
        import wandb

        wandb.finish()


def announce_run(run_name: str, args) -> None:
    """The start-up line: the run's name and where its outputs go (videos: evaluation videos with --capture-video, the
    clips people compare in human mode)."""
    places = [f"logs and summary in runs/{run_name}", f"checkpoints in models/{run_name}"]
    if getattr(args, "capture_video", False) or getattr(args, "teacher_feedback_mode", None) == "human":
        places.append(f"videos in videos/{run_name}")
    print(f"run {run_name}: {', '.join(places)}", flush=True)


def progress_bar(args, total: int, initial: int = 0):
    """A tqdm bar over environment steps, or None with --no-progress-bar."""
    if not args.progress_bar:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)


def log_feedback_session(writer, loop, session, reward_stats: dict, metrics: dict, measures: dict | None = None) -> None:
    """TensorBoard scalars of a reward update from a feedback session (cleanrlhf_utils.feedback.FeedbackSession): labels
    so far, seconds from the pairs' selection to now, seconds the trainer waited for people in this session and people
    for the trainer in all (human mode), what the teacher measured (Teacher.session_measures) and the script adds (e.g.
    how much the session changed the reward), the reward update, the reward model's metrics."""
    step = loop.global_step
    counts = {"labels_obtained": loop.labels_obtained, "queries_skipped": loop.queries_skipped, "sessions": loop.sessions_done}
    seconds = {"session_seconds": time.time() - session.opened_at}
    if session.people_answer:
        seconds |= {"trainer_idle_seconds": session.session_trainer_idle, "people_idle_seconds": session.people_idle}
        seconds["corrections"] = session.corrections  # earlier labels people changed, learned from at this update
    for name, value in (counts | seconds | (measures or {})).items():
        writer.add_scalar(f"feedback/{name}", value, step)
    for name, value in (reward_stats | metrics).items():
        writer.add_scalar(f"reward_model/{name}", value, step)


AGENT_MEASURES = ("qf1_values", "qf2_values", "policy_entropy", "alpha")
"""SAC's figures a run's summary.json gives as means of their last logged values (RecentMeans): the twin critics' mean
Q-value and the policy's entropy (-log pi) over a sampled batch, and the temperature alpha weighing that entropy against
the reward"""


class RecentMeans:
    """Means of the last `count` logged values of some scalars (each name's values as they come, in the dict of an
    update's stats): a run's final figures, steadier than one batch's. Not checkpointed: a resumed run's means are of
    its own updates."""

    def __init__(self, names: tuple[str, ...], count: int = 10):
        self.names, self.values = names, {name: collections.deque(maxlen=count) for name in names}

    def add(self, stats: dict) -> None:
        for name in self.names:
            if name in stats:
                self.values[name].append(float(stats[name]))

    def summary(self, prefix: str = "final_") -> dict:
        """{prefix + name: the mean of its recent values, NaN where none came}."""
        return {prefix + name: sum(values) / len(values) if values else float("nan") for name, values in self.values.items()}


def run_summary(
    run_name: str, args, loop, metrics: dict, wall: float, start_step: int, interrupted: bool, earlier_wall: float = 0.0
) -> dict:
    """runs/<run>/summary.json (sweeps, the toolbox and the benchmarks read it): the final evaluation, the labels of a
    preference-learning run, `metrics`, and the time. `wall`: this process's training seconds; `earlier_wall`: those of
    the processes before it (a resumed run's checkpoint keeps them), so wall_seconds is the whole run's; sps is this
    process's (its steps over its seconds)."""
    from .evaluate import success_summary  # here, not at the top: the toolbox reads run names without torch and gym

    summary = {
        "run_name": run_name,
        "env_id": args.env_id,
        "global_step": loop.global_step,
        "final_eval_return": float(loop.last_eval_return),
    }
    summary |= success_summary(loop.last_eval_return)
    if hasattr(loop, "labels_obtained"):
        summary |= {"teacher_feedback_mode": args.teacher_feedback_mode, "labels_obtained": loop.labels_obtained}
        summary |= {"queries_skipped": loop.queries_skipped, "feedback_sessions": loop.sessions_done}
    timing = {"wall_seconds": earlier_wall + wall, "sps": (loop.global_step - start_step) / wall, "interrupted": interrupted}
    return summary | metrics | timing


def strict_json_value(value):
    """`value` with every NaN or infinite float (a metric that had nothing to measure: no evaluation yet, no
    held-out label) replaced by None, recursively, so that it serialises as strict JSON (`null`, not `NaN`)."""
    if isinstance(value, dict):
        return {key: strict_json_value(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json_value(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_summary(run_dir: Path, summary: dict) -> None:
    """runs/<run>/summary.json, strict JSON that any reader accepts: a NaN or infinite metric is written as `null`.
    The dict itself is left as it is (a sweep reads the NaN from the dict main returns)."""
    text = json.dumps(strict_json_value(summary), indent=2, allow_nan=False)
    (run_dir / "summary.json").write_text(text + "\n")


def log_update(writer, stats: dict, step: int, extra: dict, recent: RecentMeans | None = None) -> None:
    """An agent update's figures as losses/<name> (and `extra` scalars under their own names); `recent` keeps them for
    the summary."""
    for name, value in stats.items():
        writer.add_scalar(f"losses/{name}", float(value), step)
    for name, value in extra.items():
        writer.add_scalar(name, value, step)
    if recent is not None:
        recent.add(stats)
