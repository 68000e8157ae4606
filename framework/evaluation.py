# Evaluate a trained policy (sac_rlhf.py, sac.py, pref_ppo.py or ppo.py): N episodes with deterministic actions on distinct seeds, mean ± std of
# the environment's true return, the success rate where the env reports success (Meta-World), and optionally an mp4 per episode.
#   python framework/evaluation.py --path-to-model models/<run>/latest --env-id Hopper-v5
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import ppo
from cleanrlhf_utils.checkpoints import checkpoint_file, load_checkpoint
from cleanrlhf_utils.cli import cli
from cleanrlhf_utils.envs import check_env_id
from cleanrlhf_utils.errors import ConfigError
from cleanrlhf_utils.evaluate import evaluate_episodes, success_rate
from cleanrlhf_utils.objectives import load_objective
from cleanrlhf_utils.training import set_torch_threads
from sac import Actor, make_env


@dataclass
class Args:
    path_to_model: str
    """checkpoint.pt of a run, or the folder holding it (models/<run>/latest)"""
    env_id: str | None = None
    """environment to evaluate on (default: the one the model was trained on)"""
    episodes: int = 10
    """number of evaluation episodes"""
    seed: int = 0
    """episode i is reset with seed + i"""
    capture_video: bool = False
    """write one mp4 per episode"""
    video_dir: str = "videos/evaluation"
    """where the videos go"""
    video_width: int = 320
    """width of the video frames"""
    video_height: int = 240
    """height of the video frames"""
    output_json: str | None = None
    """also write the returns to this JSON file"""
    torch_threads: int = 1
    """torch's intra-op threads on the CPU: one is fastest for a policy this size, most of all on a shared machine;
    0 keeps torch's default"""
    terminate_when_unhealthy: bool | None = None
    """end episodes when the robot falls (default: as the model was trained; a run with --no-terminate-when-unhealthy
    is evaluated without that termination)"""
    terminate_when_tilted: bool | None = None
    """with unhealthy termination, also end episodes when the torso tilts too far (default: as the model was trained;
    a run with --no-terminate-when-tilted is evaluated ending on falls only)"""
    objective: str | None = None
    """also measure this --teacher-objective (a built-in name or module:function; default: the one the model was
    trained with, if any; '' measures none)"""


def load_actor(path: str | Path, env_id: str | None = None) -> tuple[torch.nn.Module, str]:
    """The deterministic policy of a checkpoint (SAC's actor, or PPO's agent with its observation normalisation)
    and the env id to run it on (default: the one it was trained on)."""
    path = checkpoint_file(path)
    checkpoint = load_checkpoint(path)
    if checkpoint.get("algorithm") in ("pref_ppo", "ppo"):  # PPO policy, with its observation normalisation
        return ppo.load_policy(path, env_id)
    train_args = checkpoint["args"]
    env_id = env_id or train_args["env_id"]
    check_env_id(env_id)
    env = make_env(env_id, 0)()
    space = env.action_space
    obs_dim = int(np.prod(env.observation_space.shape))
    env.close()
    actor = Actor(obs_dim, space.low, space.high, train_args["actor_hidden_dim"], train_args["actor_hidden_layers"])
    try:
        actor.load_state_dict(checkpoint["agent"]["actor"])
    except RuntimeError as error:
        raise ConfigError(f"the model in {path} does not fit --env-id {env_id}: {str(error).splitlines()[0]}") from None
    return actor, env_id


def main(args: Args) -> dict:
    if args.episodes < 1:
        raise ConfigError(f"--episodes must be >= 1, got {args.episodes}")
    set_torch_threads(args.torch_threads)
    actor, env_id = load_actor(args.path_to_model, args.env_id)
    trained_with = load_checkpoint(checkpoint_file(args.path_to_model))["args"]
    terminate_when_unhealthy = args.terminate_when_unhealthy
    if terminate_when_unhealthy is None:
        terminate_when_unhealthy = trained_with.get("terminate_when_unhealthy", True) or env_id != trained_with["env_id"]
    terminate_when_tilted = args.terminate_when_tilted
    if terminate_when_tilted is None:
        terminate_when_tilted = trained_with.get("terminate_when_tilted", True) or env_id != trained_with["env_id"]
    task_seed = trained_with["seed"] if env_id == trained_with["env_id"] else None  # Meta-World: the layout it was trained on
    objective_name = trained_with.get("teacher_objective", "") if args.objective is None else args.objective
    objective = load_objective(objective_name) if objective_name else None
    returns, successes, measures = [], [], []
    for episode in range(args.episodes):
        video = Path(args.video_dir) / f"episode_{episode}.mp4" if args.capture_video else None
        episode_returns, episode_successes = evaluate_episodes(
            actor,
            env_id,
            1,
            args.seed + episode,
            torch.device("cpu"),
            video,
            args.video_width,
            args.video_height,
            terminate_when_unhealthy,
            task_seed,
            objective=objective,
            objective_measures=measures,
            terminate_when_tilted=terminate_when_tilted,
        )
        returns, successes = returns + episode_returns, successes + episode_successes
    result = {
        "env_id": env_id,
        "episodes": args.episodes,
        "mean_return": float(np.mean(returns)),
        "std_return": float(np.std(returns)),
        "returns": returns,
    }
    rate = success_rate(successes)
    if rate is not None:  # envs that report success (Meta-World): the metric their papers give
        result |= {"success_rate": rate, "successes": successes}
    if objective is not None:  # what --teacher-objective measured, per episode
        result |= {"objective": objective.name, "objective_returns": [ret for ret, _ in measures]}
        result["objective_return"] = float(np.mean(result["objective_returns"]))
        if objective.success is not None:
            result["objective_success"] = float(np.mean([success for _, success in measures]))
    success = "" if rate is None else f", success rate {rate:.2f}"
    if objective is not None:
        success += f", {objective.name} return {result['objective_return']:.2f}" + (
            f" (success {result['objective_success']:.2f})" if "objective_success" in result else ""
        )
    print(f"{env_id}: {result['mean_return']:.1f} ± {result['std_return']:.1f} over {args.episodes} episodes{success}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    cli(Args, main)
