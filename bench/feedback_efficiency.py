"""Feedback efficiency: PEBBLE (sac_rlhf.py) with an oracle teacher and a fixed label budget vs SAC
(sac.py) on the true reward, same seeds and steps, run side by side with one torch thread each.

    python bench/feedback_efficiency.py                      # Hopper-v5, 100k steps, 200 labels, seed 1
    python bench/feedback_efficiency.py --steps 20000 --seeds 1 2

Reports per seed and as medians: final evaluation return of each, their ratio, the reward model's
held-out accuracy, and the Pearson correlation of learned and true reward on recent transitions.
Targets (issue 2): ratio >= 0.9, accuracy >= 0.9, correlation >= 0.8.
"""

import argparse
import statistics
import time
from pathlib import Path

from common import REPO, machine_info, print_table, read_summary, start_script, wait_all, write_json


def pebble_flags(args, seed: int, run_name: str) -> list[str]:
    per_session = max(1, args.labels // args.sessions)
    return [
        "--env-id", args.env_id, "--seed", str(seed), "--run-name", run_name,
        "--total-timesteps", str(args.steps), "--total-explore-steps", str(args.explore_steps),
        "--teacher-feedback-total-queries", str(args.labels),
        "--teacher-feedback-num-queries-per-session", str(per_session),
        "--teacher-feedback-frequency", str(args.feedback_frequency),
        "--evaluation-frequency", str(args.evaluation_frequency), "--evaluation-episodes", str(args.evaluation_episodes),
        "--checkpoint-frequency", "0",
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env-id", default="Hopper-v5")
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--labels", type=int, default=200, help="label budget of the PEBBLE run")
    parser.add_argument("--sessions", type=int, default=10, help="feedback sessions the budget is spread over")
    parser.add_argument("--feedback-frequency", type=int, default=5000)
    parser.add_argument("--explore-steps", type=int, default=10_000)
    parser.add_argument("--evaluation-frequency", type=int, default=10_000)
    parser.add_argument("--evaluation-episodes", type=int, default=10)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--workdir", type=Path, default=REPO / "bench" / "workdir")
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "feedback_efficiency.json")
    args = parser.parse_args()

    stamp = int(time.time())
    rows = []
    for seed in args.seeds:
        names = {
            "pebble": f"bench_pebble_{args.env_id.replace('/', '_')}_{seed}_{stamp}",
            "sac": f"bench_sac_{args.env_id.replace('/', '_')}_{seed}_{stamp}",
        }
        common = [
            "--env-id",
            args.env_id,
            "--seed",
            str(seed),
            "--total-timesteps",
            str(args.steps),
            "--evaluation-frequency",
            str(args.evaluation_frequency),
            "--evaluation-episodes",
            str(args.evaluation_episodes),
        ]
        processes = [
            start_script(
                "sac_rlhf.py", pebble_flags(args, seed, names["pebble"]), args.workdir, log=args.workdir / f"{names['pebble']}.log"
            ),
            start_script("sac.py", [*common, "--run-name", names["sac"]], args.workdir, log=args.workdir / f"{names['sac']}.log"),
        ]
        wait_all(processes, list(names.values()))
        pebble, sac = read_summary(args.workdir, names["pebble"]), read_summary(args.workdir, names["sac"])
        rows.append({
            "env_id": args.env_id, "seed": seed, "steps": args.steps, "labels": pebble["labels_obtained"],
            "pebble_return": pebble["final_eval_return"], "sac_return": sac["final_eval_return"],
            "ratio": pebble["final_eval_return"] / sac["final_eval_return"],
            "heldout_accuracy": pebble["heldout_accuracy"], "train_accuracy": pebble["train_accuracy"],
            "reward_correlation": pebble["reward_correlation"], "pebble_sps": pebble["sps"], "sac_sps": sac["sps"],
        })  # fmt: skip
    median = {
        key: statistics.median(r[key] for r in rows)
        for key in ("pebble_return", "sac_return", "ratio", "heldout_accuracy", "reward_correlation", "pebble_sps", "sac_sps")
    }
    print_table(
        [*rows, {"env_id": "median", **median}],
        [
            "env_id",
            "seed",
            "labels",
            "pebble_return",
            "sac_return",
            "ratio",
            "heldout_accuracy",
            "reward_correlation",
            "pebble_sps",
            "sac_sps",
        ],
    )
    write_json(
        args.output,
        {
            "benchmark": "feedback_efficiency",
            "machine": machine_info(),
            "settings": vars(args) | {"workdir": str(args.workdir), "output": str(args.output)},
            "rows": rows,
            "median": median,
        },
    )


if __name__ == "__main__":
    main()
