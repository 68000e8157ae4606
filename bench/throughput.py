"""Throughput: environment steps per second of sac_rlhf.py (PEBBLE with every default feature on)
against sac.py (same SAC on the true reward), Hopper-v5. Each round runs both scripts side by side
with one torch thread each, so they share the machine's noise; the table gives per-round figures,
medians and the ratio. Target (issue 2): the RLHF machinery costs <= 10 % of SAC's speed.

    python bench/throughput.py                 # 3 rounds of 6000 steps
    python bench/throughput.py --rounds 5 --steps 10000

The PEBBLE run explores (state entropy) until 2000 steps and then holds a feedback session every
1000 steps (25 oracle labels each, reward training, relabelling), so its figure includes all of it.
"""

import argparse
import statistics
import time
from pathlib import Path

from common import REPO, machine_info, print_table, read_summary, start_script, wait_all, write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env-id", default="Hopper-v5")
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--explore-steps", type=int, default=2000)
    parser.add_argument("--feedback-frequency", type=int, default=1000)
    parser.add_argument("--queries-per-session", type=int, default=25)
    parser.add_argument("--workdir", type=Path, default=REPO / "bench" / "workdir")
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "throughput.json")
    args = parser.parse_args()

    sessions = (args.steps - args.explore_steps - 1) // args.feedback_frequency + 1
    common = ["--env-id", args.env_id, "--total-timesteps", str(args.steps), "--evaluation-frequency", "0", "--evaluation-episodes", "1"]
    pebble = [
        "--total-explore-steps", str(args.explore_steps), "--teacher-feedback-frequency", str(args.feedback_frequency),
        "--teacher-feedback-num-queries-per-session", str(args.queries_per_session),
        "--teacher-feedback-total-queries", str(args.queries_per_session * sessions), "--teacher-feedback-schedule", "linear",
        "--checkpoint-frequency", "0",
    ]  # fmt: skip
    stamp, rows, machine = int(time.time()), [], machine_info()  # the commit the runs start from
    for round_ in range(args.rounds):
        names = [f"throughput_pebble_{stamp}_{round_}", f"throughput_sac_{stamp}_{round_}"]
        processes = [
            start_script("sac_rlhf.py", [*common, *pebble, "--seed", str(round_ + 1), "--run-name", names[0]], args.workdir),
            start_script("sac.py", [*common, "--seed", str(round_ + 1), "--run-name", names[1]], args.workdir),
        ]
        wait_all(processes, names)
        sps_pebble, sps_sac = read_summary(args.workdir, names[0])["sps"], read_summary(args.workdir, names[1])["sps"]
        rows.append({"round": round_, "pebble_sps": sps_pebble, "sac_sps": sps_sac, "ratio": sps_pebble / sps_sac})
        print(f"round {round_}: PEBBLE {sps_pebble:.1f} steps/s, SAC {sps_sac:.1f} steps/s", flush=True)
    median = {key: statistics.median(r[key] for r in rows) for key in ("pebble_sps", "sac_sps", "ratio")}
    print_table([*rows, {"round": "median", **median}], ["round", "pebble_sps", "sac_sps", "ratio"])
    write_json(
        args.output,
        {
            "benchmark": "throughput",
            "machine": machine,
            "settings": vars(args) | {"workdir": str(args.workdir), "output": str(args.output)},
            "rows": rows,
            "median": median,
        },
    )


if __name__ == "__main__":
    main()
