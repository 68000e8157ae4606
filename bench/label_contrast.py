"""What a run's labels tell apart, and how much of it its reward model learned.

A Gymnasium MuJoCo reward is a sum of terms; the one a preference run most often misses is the control cost (the env's
ctrl_cost_weight times the sum of squared actions), which on Ant-v5 is most of the true reward. For each feedback
session of sac_rlhf.py runs (their labels.sqlite and final checkpoint), over the pairs labelled in it:

- `control_per_step`: the mean control cost of a step of the queried segments, what the agent paid then;
- `d_control`, `d_rest`: the mean absolute difference between the pair's two segments in control cost, and in the rest
  of the true return (forward progress, staying alive, contact cost): what there was to tell apart;
- `label_control`, `label_rest`: the Pearson correlation of the pair's true return difference (what the synthetic
  teacher judges by) with the difference in -control cost and in the rest: what the labels say about each term;
- `model_control`, `model_rest`: the same for the final reward model's predicted return difference: what the model
  learned of each term on the very pairs it was taught with; `model_agreement`: the share of the session's decided
  labels the final model reproduces; `label_control_decides`: the share of the decided labels that prefer the segment
  with the lower control cost, as if the teacher judged by it alone.

Per run (the `all` row), on every step of its replay buffer: `model_rest_per_control`, what the final model pays for
the rest of the reward against the control cost. Its per-step reward (the members' mean) is fitted by least squares
to a * (-control cost) + b * rest + c, and the figure is b / a; the true reward's is 1, and a model below it prices
progress lower against torque than the env does.

The JSON's `rows` pool each run's sessions (one row a run), `sessions` has a row per session. Every figure is read
from the files; nothing trains. A run is named in the tables as given before `=`:

    python bench/label_contrast.py --workdir bench/workdir --runs no-fall-end=bench_pebble_Ant-v5_1_<stamp> [more runs] \\
        --output bench/results/label_contrast/gym-mujoco/ant-label-contrast-seed1.json

docs/benchmarks/findings/gym-mujoco.md has what it showed."""

import argparse
import json
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from common import REPO, correlation, finished_run, label_column, machine_info, print_table, results_path, task_name, write_json
from frozen_reward import load_reward_model

from cleanrlhf_utils.errors import need
from cleanrlhf_utils.feedback import read_label_file
from sac_rlhf import segment_returns

COLUMNS = [
    "run", "session", "pairs", "control_per_step", "d_control", "d_rest", "label_control", "label_rest",
    "model_control", "model_rest", "model_agreement", "label_control_decides", "model_rest_per_control",
]  # fmt: skip


def control_facts(env_id: str) -> tuple[float, int]:
    """The env's weight of the squared actions in its reward (Gymnasium MuJoCo envs have one), and its action size."""
    env = gym.make(env_id)  # a "module:Id" env: gym.make imports the module that registers it
    weight, action_dim = getattr(env.unwrapped, "_ctrl_cost_weight", None), env.action_space.shape[0]
    env.close()
    need(weight is not None, f"{env_id} has no control cost weight (ctrl_cost_weight): Gymnasium MuJoCo envs only")
    return float(weight), action_dim


def contrast_row(run: str, session, control, true, model, steps, labels) -> dict:
    """One session's figures from each pair's segments, all (N, 2): control cost, true return, predicted return and
    real (unmasked) steps; labels (N,) P(segment 1 preferred)."""
    rest = true + control
    d_true, d_control, d_rest, d_model = (x[:, 1] - x[:, 0] for x in (true, control, rest, model))
    decided = labels != 0.5
    agreement = float(((d_model > 0) == (labels > 0.5))[decided].mean()) if decided.any() else None
    control_decides = float(((d_control < 0) == (labels > 0.5))[decided].mean()) if decided.any() else None
    return {
        "run": run, "session": session, "pairs": len(labels), "control_per_step": float(control.sum() / steps.sum()),
        "d_control": float(np.abs(d_control).mean()), "d_rest": float(np.abs(d_rest).mean()),
        "label_control": correlation(d_true, -d_control), "label_rest": correlation(d_true, d_rest),
        "model_control": correlation(d_model, -d_control), "model_rest": correlation(d_model, d_rest),
        "model_agreement": agreement, "label_control_decides": control_decides,
    }  # fmt: skip


