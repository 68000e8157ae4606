# SAC on the environment's true reward: the baseline every preference-based run is compared with.
# It is the SAC of sac_rlhf.py (same networks, update, replay buffer, evaluation and checkpoints,
# imported from there) so that a comparison measures learning from preferences and nothing else.
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

from cleanrlhf_utils.buffers import ReplayBuffer
from cleanrlhf_utils.checkpoints import save_checkpoint
from cleanrlhf_utils.cli import cli
from cleanrlhf_utils.envs import autoreset_pending, get_physics_state, physics_state_size
from cleanrlhf_utils.evaluate import evaluate_and_log, success_summary
from cleanrlhf_utils.tracking import announce_run, default_run_name, progress_bar, start_logging, stop_logging, write_summary
from cleanrlhf_utils.training import seed_everything
from sac_rlhf import SACAgent, SACArgs, make_env, validate_sac_args


@dataclass
class Args(SACArgs):
    """SAC on the environment's true reward (the baseline of sac_rlhf.py)."""

    exp_name: str = "sac"
    """the name of this experiment (part of the run name)"""


def main(args: Args, on_evaluation: Callable[[int, float], None] | None = None) -> dict:
    """Train and return the run's summary. `on_evaluation(step, mean_return)`, if given, is called after every
    evaluation (a sweep uses it to report intermediate results and prune hopeless trials: what it raises ends the run)."""
    validate_sac_args(args)
    envs = gym.vector.SyncVectorEnv(
        [make_env(args.env_id, args.seed, args.render_mode, args.video_width, args.video_height, args.terminate_when_unhealthy)],
        autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP,
    )
    run_name = args.run_name or default_run_name(args)
    run_dir, model_dir, video_dir = Path("runs") / run_name, Path("models") / run_name, Path("videos") / run_name
    writer = start_logging(args, run_name, run_dir)
    announce_run(run_name, args)
    try:  # closed however the run ends, e.g. when a sweep prunes it from on_evaluation
        device, rng = seed_everything(args)

        obs, _ = envs.reset(seed=args.seed)
        obs_dim = int(np.prod(envs.single_observation_space.shape))
        action_space = envs.single_action_space
        action_dim = int(np.prod(action_space.shape))
        agent = SACAgent(obs_dim, action_space, args, device)
        rb = ReplayBuffer(min(args.buffer_size, args.total_timesteps), obs_dim, action_dim, physics_state_size(envs.envs[0]))

        progress = progress_bar(args, args.total_timesteps)
        start_time, episode_id, episode_return, episode_length, last_eval = time.time(), 0, 0.0, 0, float("nan")

        for global_step in range(args.total_timesteps):
            if global_step < args.learning_starts:
                actions = rng.uniform(action_space.low, action_space.high, size=(1, action_dim)).astype(np.float32)
            else:
                actions = agent.act(obs)
            physics_state = get_physics_state(envs.envs[0])
            autoreset = bool(autoreset_pending(envs)[0])
            next_obs, rewards, terminations, truncations, _ = envs.step(actions)
            if not autoreset:  # next-step autoreset: the reset step is not a transition
                rb.add(obs[0], next_obs[0], actions[0], rewards[0], terminations[0], episode_id, physics_state)
                episode_return, episode_length = episode_return + float(rewards[0]), episode_length + 1
                if terminations[0] or truncations[0]:
                    writer.add_scalar("charts/episodic_return", episode_return, global_step)
                    writer.add_scalar("charts/episodic_length", episode_length, global_step)
                    if progress is not None:
                        progress.set_postfix(ret=f"{episode_return:.0f}", eval=f"{last_eval:.0f}", refresh=False)
                    episode_id, episode_return, episode_length = episode_id + 1, 0.0, 0
            obs = next_obs

            if global_step >= args.learning_starts:
                idx = rb.sample_indices(args.batch_size, rng)
                stats = agent.update(
                    torch.as_tensor(rb.obs[idx], device=device),
                    torch.as_tensor(rb.actions[idx], device=device),
                    torch.as_tensor(rb.true_rewards[idx], device=device),
                    torch.as_tensor(rb.next_obs[idx], device=device),
                    torch.as_tensor(rb.terminated[idx], device=device),
                    global_step,
                )
                if global_step % 100 == 0:
                    for name, value in stats.items():
                        writer.add_scalar(f"losses/{name}", float(value), global_step)
            if global_step % 100 == 0:
                writer.add_scalar("charts/SPS", int((global_step + 1) / (time.time() - start_time)), global_step)
                if progress is not None:
                    progress.update(global_step + 1 - progress.n)
            if args.evaluation_frequency and (global_step + 1) % args.evaluation_frequency == 0 and global_step + 1 < args.total_timesteps:
                last_eval = evaluate_and_log(agent.actor, args, writer, video_dir, device, global_step + 1, on_evaluation)

        if progress is not None:
            progress.update(args.total_timesteps - progress.n)
            progress.close()
        wall = time.time() - start_time
        last_eval = evaluate_and_log(agent.actor, args, writer, video_dir, device, args.total_timesteps, on_evaluation)
        save_checkpoint(model_dir / "latest", {"run_name": run_name, "args": asdict(args), "agent": agent.state_dict()}, rb)
        summary = {
            "run_name": run_name,
            "env_id": args.env_id,
            "global_step": args.total_timesteps,
            "final_eval_return": float(last_eval),
            **success_summary(last_eval),  # final_success_rate, on envs that report success (Meta-World)
            "wall_seconds": wall,
            "sps": args.total_timesteps / wall,
        }
        write_summary(run_dir, summary)
        return summary
    finally:
        envs.close()
        stop_logging(args, writer)


if __name__ == "__main__":
    cli(Args, main)
