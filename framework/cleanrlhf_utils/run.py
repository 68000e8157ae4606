"""A training run's life around its algorithm: its name and folders, the checkpoint it resumes from, its checkpoints,
its logging and progress bar, Ctrl-C and SIGTERM, and the summary and closing line it ends with. Each algorithm
script's `main` holds one Run, so that `main` itself reads as the algorithm's loop."""

import contextlib
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import ClassVar

from .buffers import check_saved_buffer
from .checkpoints import (
    checkpoint_file,
    earlier_wall_seconds,
    load_checkpoint,
    load_training_state,
    rng_states,
    save_checkpoint,
    training_state,
)
from .envs import capture_env_state, restore_env_state
from .errors import need
from .evaluate import evaluate_and_log
from .feedback import FeedbackServerError
from .stopping import stop_between_steps, stop_here_if_requested
from .tracking import announce_run, default_run_name, progress_bar, public_settings, run_summary, start_logging, stop_logging, write_summary


@dataclass
class RunArgs:
    """What every script's run has: its name and seed, where it computes, what it logs and how it is evaluated."""

    help_group: ClassVar[str] = "run"

    exp_name: str = "run"
    """the name of this experiment (part of the run name)"""
    run_name: str | None = None
    """outputs go to runs/, models/ and videos/<run_name>; default: <env>__<exp>__<seed>__<time>"""
    seed: int = 1
    """seed of the run (environments, networks, sampling; a synthetic teacher uses seed + 1)"""
    cuda: bool = True
    """use a CUDA GPU when there is one"""
    torch_threads: int = 1
    """torch's CPU threads: one is fastest for these network sizes, above all on a busy machine (0: torch's default)"""
    track: bool = False
    """track the run with Weights and Biases"""
    wandb_project_name: str = "CleanRLHF"
    """the W&B project"""
    wandb_entity: str | None = None
    """the W&B entity (team)"""
    progress_bar: bool = True
    """show a progress bar over the environment steps"""
    capture_video: bool = False
    """write mp4 videos of evaluation episodes to videos/<run_name>/"""
    video_width: int = 320
    """width of the evaluation videos' frames"""
    video_height: int = 240
    """height of the evaluation videos' frames"""
    evaluation_frequency: int = 10_000
    """environment steps between evaluations (0: only at the end; PPO: checked after each iteration)"""
    evaluation_episodes: int = 5
    """episodes per evaluation (deterministic actions, distinct seeds)"""


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C, or a feedback server that stayed away (`failure`), after the run saved what --resume continues from
    (`checkpoint`: models/<run>/latest)."""

    def __init__(self, checkpoint: Path, failure: Exception | None = None):
        super().__init__(str(checkpoint))
        self.checkpoint, self.failure = checkpoint, failure


def check_run_name(name: str | None) -> None:
    """A run name is one folder name: runs/<name>, models/<name> and videos/<name> stay inside their folders."""
    need(
        name is None or (re.fullmatch(r"[\w.+-]+", name) is not None and name not in (".", "..")),
        f"--run-name {name!r} must be a plain folder name (letters, digits, and . _ + -): outputs go to runs/<name> and models/<name>",
    )


def check_writable(folders: tuple[str, ...]) -> None:
    """One line, before anything is built, where the run's folders cannot be written (a read-only file system, no
    permission)."""
    for folder in map(Path, folders):
        target = folder if folder.exists() else Path.cwd()
        need(
            os.access(target, os.W_OK),
            f"cannot write {target.resolve()}: the run keeps its outputs in runs/, models/ and videos/ of the folder it starts in; "
            "start it in a folder you can write to",
        )


class Run:
    """One run of an algorithm script: runs/<name> (logs, settings, summary), models/<name> (checkpoints) and
    videos/<name>. Resumed (--resume) or started from another run's exploration (--exploration-from), it restores
    the training state saved there."""

    def __init__(self, args, algorithm: str, on_evaluation: Callable | None = None):
        self.args, self.algorithm, self.on_evaluation = args, algorithm, on_evaluation
        check_run_name(args.run_name)
        check_writable(("runs", "models", "videos"))
        self.resumed = load_checkpoint(Path(args.resume) / "checkpoint.pt") if args.resume else None
        exploration = getattr(args, "exploration_from", None)
        if args.resume or exploration:  # a replay buffer that cannot be loaded is refused before anything is written
            folder = Path(args.resume) if args.resume else checkpoint_file(exploration, "--exploration-from").parent
            check_saved_buffer(folder / "replay_buffer.npz", min(args.buffer_size, args.total_timesteps))
        self.name = args.run_name or (self.resumed["run_name"] if self.resumed else default_run_name(args))
        self.dir, self.model_dir, self.video_dir = (Path(folder) / self.name for folder in ("runs", "models", "videos"))
        self.earlier_wall = earlier_wall_seconds(self.resumed)  # training seconds before the checkpoint resumed from
        self.start_time, self.start_step, self.wall, self.interrupted = time.time(), 0, 0.0, False
        self.progress, self.last_episode_return = None, float("nan")
        self.saved_loop: dict = {}
        self.failure: Exception | None = None

    def start_logging(self, cleanup: contextlib.ExitStack):
        """TensorBoard (and W&B with --track), args.json and the start-up line; closed when `cleanup` closes."""
        self.writer = start_logging(self.args, self.name, self.dir, self.resumed["loop"]["global_step"] if self.resumed else None)
        announce_run(self.name, self.args)
        cleanup.callback(stop_logging, self.args, self.writer)
        return self.writer

    def say_feedback_plan(self, first: int, every: int, schedule: list[int], end: int, step: int = 1) -> None:
        """One line at the start saying what the run will ask: its feedback sessions, the first when step `first` is
        reached and one every `every` steps after it (each at the first multiple of `step` from there: an on-policy
        script's sessions come after a rollout), those before step `end` happening, with `schedule`'s labels. A run
        that ends before its first session says that it asks no label and learns no reward."""
        steps = []  # one session a step (an iteration) at most: one due earlier waits for the next
        for i in range(len(schedule)):
            steps.append(max(-(-(first + i * every) // step) * step, steps[-1] + step if steps else 0))
        held = [count for at, count in zip(steps, schedule, strict=True) if at < end]
        if not schedule:
            print("feedback: no labels (--teacher-feedback-total-queries 0): the run learns no reward")
        elif not held:
            print(
                f"feedback: none: the run ends before its first feedback session at step {steps[0]}, so it asks no "
                f"label and learns no reward; give --total-timesteps above {steps[0]} or a shorter --total-explore-steps"
            )
        else:
            left = f"; the last {len(schedule) - len(held)} sessions ({sum(schedule) - sum(held)} labels) come after its end"
            print(
                f"feedback: {len(held)} sessions, {sum(held)} labels, at steps {steps[0]} to {steps[len(held) - 1]}"
                + (left if len(held) < len(schedule) else "")
            )

    def evaluate(self, policy, loop, device, teacher=None) -> None:
        """One evaluation (cleanrlhf_utils.evaluate) into loop.last_eval_return: logged, passed to the sweep's
        on_evaluation, shown on the progress bar, and its first episode to the teacher (people see what the agent does)."""
        show = teacher.show_evaluation if teacher is not None and teacher.people_answer else None
        loop.last_eval_return = evaluate_and_log(
            policy, self.args, self.writer, self.video_dir, device, loop.global_step, self.on_evaluation, show
        )
        self.show_progress(loop)

    def restore(self, parts: dict, rng, rb, envs, obs, loop):
        """(loop, obs) to continue from: the resumed checkpoint's, or an exploration checkpoint's (every part but the
        teacher, which that run may not have had), or the fresh ones given."""
        exploration = getattr(self.args, "exploration_from", None)
        if self.resumed is None and not exploration:
            return loop, obs
        folder = Path(self.args.resume) if self.resumed else checkpoint_file(exploration, "--exploration-from").parent
        saved = self.resumed or load_checkpoint(folder / "checkpoint.pt")
        load_training_state(parts if self.resumed else {k: v for k, v in parts.items() if k != "teacher"}, rng, saved)
        rb.load(folder / "replay_buffer.npz")
        kept = {field.name for field in fields(loop)}  # a counter the script no longer keeps is left behind
        loop = type(loop)(**{name: value for name, value in saved["loop"].items() if name in kept})
        labels = f" with {loop.labels_obtained} labels" if hasattr(loop, "labels_obtained") else ""
        resumed = f"resumed {self.name} at step {loop.global_step}{labels}"
        print(resumed if self.resumed else f"loaded exploration checkpoint at step {loop.global_step}")
        return loop, restore_env_state(envs, saved["env"])

    def state(self, parts: dict, rng, loop, envs, obs) -> dict:
        """What a checkpoint holds besides the replay buffer: settings, counters, environments, every part's state."""
        head = {"algorithm": self.algorithm, "run_name": self.name, "args": public_settings(self.args), "loop": asdict(loop)}
        head |= {"env": capture_env_state(envs, obs), "wall_seconds": self.earlier_wall + time.time() - self.start_time}
        return head | training_state(parts, rng)

    def save(self, folder: str | int, state: dict, rb) -> None:
        """models/<run>/<folder>: `state` (Run.state, possibly amended) and the replay buffer, written atomically."""
        save_checkpoint(self.model_dir / str(folder), state, rb)
        if folder == "latest":
            self.saved_loop = state["loop"]  # what a resume continues from: an interrupted run's summary says that

    @contextlib.contextmanager
    def training(self, loop, total_steps: int, save_last: Callable[[], None]):
        """The training loop's scope: a progress bar, stop signals honoured between steps, Ctrl-C or SIGTERM ending the
        loop, and whatever ends it followed by `save_last()` (the checkpoint models/<run>/latest)."""
        self.start_time, self.start_step = time.time(), loop.global_step
        self.progress = progress_bar(self.args, total_steps, loop.global_step)
        try:
            with stop_between_steps():
                yield
        except KeyboardInterrupt:
            self.interrupted = True
            print(f"\ninterrupted at step {loop.global_step}: saving models/{self.name}/latest")
        except FeedbackServerError as error:  # away past the client's retries: the run stops as at Ctrl-C, resumable
            self.interrupted, self.failure = True, error
            print(f"\nstopped at step {loop.global_step}, {error}: saving models/{self.name}/latest")
        finally:
            self.wall = time.time() - self.start_time  # training time: evaluations on the way included, the final one not
            save_last()
            if self.progress is not None:
                self.progress.update(loop.global_step - self.progress.n)
                self.progress.close()

    def steps(self, loop, total: int):
        """The training loop's steps, loop.global_step until `total` (the loop body advances it): a stop asked for
        (Ctrl-C, SIGTERM) ends the loop here, between two steps, never inside one."""
        while loop.global_step < total:
            stop_here_if_requested()
            yield loop.global_step

    def iterations(self, loop, total: int):
        """The training loop's iterations (an on-policy script's rollouts), loop.iteration until `total` (the loop body
        advances it), stopping between two iterations when asked to, as `steps` does between two steps."""
        while loop.iteration < total:
            stop_here_if_requested()
            yield loop.iteration

    def elapsed(self) -> float:
        """Seconds since the training loop began (in this process)."""
        return time.time() - self.start_time

    def track_episode(self, loop, reward: float, done: bool, writer, step: int) -> None:
        """One step of the current episode (loop.episode_return, episode_length); at its end, its return and length
        logged (charts/), shown on the progress bar, and the next episode counted."""
        loop.episode_return += float(reward)
        loop.episode_length += 1
        if not done:
            return
        writer.add_scalar("charts/episodic_return", loop.episode_return, step)
        writer.add_scalar("charts/episodic_length", loop.episode_length, step)
        self.show_progress(loop, loop.episode_return)
        loop.episode_id += 1
        loop.episode_return, loop.episode_length = 0.0, 0

    def show_progress(self, loop, episode_return: float | None = None) -> None:
        """The bar's position and its figures: the last episode's return, the last evaluation's, labels so far."""
        if self.progress is None:
            return
        if episode_return is not None:
            self.last_episode_return = episode_return
        evaluation = "-" if math.isnan(loop.last_eval_return) else f"{loop.last_eval_return:.0f}"
        figures = {"ret": f"{self.last_episode_return:.0f}", "eval": evaluation}
        if hasattr(loop, "labels_obtained"):
            figures["labels"] = loop.labels_obtained
        self.progress.set_postfix(figures, refresh=False)
        self.progress.update(loop.global_step - self.progress.n)

    def finish(self, loop, measures: dict) -> dict:
        """runs/<run>/summary.json and the closing line; an interrupted run then raises RunInterrupted (cli prints the
        command that resumes it)."""
        if self.interrupted:  # the counters of the checkpoint the resume continues from (a reward update cut short is redone)
            loop = type(loop)(**self.saved_loop | {"last_eval_return": loop.last_eval_return})
        summary = run_summary(self.name, self.args, loop, measures, self.wall, self.start_step, self.interrupted, self.earlier_wall)
        write_summary(self.dir, summary)
        if self.interrupted:
            raise RunInterrupted(self.model_dir / "latest", self.failure)
        hours, rest = divmod(int(summary["wall_seconds"]), 3600)
        evaluation = "no evaluation" if math.isnan(loop.last_eval_return) else f"evaluation return {loop.last_eval_return:.1f}"
        objective = summary.get("final_objective_success")
        if objective is not None and not math.isnan(objective):
            evaluation += f", objective success {objective:.3g}"
        labels = f", {loop.labels_obtained} labels" if hasattr(loop, "labels_obtained") else ""
        print(
            f"run {self.name} done at step {loop.global_step}: {evaluation}{labels}, "
            f"{hours}:{rest // 60:02d}:{rest % 60:02d} of training; summary in {self.dir / 'summary.json'}",
            flush=True,
        )
        return summary


@dataclass
class IterationStart:
    """The state an on-policy iteration (PrefPPO's rollout and update) starts from. Interrupted mid-iteration, a run
    saves this (with the networks and labels as they are), so that the resumed run collects the interrupted rollout
    again: exactly so when the interruption came before the iteration's update changed the agent and before a feedback
    session began (after that, the labels obtained are kept and the numpy RNG runs on, so the session is not asked
    again with the same pairs: `session_started`)."""

    global_step: int
    iteration: int
    states: dict  # the named parts' state_dicts, the RNGs and the environments
    rb_position: tuple[int, bool]
    session_started: bool = False

    @classmethod
    def capture(cls, loop, parts: dict, names: tuple[str, ...], rng, envs, obs, rb) -> "IterationStart":
        states = {name: parts[name].state_dict() for name in names} | rng_states(rng) | {"env": capture_env_state(envs, obs)}
        return cls(loop.global_step, loop.iteration, states, (rb.pos, rb.full))

    def rewind(self, state: dict, rb) -> dict:
        """A checkpoint's state with everything but the networks and labels taken back to the iteration's start, and the
        replay buffer's position with it."""
        rb.pos, rb.full = self.rb_position
        states = {name: value for name, value in self.states.items() if not (name == "rng" and self.session_started)}
        return state | states | {"loop": state["loop"] | {"global_step": self.global_step, "iteration": self.iteration}}
