"""What the labels of a run taught by a --teacher-objective compared, read from its labels.sqlite (nothing trains).
Per run, in windows of --window steps by when each label was obtained, then over all its labels:

- `pairs`: the labels obtained in the window;
- `one_ends`: the share of pairs in which one segment ends its episode before the other does (a fall that ends it, or
  the env's own end): such a label may say no more than which segment stayed in its episode;
- `objective_per_step`: the objective's mean reward a step over the segments' real (unmasked) steps;
- `above`: the share of those steps whose objective reward is above --reward-above (ant-raise-leg at 0.5: the foot
  above the success mark with the torso upright);
- `d_per_step`: over the pairs whose segments have the same length, the median difference between the two of the
  objective's mean reward a step: how fine a contrast those labels draw.

    python bench/objective_labels.py --workdir bench/workdir/novel_behaviours --reward-above 0.5 \\
        --runs default=<run> recent=<run> --output bench/results/objective_labels/objectives/ant-raise-leg-labels.json

docs/environments.md has what it showed for the Ant raising a leg."""

import argparse
import json
from pathlib import Path

import numpy as np
from common import REPO, label_column, machine_info, objective_run_labels, print_table, results_path, write_json

COLUMNS = ["run", "window", "pairs", "one_ends", "objective_per_step", "above", "d_per_step"]


def steps_text(steps: int) -> str:
    return f"{steps // 1000}k" if steps and steps % 1000 == 0 else str(steps)


def window_row(run: str, window: str, rewards: np.ndarray, masks: np.ndarray, reward_above: float) -> dict:
    """The figures of the pairs whose objective rewards (N, 2, L), zero where masked, and masks (N, 2, L) are given."""
    steps = masks.sum(-1)
    real = masks.sum()
    same_length = steps[:, 0] == steps[:, 1]
    per_step = rewards[same_length].sum(-1) / np.maximum(steps[same_length], 1)
    return {
        "run": run,
        "window": window,
        "pairs": len(rewards),
        "one_ends": float((~same_length).mean()),
        "objective_per_step": float(rewards.sum() / real),
        "above": float(((rewards > reward_above) & masks).sum() / real),
        "d_per_step": float(np.median(np.abs(per_step[:, 1] - per_step[:, 0]))) if same_length.any() else None,
    }


def run_rows(workdir: Path, run: str, name: str, window: int, reward_above: float) -> list[dict]:
    """A run's rows, named `name` in the tables: one per window of `window` steps holding labels, then `all`."""
    _, segments, _, rewards = objective_run_labels(workdir, run)
    masks = segments["masks"].astype(bool)
    starts = label_column(workdir / "runs" / run / "labels.sqlite", "global_step") // window * window
    rows = [
        window_row(
            name, f"{steps_text(start)}–{steps_text(start + window)}", rewards[starts == start], masks[starts == start], reward_above
        )
        for start in np.unique(starts)
    ]
    return [*rows, window_row(name, "all", rewards, masks, reward_above)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=REPO / "bench" / "workdir", help="holds runs/<run>")
    parser.add_argument("--runs", nargs="+", required=True, help="sac_rlhf.py runs under --workdir/runs: [name=]run")
    parser.add_argument("--window", type=int, default=20_000, help="steps per window of label times (> 0)")
    parser.add_argument("--reward-above", type=float, default=0.5, help="the objective reward a step `above` counts above")
    parser.add_argument(
        "--output", type=Path, default=None, help="the JSON file (default: objective_labels/objectives/<objective>-labels.json)"
    )
    args = parser.parse_args()
    if args.window <= 0:
        raise SystemExit(f"--window {args.window}: steps per window must be > 0")
    runs = dict(token.partition("=")[::2] if "=" in token else (token, token) for token in args.runs)  # name -> run
    rows = [row for name, run in runs.items() for row in run_rows(args.workdir, run, name, args.window, args.reward_above)]
    print_table(rows, COLUMNS)
    first = json.loads((args.workdir / "runs" / next(iter(runs.values())) / "args.json").read_text())["teacher_objective"]
    args.output = args.output or results_path("objective_labels", "objectives", f"{first}-labels")
    command = (
        f"python bench/objective_labels.py --workdir {args.workdir} --window {args.window} "
        f"--reward-above {args.reward_above:g} --runs {' '.join(args.runs)} --output {args.output}"
    )
    write_json(
        args.output,
        {
            "benchmark": "objective_labels",
            "command": command,
            "machine": machine_info(),
            "runs": runs,
            "rows": rows,  # each run's windows, then its labels pooled (window `all`)
        },
    )


if __name__ == "__main__":
    main()
