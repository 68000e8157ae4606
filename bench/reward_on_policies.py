"""What a preference run's final reward model pays on the episodes of policies that matter: its own agent's, and those
of agents trained on the true reward.

A reward model can rank its labelled pairs well and still rank policies wrongly: the labels only cover what its agent
did. This runs each policy's deterministic actor for a few episodes on the reward run's env (its end on a fall as the
run had it), and per policy reports:

- `steps`: the mean episode length;
- `true_return`, `learned_return`: the mean episode return on the env's reward and on the model's (the ensemble's mean
  prediction, unscaled: what SAC's --learned-reward-std rescaling would multiply it by changes no order);
- `disagreement`: the ensemble's mean per-step standard deviation on the policy's episodes, in units of the
  standard deviation of the model's per-step reward over every policy's episodes: how far the policy's states are from
  what the labels taught the members alike;
- `ranked_as_true`: over every two policies, the share the model orders as the true return does (the same on every
  row: it is a property of the set);
- `<term>_per_step`: each term of the env's reward as its info reports it (Gymnasium MuJoCo's `reward_forward`,
  `reward_ctrl`, `reward_survive`, `reward_contact`; the control cost is negative, as paid), the mean per step;
- `learned_vs_<term>`: the Pearson correlation of the model's per-step reward with that term within the policy's
  episodes (and `learned_vs_true` with the whole reward): which term the model follows on these states.

Nothing trains; the checkpoints are read from --workdir/models/<run>/latest (sac.py or sac_rlhf.py runs). A policy
given as `zero-actions` instead of a run does nothing (every action 0): what standing still earns on both rewards.

    python bench/reward_on_policies.py --workdir bench/workdir --reward-from bench_pebble_Ant-v5_1_<stamp> \\
        --policies pebble=bench_pebble_Ant-v5_1_<stamp> sac=bench_sac_Ant-v5_1_<stamp> \\
        --output bench/results/reward_on_policies/gym-mujoco/ant-reward-on-policies-seed1.json

docs/benchmarks/findings/gym-mujoco.md has what it showed."""

import argparse
import itertools
from pathlib import Path

import numpy as np
import torch
from common import REPO, correlation, finished_run, machine_info, print_table, results_path, task_name, write_json
from frozen_reward import load_reward_model

from cleanrlhf_utils.envs import make_env
from evaluation import load_actor
from sac_rlhf import predict_rewards

ZERO_ACTIONS = "zero-actions"


