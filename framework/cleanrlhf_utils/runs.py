"""What every training script does around its algorithm: refuse bad input in one line, seed, log, checkpoint,
evaluate, and turn exceptions into exit codes."""

import contextlib
import json
import math
import os
import random
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch


class ConfigError(ValueError):
    """Bad command-line input: printed as one line, exit code 2, before any training."""


def need(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass
class CheckpointArgs:
    """Checkpoints of the preference-learning scripts: periodic, resumable, and the reusable end of exploration."""

    checkpoint_frequency: int = 100_000
    """environment steps between checkpoints to models/<run>/latest (PrefPPO: checked after each iteration; 0: only
    at the end)"""
    resume: str | None = None
    """continue a run from a checkpoint folder (models/<run>/latest)"""
    exploration_load: bool = False
    """skip exploration: load the agent and replay buffer saved after a previous exploration"""
    path_to_replay_buffer: str | None = None
    """replay buffer file of an exploration checkpoint (models/<run>/<explore_steps>/replay_buffer.npz)"""
    path_to_model: str | None = None
    """model file of an exploration checkpoint (models/<run>/<explore_steps>/checkpoint.pt)"""


def need_flag(args, name: str, ok: Callable[[Any], bool], rule: str) -> None:
    """One flag's range: `--name must be <rule>, got <value>`."""
    value = getattr(args, name)
    need(ok(value), f"--{name.replace('_', '-')} must be {rule}, got {value}")


def validate_preference_args(args) -> None:
    """The settings of preference learning (the PreferenceArgs both algorithm scripts carry), the teacher's and
    the checkpoints'."""
    from .feedback import validate_feedback_args  # feedback.py imports this module

    at_least = {
        "buffer_size": 1, "teacher_feedback_total_queries": 0, "teacher_feedback_num_queries_per_session": 1,
        "teacher_feedback_frequency": 1, "segment_length": 2, "preference_sampling_pool_factor": 1, "reward_ensemble_size": 1,
        "relabel_chunk_size": 1, "unlabeled_batch_ratio": 0, "explore_knn_k": 1, "heldout_fresh_pairs": 1,
        "qpa_query_episodes": 0, "qpa_augmentations": 0,
    }  # fmt: skip
    for name, low in at_least.items():
        need_flag(args, name, lambda value, low=low: value >= low, f">= {low}")
    need_flag(args, "teacher_feedback_exponential_decay", lambda value: 0 < value <= 1, "in (0, 1]")
    for name in ("reward_net_dropout", "reward_net_heldout_fraction"):
        need_flag(args, name, lambda value: 0 <= value < 1, "in [0, 1)")
    for name in ("teacher_eps_mistake", "teacher_eps_skip", "teacher_eps_equal", "teacher_gamma"):
        need_flag(args, name, lambda value: 0 <= value <= 1, "in [0, 1]")
    need_flag(args, "surf_tau", lambda value: 0.5 < value < 1, "in (0.5, 1)")
    need_flag(args, "qpa_hybrid_ratio", lambda value: 0 <= value <= 1, "in [0, 1]")
    need_flag(args, "robust_label_epsilon", lambda value: 0 <= value < 0.5, "in [0, 0.5)")
    need_flag(args, "rime_flip_tau", lambda value: 0 < value < 0.5, "in (0, 0.5)")
    for name in ("rime_alpha", "rime_beta_min", "rime_warm_start_steps"):
        need_flag(args, name, lambda value: value >= 0, ">= 0")
    need_flag(args, "rime_beta_decay_epochs", lambda value: value >= 1, ">= 1")
    need(
        args.rime_beta_min <= args.rime_beta_max,
        f"--rime-beta-min ({args.rime_beta_min}) must be <= --rime-beta-max ({args.rime_beta_max})",
    )
    need(
        args.qpa_hybrid_ratio == 0 or args.qpa_query_episodes > 0,
        f"--qpa-hybrid-ratio {args.qpa_hybrid_ratio} needs --qpa-query-episodes N (the episodes it replays), got 0",
    )
    need(
        0 <= args.min_augmentation_offset <= args.max_augmentation_offset,
        f"--min-augmentation-offset ({args.min_augmentation_offset}) must be >= 0 and <= --max-augmentation-offset ({args.max_augmentation_offset})",
    )
    need(
        args.max_augmentation_offset < args.segment_length,
        f"--max-augmentation-offset ({args.max_augmentation_offset}) must be smaller than --segment-length ({args.segment_length})",
    )
    need(
        args.rune_beta >= 0 and 0 <= args.rune_beta_decay < 1,
        f"--rune-beta must be >= 0 and --rune-beta-decay in [0, 1), got {args.rune_beta} and {args.rune_beta_decay}",
    )
    validate_feedback_args(args)
    validate_checkpoint_args(args)


def validate_checkpoint_args(args: CheckpointArgs) -> None:
    """--checkpoint-frequency, --resume and --exploration-load of the preference-learning scripts."""
    need(args.checkpoint_frequency >= 0, f"--checkpoint-frequency must be >= 0, got {args.checkpoint_frequency}")
    if args.exploration_load:
        for flag, path in (("--path-to-replay-buffer", args.path_to_replay_buffer), ("--path-to-model", args.path_to_model)):
            need(path is not None, f"--exploration-load needs {flag}")
            need(Path(path).is_file(), f"{flag} {path} does not exist")
    if args.resume is not None:
        need((Path(args.resume) / "checkpoint.pt").is_file(), f"--resume {args.resume}: no checkpoint.pt in that folder")


def default_run_name(args) -> str:
    return f"{args.env_id.replace('/', '_')}__{args.exp_name}__{args.seed}__{int(time.time())}"


def set_torch_threads(threads: int) -> None:
    """torch's intra-op CPU threads (0: torch's default). For networks of a few 256-wide layers one thread is
    fastest: more threads mostly wait for each other, and on a busy machine for other processes (measured 10x slower
    with torch's default on 2 busy cores). Called before any tensor work."""
    if threads > 0:
        torch.set_num_threads(threads)


def seed_everything(args) -> tuple[torch.device, np.random.Generator]:
    """Sets torch's threads (--torch-threads), seeds Python and torch; returns the device and the numpy generator of the run."""
    set_torch_threads(args.torch_threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    return device, np.random.default_rng(args.seed)


SECRET_ARGS = ("feedback_server_token",)
"""settings written as null wherever settings are stored (args.json, TensorBoard's hyperparameters, the W&B config,
checkpoints, sweep trials): the key stays, the value never leaves the process"""


def public_settings(args) -> dict:
    """asdict(args) with SECRET_ARGS as null: what may be written to a file, a log or a tracking service."""
    return {key: None if key in SECRET_ARGS else value for key, value in asdict(args).items()}


def start_logging(args, run_name: str, run_dir: Path):
    """TensorBoard (plus W&B with --track) for a run; its settings also go to runs/<run>/args.json (SECRET_ARGS as null)."""
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
    writer = SummaryWriter(str(run_dir))
    table = "\n".join(f"|{key}|{value}|" for key, value in settings.items())
    writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
    (run_dir / "args.json").write_text(json.dumps(settings, indent=2))
    return writer


def stop_logging(args, writer) -> None:
    writer.close()
    if args.track:
        import wandb

        wandb.finish()


def log_video(args, video: Path | None, step: int) -> None:
    """An evaluation video to W&B (TensorBoard's add_video writes nothing with moviepy 2)."""
    if video is not None and args.track:
        import wandb

        wandb.log({"eval/video": wandb.Video(str(video), format="mp4")}, step=step)


def save_checkpoint(folder: Path, state: dict, rb=None) -> None:
    """checkpoint.pt (networks, optimisers, buffers of labels, RNGs, counters) + replay_buffer.npz, each
    written to a temporary name first so that a kill mid-write leaves the previous checkpoint intact."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "checkpoint.pt.tmp"
    torch.save(state, tmp)
    if rb is not None:
        rb.save(folder / "replay_buffer.npz")
    os.replace(tmp, folder / "checkpoint.pt")


def checkpoint_file(path: str | Path) -> Path:
    """--path-to-model: a checkpoint.pt, or the folder holding it (models/<run>/latest)."""
    path = Path(path)
    if path.is_dir():
        path = path / "checkpoint.pt"
    need(path.is_file(), f"--path-to-model {path} does not exist")
    return path


def load_checkpoint(path: str | Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def evaluate_policy(*args, **kwargs) -> list[float]:
    """The returns of evaluate_episodes (same arguments), without the successes."""
    return evaluate_episodes(*args, **kwargs)[0]


def evaluate_episodes(
    policy: torch.nn.Module,
    env_id: str,
    episodes: int,
    seed: int,
    device,
    video_path: str | Path | None = None,
    width: int = 320,
    height: int = 240,
    terminate_when_unhealthy: bool = True,
    task_seed: int | None = None,
) -> tuple[list[float], list[bool | None]]:
    """True returns of `policy.deterministic_action` over episodes with seeds seed, seed+1, ..., and whether each
    reached info["success"] (None on envs without it); optionally an mp4 of the first. `task_seed`: the Meta-World
    layout to evaluate on (default: seed's). Deterministic actions draw no random numbers, so evaluating leaves
    training's RNG alone."""
    import gymnasium as gym

    from .envs import make_env, reached_success, write_mp4

    render_mode = "rgb_array" if video_path else None
    env = make_env(env_id, seed, render_mode, width, height, terminate_when_unhealthy, task_seed=task_seed)()
    discrete = isinstance(env.action_space, gym.spaces.Discrete)
    returns, successes, frames = [], [], []
    policy.eval()
    for episode in range(episodes):
        obs, _ = env.reset(seed=seed + episode)
        done, total, infos = False, 0.0, []
        while not done:
            if video_path and episode == 0:
                frames.append(env.render())
            with torch.no_grad():
                action = policy.deterministic_action(torch.as_tensor(obs, dtype=torch.float32, device=device).unsqueeze(0))
            action = action.squeeze(0).cpu().numpy()
            obs, reward, terminated, truncated, info = env.step(int(action) if discrete else action)
            total += float(reward)
            infos.append({"success": info["success"]} if "success" in info else {})
            done = terminated or truncated
        returns.append(total)
        successes.append(reached_success(infos))
    policy.train()
    if video_path and frames:
        write_mp4(video_path, np.stack(frames), env.metadata.get("render_fps", 30))
    env.close()
    return returns, successes


def success_rate(successes: list[bool | None]) -> float | None:
    """The fraction of episodes that reached success, or None when the env reports no success (most envs)."""
    known = [success for success in successes if success is not None]
    return float(np.mean(known)) if known else None


class EvalReturn(float):
    """An evaluation's mean return that also carries its success rate (None: the env reports none). A float, so the
    scripts keep it where they kept the return; the run summary and a sweep's pruner read the rate from it."""

    def __new__(cls, mean_return: float, success_rate: float | None = None):
        value = super().__new__(cls, mean_return)
        value.success_rate = success_rate
        return value


def success_summary(last_eval: float) -> dict:
    """{"final_success_rate": ...} from the last evaluation, on envs that report success (else nothing)."""
    rate = getattr(last_eval, "success_rate", None)
    return {} if rate is None else {"final_success_rate": rate}


class RunningMoments:
    """Running mean and variance of arrays of one shape (parallel algorithm of Chan et al.), in float64: of PEBBLE's
    k-NN distances (the intrinsic reward is divided by their std), of PPO's observations and returns."""

    def __init__(self, shape: tuple | int = ()):
        self.mean, self.var, self.count = np.zeros(shape), np.ones(shape), 1e-4

    def update(self, x: np.ndarray | torch.Tensor) -> None:
        """x: (B, *shape)."""
        x = np.asarray(x.detach().cpu() if isinstance(x, torch.Tensor) else x, dtype=np.float64)
        if len(x) == 0:
            return
        batch_mean, batch_var, batch_count = x.mean(0), x.var(0), len(x)
        delta, total = batch_mean - self.mean, self.count + batch_count
        self.mean = self.mean + delta * batch_count / total
        m2 = self.var * self.count + batch_var * batch_count + delta**2 * self.count * batch_count / total
        self.var, self.count = m2 / total, total

    @property
    def std(self) -> np.ndarray:
        return np.sqrt(self.var)

    def state_dict(self) -> dict:
        return {"mean": np.array(self.mean), "var": np.array(self.var), "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var, self.count = np.array(state["mean"]), np.array(state["var"]), float(state["count"])


@contextlib.contextmanager
def frozen(module: torch.nn.Module):
    """The module's weights take no gradient inside the block: a loss still back-propagates through it (into its
    inputs) but autograd skips the weight-gradient matmuls, a third of the module's backward pass."""
    module.requires_grad_(False)
    try:
        yield
    finally:
        module.requires_grad_(True)


def load_optimizer(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """An optimizer's saved state, stepped with this run's kernel: a checkpoint's own settings (an older checkpoint's,
    or one from a run with other --compile/--cudagraphs) would replace it, or clash with it."""
    kernel = [{key: group[key] for key in ("foreach", "fused", "capturable")} for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, settings in zip(optimizer.param_groups, kernel):
        group.update(settings)
        if settings["fused"] or settings["capturable"]:  # these kernels keep the step count beside the parameter
            for param in group["params"]:
                param_state = optimizer.state.get(param, {})
                if "step" in param_state:
                    param_state["step"] = param_state["step"].to(device=param.device, dtype=torch.float32)


def crossed(every: int, before: int, after: int) -> bool:
    """Whether the steps (before, after] contain a multiple of `every` (0: never)."""
    return every > 0 and before // every < after // every


HUMAN_LABEL_DEFAULTS = {"teacher_feedback_total_queries": 100, "teacher_feedback_num_queries_per_session": 10}
"""The label budget of --teacher-feedback-mode human where the command line sets none: 100 labels in 10 sessions, 22
pairs in the first under the default exponential schedule (a few minutes of a person's time, at a few seconds a pair),
instead of the synthetic teacher's 1000 in sessions from 224 pairs down; the human sweep (sweep_config/human.yaml)
uses the same budget."""


def human_sized_defaults(args, given: set[str], schedule: Callable | None = None):
    """`args` with HUMAN_LABEL_DEFAULTS for each budget flag the command line did not set, in human mode (else `args`
    itself), saying so in one line. `schedule`: the script's feedback_schedule, to say what the first session asks."""
    if getattr(args, "teacher_feedback_mode", None) != "human":
        return args
    applied = {name: value for name, value in HUMAN_LABEL_DEFAULTS.items() if name not in given}
    if not applied:
        return args
    args = replace(args, **applied)
    flags = " ".join(f"--{name.replace('_', '-')} {value}" for name, value in applied.items())
    total, per_session = args.teacher_feedback_total_queries, args.teacher_feedback_num_queries_per_session
    sessions = schedule(total, per_session, args.teacher_feedback_schedule, args.teacher_feedback_exponential_decay) if schedule else []
    plan = f"{sum(sessions)} labels over {len(sessions)} sessions, {sessions[0]} in the first" if sessions else f"{total} labels"
    print(f"human mode: {plan} (human-sized defaults {flags}; give these flags to choose otherwise)")
    return args


def command_line_args(args_class: type, argv: list[str] | None = None):
    """The settings a command line (default: sys.argv[1:]) asks for: tyro's parse (its errors as one line), then, in
    human mode, human-sized defaults for the label budget flags it does not set."""
    from .arguments import given_fields, parse_args

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(args_class, argv)
    schedule = getattr(sys.modules.get(args_class.__module__), "feedback_schedule", None)
    return human_sized_defaults(args, given_fields(argv, args_class), schedule)


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C, after the run saved what --resume continues from (`checkpoint`: models/<run>/latest)."""

    def __init__(self, checkpoint: Path):
        super().__init__(str(checkpoint))
        self.checkpoint = checkpoint


def announce_run(run_name: str, args) -> None:
    """The start-up line: the run's name and where its outputs go (videos: evaluation videos with --capture-video, the
    clips people compare in human mode)."""
    places = [f"logs and summary in runs/{run_name}", f"checkpoints in models/{run_name}"]
    if getattr(args, "capture_video", False) or getattr(args, "teacher_feedback_mode", None) == "human":
        places.append(f"videos in videos/{run_name}")
    print(f"run {run_name}: {', '.join(places)}", flush=True)


def resume_command(argv: list[str], checkpoint: Path) -> str:
    """The command line that continues an interrupted run: this one (script, flags) with --resume <checkpoint> in place
    of any earlier --resume, run from the same folder. Secret settings are left out (the line is printed, and may be
    logged): the run takes them from their environment variable instead (--feedback-server-token: FEEDBACK_SERVER_TOKEN)."""
    dropped = {"--resume", *(f"--{name.replace('_', '-')}" for name in SECRET_ARGS)}
    flags, skip = [], False
    for token in argv[1:]:
        if skip or token in dropped or token.split("=", 1)[0] in dropped:
            skip = token in dropped
            continue
        flags.append(token)
    on_path = shutil.which("python")  # `python` where it is this interpreter (an activated venv), else its full path
    python = "python" if on_path and Path(on_path).resolve() == Path(sys.executable).resolve() else sys.executable
    return shlex.join([python, argv[0], *flags, "--resume", str(checkpoint)])


def cli(args_class: type, main: Callable) -> None:
    """`python script.py --flags`: parse into args_class with tyro, run main, and map failures to exit codes:
    bad input 2 (one line on stderr, tyro's parse errors included), an unreachable or refusing feedback server 1,
    Ctrl-C 130."""
    from .feedback import FeedbackServerError

    args = command_line_args(args_class)
    try:
        main(args)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except FeedbackServerError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt as interrupt:
        if isinstance(interrupt, RunInterrupted):  # the run saved its checkpoint: say how to continue it
            print(f"to resume: {resume_command(sys.argv, interrupt.checkpoint)}", flush=True)
        sys.exit(130)


def earlier_wall_seconds(resume_state: dict | None) -> float:
    """The training seconds a run spent before the checkpoint it resumes from (0: a fresh run, or a checkpoint from
    before checkpoints kept them)."""
    return float(resume_state.get("wall_seconds", 0.0)) if resume_state else 0.0


def training_state(parts: dict, rng: np.random.Generator) -> dict:
    """What a checkpoint carries besides the replay buffer and the env: each part's state_dict() (networks,
    optimisers, buffers, normalisers, teacher), numpy's and torch's RNG."""
    state = {name: part.state_dict() for name, part in parts.items()}
    return state | {"rng": rng.bit_generator.state, "torch_rng": torch.get_rng_state()}


def load_training_state(parts: dict, rng: np.random.Generator, state: dict) -> None:
    for name, part in parts.items():
        if name == "session" and name not in state:  # a checkpoint from before sessions were saved: none was open
            continue
        if name == "label_filter" and name not in state:  # --robust-labels rime loading another run's exploration: fresh
            continue
        part.load_state_dict(state[name])
    rng.bit_generator.state = state["rng"]
    torch.set_rng_state(state["torch_rng"])


def evaluate_and_log(policy, args, writer, video_dir: Path, device, step: int, on_evaluation: Callable | None = None) -> EvalReturn:
    """One evaluation (args.evaluation_episodes episodes on seeds from args.seed + 100000, on the layout of the
    run's seed) logged to TensorBoard (and its video to W&B): eval/mean_return, and eval/success_rate on envs that
    report success; `on_evaluation(step, mean_return)` lets a sweep see it and prune the run."""
    video = video_dir / f"eval_step_{step}.mp4" if args.capture_video else None
    returns, successes = evaluate_episodes(
        policy,
        args.env_id,
        args.evaluation_episodes,
        args.seed + 100_000,
        device,
        video,
        args.video_width,
        args.video_height,
        args.terminate_when_unhealthy,
        task_seed=args.seed,
    )
    result = EvalReturn(float(np.mean(returns)), success_rate(successes))
    writer.add_scalar("eval/mean_return", float(result), step)
    writer.add_scalar("eval/std_return", float(np.std(returns)), step)
    if result.success_rate is not None:
        writer.add_scalar("eval/success_rate", result.success_rate, step)
    log_video(args, video, step)
    if on_evaluation is not None:
        on_evaluation(step, result)
    return result


def progress_bar(args, total: int, initial: int = 0):
    """A tqdm bar over environment steps, or None with --no-progress-bar."""
    if not args.progress_bar:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)


def log_feedback_session(writer, loop, session, reward_stats: dict, metrics: dict) -> None:
    """TensorBoard scalars of a reward update from a feedback session (cleanrlhf_utils.feedback.FeedbackSession): labels
    so far, seconds from the pairs' selection to now, seconds the trainer waited for people in this session and people
    for the trainer in all (human mode), the reward update, the reward model's metrics."""
    step = loop.global_step
    counts = {"labels_obtained": loop.labels_obtained, "queries_skipped": loop.queries_skipped, "sessions": loop.sessions_done}
    seconds = {"session_seconds": time.time() - session.opened_at, "trainer_idle_seconds": session.session_trainer_idle}
    for name, value in (counts | seconds | {"people_idle_seconds": session.people_idle}).items():
        writer.add_scalar(f"feedback/{name}", value, step)
    for name, value in (reward_stats | metrics).items():
        writer.add_scalar(f"reward_model/{name}", value, step)


def run_summary(
    run_name: str, args, loop, metrics: dict, wall: float, start_step: int, interrupted: bool, earlier_wall: float = 0.0
) -> dict:
    """runs/<run>/summary.json of a preference-learning run (sweeps and the toolbox read it). `wall`: this process's
    training seconds; `earlier_wall`: those of the processes before it (a resumed run's checkpoint keeps them), so
    wall_seconds is the whole run's; sps is this process's (its steps over its seconds)."""
    return {
        "run_name": run_name, "env_id": args.env_id, "teacher_feedback_mode": args.teacher_feedback_mode,
        "global_step": loop.global_step, "final_eval_return": float(loop.last_eval_return), **success_summary(loop.last_eval_return),
        "labels_obtained": loop.labels_obtained, "queries_skipped": loop.queries_skipped, "feedback_sessions": loop.sessions_done,
        **metrics, "wall_seconds": earlier_wall + wall, "sps": (loop.global_step - start_step) / wall, "interrupted": interrupted,
    }  # fmt: skip


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
