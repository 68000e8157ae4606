"""SAC on another run's learned reward, frozen: the middle run of bench/reward_gap.py's decomposition. sac.py with its
own settings and loop, trained on the final reward model of a preference run (never updated, no exploration, no
teacher), so that it differs from sac.py on the true reward in the reward only; the reward rescaled as the source run
rescaled it for its SAC (--learned-reward-std, measured once on the source run's replay buffer).

    python bench/frozen_reward.py --reward-model-from models/<run>/latest --env-id Walker2d-v5 [more sac.py flags]

Evaluations are on the env's return, and on the objective the source run's teacher judged by (its --teacher-objective,
with what the objective needs of the env, as --reward-objective does). At the end, the model is measured on this run's
own replay buffer, against the env's reward (per-step and per-segment correlation, fresh-pair accuracy, the reward's scale), and runs/<run>/summary.json
gets those figures and the model's path."""

import functools
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

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
from sac_rlhf import (
    PreferenceArgs,
    RewardEnsemble,
    predict_rewards,
    preference_probabilities,
    relabel_replay_buffer,
    sac_reward_scale,
)


@dataclass
class Args(sac.Args):
    exp_name: str = "frozen"
    """the name of this experiment (part of the run name)"""
    reward_model_from: str = ""
    """the preference run whose final reward model SAC learns from (models/<run>/latest or its checkpoint.pt)"""
    learned_reward_std: float | None = None
    """SAC learns the frozen reward rescaled, uncentred, to this standard deviation over the source run's replay buffer
    (the transitions its model was last relabelled on), as the source run's SAC learned it after its last relabel;
    fixed for the run (None: the source run's --learned-reward-std; 0: as the model gives it)"""


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


def source_reward_scale(model: RewardEnsemble, path: str, learned_reward_std: float, dims: tuple[int, int, int]) -> float:
    """The factor that brings the model's reward to `learned_reward_std` over the source run's replay buffer, by the
    rule the source run rescaled with at every relabel (sac_rlhf.sac_reward_scale; 1 when none is asked)."""
    if learned_reward_std == 0:
        return 1.0
    saved = checkpoint_file(path, "--reward-model-from").parent / "replay_buffer.npz"
    need(
        saved.is_file(),
        f"--reward-model-from {path}: no replay_buffer.npz beside its checkpoint to measure the reward's standard "
        f"deviation on (--learned-reward-std {learned_reward_std}; 0 learns the reward as the model gives it)",
    )
    with np.load(saved) as data:
        capacity = int(data["capacity"])
    source = ReplayBuffer(capacity, *dims)  # dims: the observation, action and physics-state sizes
    source.load(saved)
    relabel_replay_buffer(model, source, torch.device("cpu"))
    return sac_reward_scale(source, SimpleNamespace(learned_reward_std=learned_reward_std))


def frozen_reward(model: RewardEnsemble, path: str, scale: float = 1.0) -> Objective:
    """The model's ensemble-mean reward times `scale` as an objective sac.py learns: (obs, actions, states)
    [n, L, ...] -> [n, L]."""

    def reward(obs: np.ndarray, actions: np.ndarray, states: np.ndarray) -> np.ndarray:
        rows = torch.as_tensor(np.concatenate([obs, actions], axis=-1), dtype=torch.float32)
        return predict_rewards(model, rows)[0].numpy() * np.float32(scale)

    return Objective(f"frozen:{path}", reward)


def main(args: Args) -> dict:
    need(bool(args.reward_model_from), "--reward-model-from is required: the run whose reward model SAC learns from")
    probe = sac.make_env(args.env_id, args.seed)()
    obs_dim, action_dim, state_dim = probe.observation_space.shape[0], probe.action_space.shape[0], physics_state_size(probe)
    probe.close()
    model, settings = load_reward_model(args.reward_model_from, args.env_id, obs_dim + action_dim)
    if not args.reward_objective:  # measured in evaluations, its settings applied (no unhealthy termination...)
        args = replace(args, reward_objective=settings.get("teacher_objective") or "")
    if args.learned_reward_std is None:
        args = replace(args, learned_reward_std=float(settings.get("learned_reward_std", 0.0)))
    need(args.learned_reward_std >= 0, f"--learned-reward-std {args.learned_reward_std}: must be >= 0")
    scale = source_reward_scale(model, args.reward_model_from, args.learned_reward_std, (obs_dim, action_dim, state_dim))
    summary = sac.main(args, objective=frozen_reward(model, args.reward_model_from, scale))

    rb = ReplayBuffer(min(args.buffer_size, args.total_timesteps), obs_dim, action_dim, state_dim)
    rb.load(Path("models") / summary["run_name"] / "latest" / "replay_buffer.npz")  # true_rewards: the env's
    length, probabilities = (
        settings.get("segment_length", PreferenceArgs.segment_length),
        functools.partial(preference_probabilities, model),
    )
    diagnostics = reward_diagnostics(rb, None, probabilities, length, (args.seed, rb.size), True, torch.device("cpu"))
    summary |= diagnostics | {"reward_model_from": args.reward_model_from, "frozen_reward_scale": scale}
    write_summary(Path("runs") / summary["run_name"], summary)
    return summary


if __name__ == "__main__":
    cli(Args, main)