class ZeroActions(torch.nn.Module):
    """The policy that does nothing: every action 0 (the middle of a symmetric box, Gymnasium MuJoCo's)."""

    def __init__(self, action_dim: int):
        super().__init__()
        self.action_dim = action_dim

    def deterministic_action(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.zeros(obs.shape[0], self.action_dim)


# The terms of Gymnasium MuJoCo's rewards that its envs report in `info`, as they pay them (the costs negative).
TERMS = ("forward", "ctrl", "survive", "contact")
COLUMNS = [
    "policy", "episodes", "steps", "true_return", "learned_return", "disagreement", "ranked_as_true", "learned_vs_true",
    *(f"{term}_per_step" for term in TERMS), *(f"learned_vs_{term}" for term in TERMS),
]  # fmt: skip


def rollouts(actor: torch.nn.Module, env_id: str, episodes: int, seed: int, terminate_when_unhealthy: bool) -> list[dict]:
    """Each episode of the actor's deterministic policy: its (obs, action) rows, true rewards and reward terms."""
    env = make_env(env_id, seed, terminate_when_unhealthy=terminate_when_unhealthy)()
    played = []
    for episode in range(episodes):
        obs, _ = env.reset(seed=seed + episode)
        rows, rewards, terms, done = [], [], {term: [] for term in TERMS}, False
        while not done:
            with torch.no_grad():
                action = actor.deterministic_action(torch.as_tensor(obs, dtype=torch.float32)[None])[0].numpy()
            rows.append(np.concatenate([np.ravel(obs), np.ravel(action)]))
            obs, reward, terminated, truncated, info = env.step(action)
            rewards.append(float(reward))
            for term in TERMS:
                terms[term].append(info.get(f"reward_{term}", np.nan))
            done = terminated or truncated
        played.append({"rows": np.array(rows, dtype=np.float32), "true": np.array(rewards), "terms": terms})
    env.close()
    return played


def policy_row(name: str, episodes: list[dict], learned: list[np.ndarray], spread: list[np.ndarray], scale: float) -> dict:
    """One policy's row from its episodes and the ensemble's per-step mean and std on them, the std in units of `scale`
    (ranked_as_true is filled in once every policy has its returns)."""
    true, model = np.concatenate([e["true"] for e in episodes]), np.concatenate(learned)
    row = {
        "policy": name,
        "episodes": len(episodes),
        "steps": float(np.mean([len(e["true"]) for e in episodes])),
        "true_return": float(np.mean([e["true"].sum() for e in episodes])),
        "learned_return": float(np.mean([steps.sum() for steps in learned])),
        "disagreement": float(np.concatenate(spread).mean() / scale),
        "learned_vs_true": correlation(model, true),
    }
    for term in TERMS:
        paid = np.concatenate([np.asarray(e["terms"][term], dtype=float) for e in episodes])
        known = not np.isnan(paid).any()  # a term the env does not report stays out
        row[f"{term}_per_step"] = float(paid.mean()) if known else None
        row[f"learned_vs_{term}"] = correlation(model, paid) if known else None
    return row


def ranked_as_true(rows: list[dict]) -> float | None:
    """The share of policy pairs whose learned returns are ordered as their true returns (pairs tied on either left out)."""
    pairs = [
        np.sign(a["true_return"] - b["true_return"]) == np.sign(a["learned_return"] - b["learned_return"])
        for a, b in itertools.combinations(rows, 2)
        if a["true_return"] != b["true_return"] and a["learned_return"] != b["learned_return"]
    ]
    return float(np.mean(pairs)) if pairs else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=REPO / "bench" / "workdir", help="holds runs/<run> and models/<run>")
    parser.add_argument("--reward-from", required=True, help="the sac_rlhf.py run whose final reward model is read")
    parser.add_argument("--policies", nargs="+", required=True, help=f"runs whose final actors play: [name=]run, or [name=]{ZERO_ACTIONS}")
    parser.add_argument("--episodes", type=int, default=3, help="episodes per policy")
    parser.add_argument("--seed", type=int, default=100, help="the first episode's seed (the next ones count up)")
    parser.add_argument(
        "--output", type=Path, default=None, help="the JSON file (default: reward_on_policies/gym-mujoco/<task>-reward-on-policies.json)"
    )
    args = parser.parse_args()
    if args.episodes < 1:
        parser.error(f"--episodes {args.episodes}: at least 1")
    torch.set_num_threads(1)
    settings = finished_run(args.workdir, args.reward_from, "--reward-from")
    env_id, ends = settings["env_id"], settings.get("terminate_when_unhealthy", True)
    probe = make_env(env_id, 0)()
    action_dim = int(np.prod(probe.action_space.shape))
    input_dim = int(np.prod(probe.observation_space.shape)) + action_dim
    probe.close()
    model, _ = load_reward_model(str(args.workdir / "models" / args.reward_from / "latest"), env_id, input_dim)
    policies = dict(token.partition("=")[::2] if "=" in token else (token, token) for token in args.policies)  # name -> run
    for run in set(policies.values()) - {ZERO_ACTIONS}:
        finished_run(args.workdir, run, "--policies")
    played, predicted = {}, {}
    for name, run in policies.items():
        actor = ZeroActions(action_dim) if run == ZERO_ACTIONS else load_actor(args.workdir / "models" / run / "latest", env_id)[0]
        played[name] = rollouts(actor, env_id, args.episodes, args.seed, ends)
        predicted[name] = [[x.numpy() for x in predict_rewards(model, torch.as_tensor(e["rows"]))] for e in played[name]]
    scale = float(np.concatenate([mean for episodes in predicted.values() for mean, _ in episodes]).std())
    rows = [
        policy_row(name, played[name], [mean for mean, _ in predicted[name]], [std for _, std in predicted[name]], scale)
        for name in policies
    ]
    for row in rows:
        row["ranked_as_true"] = ranked_as_true(rows)
    print_table(rows, COLUMNS)
    args.output = args.output or results_path("reward_on_policies", "gym-mujoco", f"{task_name(env_id)}-reward-on-policies")
    write_json(
        args.output,
        {
            "benchmark": "reward_on_policies",
            "command": f"python bench/reward_on_policies.py --workdir {args.workdir} --reward-from {args.reward_from} "
            f"--policies {' '.join(args.policies)} --episodes {args.episodes} --seed {args.seed} --output {args.output}",
            "machine": machine_info(),
            "settings": {"env_id": env_id, "terminate_when_unhealthy": ends, "reward_from": args.reward_from, "policies": policies},
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