def rest_per_control(learned: np.ndarray, control: np.ndarray, true: np.ndarray) -> float:
    """b / a of the least-squares fit of the model's per-step reward `learned` to a * (-control) + b * rest + c, over
    steps (all (T,)): the true reward's is 1."""
    learned = learned.astype(np.float64)
    design = np.stack([-control, true + control, np.ones_like(control)], axis=1).astype(np.float64)
    (per_control, per_rest, _), *_ = np.linalg.lstsq(design, learned, rcond=None)
    return float(per_rest / per_control)


def run_rows(workdir: Path, run: str, name: str) -> list[dict]:
    """A run's rows, named `name` in the tables: one per feedback session, then `all`."""
    env_id = finished_run(workdir, run, "--runs", files=("labels.sqlite",))["env_id"]
    label_file = workdir / "runs" / run / "labels.sqlite"
    segments, labels = read_label_file(label_file)
    need(len(labels) > 0, f"run {run} has no labels")
    weight, action_dim = control_facts(env_id)
    obs_actions, masks = segments["obs_actions"], segments["masks"].astype(np.float32)
    control = weight * ((obs_actions[..., -action_dim:] ** 2).sum(-1) * masks).sum(-1)
    figures = {"control": control, "true": (segments["true_rewards"] * masks).sum(-1), "steps": masks.sum(-1)}
    latest = workdir / "models" / run / "latest"
    model, _ = load_reward_model(str(latest), env_id, obs_actions.shape[-1])
    figures["model"] = segment_returns(model, torch.as_tensor(obs_actions), torch.as_tensor(masks)).mean(0).numpy()
    sessions = label_column(label_file, "session")
    rows = [
        contrast_row(name, int(session), **{key: x[sessions == session] for key, x in figures.items()}, labels=labels[sessions == session])
        for session in np.unique(sessions)
    ]
    with np.load(latest / "replay_buffer.npz") as buffer:
        stored = int(buffer["capacity"]) if bool(buffer["full"]) else int(buffer["pos"])
        # a finished run's buffer holds the final model's ensemble mean in every row (its end fills the pending ones)
        learned, actions, true = (buffer[key][:stored] for key in ("learned_rewards", "actions", "true_rewards"))
    pooled = contrast_row(name, "all", **figures, labels=labels)
    pooled["model_rest_per_control"] = rest_per_control(learned, weight * (actions**2).sum(-1), true)
    return [*rows, pooled]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=REPO / "bench" / "workdir", help="holds runs/<run> and models/<run>")
    parser.add_argument("--runs", nargs="+", required=True, help="sac_rlhf.py runs under --workdir/runs: [name=]run")
    parser.add_argument(
        "--output", type=Path, default=None, help="the JSON file (default: label_contrast/gym-mujoco/<task>-label-contrast.json)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs = dict(token.partition("=")[::2] if "=" in token else (token, token) for token in args.runs)  # name -> run
    rows = [row for name, run in runs.items() for row in run_rows(args.workdir, run, name)]
    print_table(rows, COLUMNS)
    first_env = json.loads((args.workdir / "runs" / next(iter(runs.values())) / "args.json").read_text())["env_id"]
    args.output = args.output or results_path("label_contrast", "gym-mujoco", f"{task_name(first_env)}-label-contrast")
    write_json(
        args.output,
        {
            "benchmark": "label_contrast",
            "command": f"python bench/label_contrast.py --workdir {args.workdir} --runs {' '.join(args.runs)} --output {args.output}",
            "machine": machine_info(),
            "runs": runs,
            "rows": [row for row in rows if row["session"] == "all"],  # each run's sessions pooled
            "sessions": [row for row in rows if row["session"] != "all"],
        },
    )


if __name__ == "__main__":
    main()
