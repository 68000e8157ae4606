# Evaluate a trained policy (sac_rlhf.py, sac.py, pref_ppo.py or ppo.py), or a shipped one (policies/): N episodes with deterministic actions on
# distinct seeds, mean ± std of the environment's true return, the success rate where the env reports success (Meta-World), the objective's
# measures where there is one, and optionally an mp4 per episode.
#   python framework/evaluation.py --path-to-model models/<run>/latest --env-id Hopper-v5
#   python framework/evaluation.py --policy policies/hopper-landed-backflip-sac.pt --episodes 10 --video
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import numpy as np
import torch
import tyro

import ppo
from cleanrlhf_utils.checkpoints import checkpoint_file, load_checkpoint
from cleanrlhf_utils.cli import cli
from cleanrlhf_utils.envs import CAMERAS, check_env_id
from cleanrlhf_utils.errors import ConfigError, need
from cleanrlhf_utils.evaluate import evaluate_episodes, success_rate
from cleanrlhf_utils.objectives import load_objective, mean_measures
from cleanrlhf_utils.policies import MANIFEST
from cleanrlhf_utils.training import set_torch_threads
from sac import Actor, make_env


@dataclass
class Args:
    path_to_model: str | None = None
    """checkpoint.pt of a run, or the folder holding it (models/<run>/latest)"""
    policy: str | None = None
    """instead of --path-to-model: a shipped policy's .pt (policies/<name>.pt), run on the env, objective and
    settings its entry in the manifest.json beside it records"""
    env_id: str | None = None
    """environment to evaluate on (default: the one the model was trained on)"""
    episodes: int = 10
    """number of evaluation episodes"""
    seed: int = 0
    """episode i is reset with seed + i"""
    capture_video: Annotated[bool, tyro.conf.arg(aliases=("--video",))] = False
    """write one mp4 per episode (--video for short)"""
    camera: str | None = None
    """the videos' view: env (the env's own) or side (fixed beside the start, the floor in view); default: a shipped
    policy's manifest entry's, else env"""
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


def manifest_entry(path: str | Path) -> dict:
    """A shipped policy's entry in the manifest.json beside its file (ConfigError in one line where there is none)."""
    path = Path(path)
    need(path.is_file(), f"--policy {path}: no such file (shipped policies are policies/*.pt)")
    manifest = path.parent / MANIFEST
    need(manifest.is_file(), f"--policy {path}: no {MANIFEST} beside it to say what it is")
    entry = json.loads(manifest.read_text()).get(path.name)
    need(entry is not None, f"--policy {path}: {manifest} has no entry {path.name}")
    return entry


def load_shipped_policy(path: str | Path) -> tuple[torch.nn.Module, dict]:
    """A shipped policy's actor, rebuilt from its manifest entry (env, hidden sizes) and loaded with the weights in the
    file (a SAC actor's state_dict), and the entry."""
    entry = manifest_entry(path)
    check_env_id(entry["env_id"])
    env = make_env(entry["env_id"], 0)()
    space, obs_dim = env.action_space, int(np.prod(env.observation_space.shape))
    env.close()
    actor = Actor(obs_dim, space.low, space.high, entry["actor_hidden_dim"], entry["actor_hidden_layers"])
    actor.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return actor, entry


def main(args: Args) -> dict:
    if args.episodes < 1:
        raise ConfigError(f"--episodes must be >= 1, got {args.episodes}")
    need(
        (args.path_to_model is None) != (args.policy is None),
        "give --path-to-model (a run's checkpoint) or --policy (a shipped policy), one of them",
    )
    set_torch_threads(args.torch_threads)
    if args.policy is not None:
        actor, trained_with = load_shipped_policy(args.policy)
        trained_with = trained_with | {"teacher_objective": trained_with["objective"]}
        env_id = args.env_id or trained_with["env_id"]
    else:
        actor, env_id = load_actor(args.path_to_model, args.env_id)
        trained_with = load_checkpoint(checkpoint_file(args.path_to_model))["args"]
        trained_with = trained_with | {
            "teacher_objective": trained_with.get("teacher_objective") or trained_with.get("reward_objective", "")
        }
    camera = args.camera or trained_with.get("camera", "env")
    need(camera in CAMERAS, f"--camera {camera} is not one of: {', '.join(CAMERAS)}")
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
            camera=camera,
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
    if objective is not None:  # what the objective measured, per episode and on average
        result |= {"objective": objective.name, "objective_returns": [episode.objective_return for episode in measures]}
        result["objective_return"] = float(np.mean(result["objective_returns"]))
        if objective.success is not None:
            result["objective_successes"] = [episode.success for episode in measures]
            result["objective_success"] = float(np.mean(result["objective_successes"]))
        if objective.measures:
            result["objective_measures"] = mean_measures(measures)
            result["objective_measures_per_episode"] = {
                name: [episode.measures[name] for episode in measures] for name in objective.measures
            }
    success = "" if rate is None else f", success rate {rate:.2f}"
    if objective is not None:
        success += f", {objective.name} return {result['objective_return']:.2f}" + (
            f" (success {result['objective_success']:.2f})" if "objective_success" in result else ""
        )
        success += "".join(f", {name} {value:.2f}" for name, value in result.get("objective_measures", {}).items())
    print(f"{env_id}: {result['mean_return']:.1f} ± {result['std_return']:.1f} over {args.episodes} episodes{success}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    cli(Args, main)
