"""SAC on another run's learned reward, frozen: the middle run of bench/reward_gap.py's decomposition. sac.py with its
own settings and loop, trained on the final reward model of a preference run (never updated, no exploration, no
teacher), so that it differs from sac.py on the true reward in the reward only.

    python bench/frozen_reward.py --reward-model-from models/<run>/latest --env-id Walker2d-v5 [more sac.py flags]

Evaluations are on the env's return, and on the objective the source run's teacher judged by (its --teacher-objective,
with what the objective needs of the env, as --reward-objective does). At the end, the model is measured on this run's
own replay buffer, against the env's reward (per-step and per-segment correlation, fresh-pair accuracy, the reward's scale), and runs/<run>/summary.json
gets those figures and the model's path."""

import functools
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

import sac
from cleanrlhf_utils.buffers import ReplayBuffer
from cleanrlhf_utils.checkpoints import checkpoint_file, load_checkpoint
from cleanrlhf_utils.cli import cli
from cleanrlhf_utils.diagnostics import reward_diagnostics
from cleanrlhf_utils.envs import physics_state_size
from cleanrlhf_utils.errors import need
from cleanrlhf_utils.objectives import Objective
from cleanrlhf_utils.tracking import write_summary
from sac_rlhf import PreferenceArgs, RewardEnsemble, predict_rewards, preference_probabilities


@dataclass
class Args(sac.Args):
    exp_name: str = "frozen"
    """the name of this experiment (part of the run name)"""
    reward_model_from: str = ""
    """the preference run whose final reward model SAC learns from (models/<run>/latest or its checkpoint.pt)"""


def load_reward_model(path: str, env_id: str, input_dim: int) -> tuple[RewardEnsemble, dict]:
    """The reward model of a sac_rlhf.py checkpoint, built as that run built it, in eval mode, with that run's settings;
    refused in one line when the checkpoint holds none, or comes from another env or other observation/action sizes."""
    saved = load_checkpoint(checkpoint_file(path, "--reward-model-from"))
    need("reward_model" in saved, f"--reward-model-from {path}: the checkpoint holds no reward model (a sac.py run's?)")
    settings = saved.get("args", {})
    trained_on = settings.get("env_id")
    need(trained_on == env_id, f"--reward-model-from {path}: its reward model was learned on {trained_on}, this run is on {env_id}")
    saved_dim = int(saved["reward_model"]["input_mean"].shape[0])
    need(
        saved_dim == input_dim,
        f"--reward-model-from {path}: its reward model takes {saved_dim} inputs, this run's observation and action have {input_dim}",
    )
    net = ("reward_ensemble_size", "reward_net_hidden_dim", "reward_net_hidden_layers")
    model = RewardEnsemble(
        input_dim, *(settings.get(name, getattr(PreferenceArgs, name)) for name in net), rating_scale=settings.get("rating_scale", 0)
    )
    model.load_state_dict(saved["reward_model"])
    return model.eval(), settings


def frozen_reward(model: RewardEnsemble, path: str) -> Objective:
    """The model's ensemble-mean reward as an objective sac.py learns: (obs, actions, states) [n, L, ...] -> [n, L]."""

    def reward(obs: np.ndarray, actions: np.ndarray, states: np.ndarray) -> np.ndarray:
        rows = torch.as_tensor(np.concatenate([obs, actions], axis=-1), dtype=torch.float32)
        return predict_rewards(model, rows)[0].numpy()

    return Objective(f"frozen:{path}", reward)


def main(args: Args) -> dict:
    need(bool(args.reward_model_from), "--reward-model-from is required: the run whose reward model SAC learns from")
    probe = sac.make_env(args.env_id, args.seed)()
    obs_dim, action_dim, state_dim = probe.observation_space.shape[0], probe.action_space.shape[0], physics_state_size(probe)
    probe.close()
    model, settings = load_reward_model(args.reward_model_from, args.env_id, obs_dim + action_dim)
    if not args.reward_objective:  # measured in evaluations, its settings applied (no unhealthy termination...)
        args = replace(args, reward_objective=settings.get("teacher_objective") or "")
    summary = sac.main(args, objective=frozen_reward(model, args.reward_model_from))

    rb = ReplayBuffer(min(args.buffer_size, args.total_timesteps), obs_dim, action_dim, state_dim)
    rb.load(Path("models") / summary["run_name"] / "latest" / "replay_buffer.npz")  # true_rewards: the env's
    length, probabilities = (
        settings.get("segment_length", PreferenceArgs.segment_length),
        functools.partial(preference_probabilities, model),
    )
    diagnostics = reward_diagnostics(rb, None, probabilities, length, (args.seed, rb.size), True, torch.device("cpu"))
    summary |= diagnostics | {"reward_model_from": args.reward_model_from}
    write_summary(Path("runs") / summary["run_name"], summary)
    return summary


if __name__ == "__main__":
    cli(Args, main)
