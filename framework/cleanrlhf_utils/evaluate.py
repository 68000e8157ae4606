"""Evaluating a policy on the environment's true reward: episodes on fixed seeds, their returns and successes, an
optional video, and the logged result a sweep can prune on."""

from collections.abc import Callable
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

from .envs import get_physics_state, make_env, reached_success, write_mp4
from .objectives import Objective, episode_measures, mean_measures, run_objective


def log_video(args, video: Path | None, step: int) -> None:
    """An evaluation video to W&B (TensorBoard's add_video writes nothing with moviepy 2)."""
    if video is not None and args.track:
        import wandb

        wandb.log({"eval/video": wandb.Video(str(video), format="mp4")}, step=step)


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
    objective: Objective | None = None,
    objective_measures: list | None = None,
    terminate_when_tilted: bool = True,
    camera: str = "env",
    first_states: list | None = None,
) -> tuple[list[float], list[bool | None]]:
    """True returns of `policy.deterministic_action` over episodes with seeds seed, seed+1, ..., and whether each
    reached info["success"] (None on envs without it); optionally an mp4 of the first, from `camera` (CAMERAS).
    `task_seed`: the Meta-World layout to evaluate on (default: seed's). Deterministic actions draw no random numbers, so evaluating leaves
    training's RNG alone. With an `objective`, each episode's EpisodeMeasures (objective return, success, further
    measures) is appended to `objective_measures`, measured on the observations, actions and simulator states the episode
    went through. `first_states` receives the simulator states of the first episode (a clip of it can be rendered later,
    elsewhere)."""
    render_mode = "rgb_array" if video_path else None
    env = make_env(
        env_id,
        seed,
        render_mode,
        width,
        height,
        terminate_when_unhealthy,
        task_seed=task_seed,
        terminate_when_tilted=terminate_when_tilted,
        camera=camera,
        ends_episode=None if objective is None else objective.ends_episode,
    )()
    discrete = isinstance(env.action_space, gym.spaces.Discrete)
    returns, successes, frames = [], [], []
    policy.eval()
    for episode in range(episodes):
        obs, _ = env.reset(seed=seed + episode)
        done, total, infos = False, 0.0, []
        lived = {"obs": [obs], "actions": [], "states": [get_physics_state(env)]} if objective is not None else None
        while not done:
            if video_path and episode == 0:
                frames.append(env.render())
            if first_states is not None and episode == 0:
                first_states.append(get_physics_state(env))
            with torch.no_grad():
                action = policy.deterministic_action(torch.as_tensor(obs, dtype=torch.float32, device=device).unsqueeze(0))
            action = action.squeeze(0).cpu().numpy()
            obs, reward, terminated, truncated, info = env.step(int(action) if discrete else action)
            total += float(reward)
            infos.append({"success": info["success"]} if "success" in info else {})
            done = terminated or truncated
            if lived is not None:
                for key, value in (("obs", obs), ("actions", np.atleast_1d(action)), ("states", get_physics_state(env))):
                    lived[key].append(value)
        if lived is not None and objective_measures is not None:
            arrays = [np.asarray(lived[key], dtype=np.float64) for key in ("obs", "actions", "states")]
            objective_measures.append(episode_measures(objective, *arrays))
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

    def __new__(
        cls,
        mean_return: float,
        success_rate: float | None = None,
        objective_return: float | None = None,
        objective_success: float | None = None,
        objective_measures: dict[str, float] | None = None,
    ):
        value = super().__new__(cls, mean_return)
        value.success_rate = success_rate
        value.objective_return, value.objective_success = objective_return, objective_success  # --teacher-objective's
        value.objective_measures = objective_measures or {}  # its further measures, by name
        return value


def success_summary(last_eval: float) -> dict:
    """{"final_success_rate": ...} from the last evaluation, on envs that report success (else nothing)."""
    summary = {
        "final_success_rate": getattr(last_eval, "success_rate", None),
        "final_objective_return": getattr(last_eval, "objective_return", None),  # --teacher-objective
        "final_objective_success": getattr(last_eval, "objective_success", None),
        **{f"final_objective_{name}": value for name, value in getattr(last_eval, "objective_measures", {}).items()},
    }
    return {key: value for key, value in summary.items() if value is not None}


def evaluate_and_log(
    policy, args, writer, video_dir: Path, device, step: int, on_evaluation: Callable | None = None, show: Callable | None = None
) -> EvalReturn:
    """One evaluation (args.evaluation_episodes episodes on seeds from args.seed + 100000, on the layout of the
    run's seed) logged to TensorBoard (and its video to W&B): eval/mean_return, and eval/success_rate on envs that
    report success, eval/objective_return (and eval/objective_success, eval/objective_<name> of its further
    measures) with --teacher-objective or --reward-objective; `on_evaluation(step, mean_return)` lets a sweep see it and
    prune the run; `show(states, step, mean_return)` gets the first episode's simulator states (human mode: the page
    shows people a clip of what the agent does now)."""
    video = video_dir / f"eval_step_{step}.mp4" if args.capture_video else None
    objective, measures = run_objective(args), []
    states = [] if show is not None else None
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
        objective=objective,
        objective_measures=measures,
        terminate_when_tilted=args.terminate_when_tilted,
        first_states=states,
    )
    objective_return = float(np.mean([episode.objective_return for episode in measures])) if measures else None
    objective_successes = [episode.success for episode in measures if episode.success is not None]
    objective_success = float(np.mean(objective_successes)) if objective_successes else None
    further = mean_measures(measures)
    result = EvalReturn(float(np.mean(returns)), success_rate(successes), objective_return, objective_success, further)
    writer.add_scalar("eval/mean_return", float(result), step)
    writer.add_scalar("eval/std_return", float(np.std(returns)), step)
    if result.success_rate is not None:
        writer.add_scalar("eval/success_rate", result.success_rate, step)
    if objective_return is not None:
        writer.add_scalar("eval/objective_return", objective_return, step)
    if objective_success is not None:
        writer.add_scalar("eval/objective_success", objective_success, step)
    for name, value in further.items():
        writer.add_scalar(f"eval/objective_{name}", value, step)
    log_video(args, video, step)
    if show is not None and states:
        show(np.asarray(states), step, float(result))
    if on_evaluation is not None:
        on_evaluation(step, result)
    return result
