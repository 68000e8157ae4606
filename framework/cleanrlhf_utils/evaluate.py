"""Evaluating a policy on the environment's true reward: episodes on fixed seeds, their returns and successes, an
optional video, and the logged result a sweep can prune on."""

from collections.abc import Callable
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

from .envs import make_env, reached_success, write_mp4


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
) -> tuple[list[float], list[bool | None]]:
    """True returns of `policy.deterministic_action` over episodes with seeds seed, seed+1, ..., and whether each
    reached info["success"] (None on envs without it); optionally an mp4 of the first. `task_seed`: the Meta-World
    layout to evaluate on (default: seed's). Deterministic actions draw no random numbers, so evaluating leaves
    training's RNG alone."""
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
