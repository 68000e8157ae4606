"""Why a good ranking can train a weaker agent: the gap between SAC on the true reward and the online preference loop,
cut in two by SAC on the preference run's final reward model, frozen.

    python bench/reward_gap.py        # cheetah-run (QPA, 100 labels) and Walker2d-v5 (tuned, 200 labels), 100k steps, seeds 1 2 3
    python bench/reward_gap.py --tasks Walker2d-v5 --baseline-from A.json B.json C.json
        # reuses SAC's true-reward runs of bench/feedback_efficiency.py (same env, steps and evaluations)
    python bench/reward_gap.py --combine seeds12.json seed3.json --output cheetah.json   # one table from several invocations
    python bench/reward_gap.py --tasks Walker2d-v5 --reuse-finished   # reads the runs --workdir finished with these flags

Per task and seed, three runs (four with oracle), all but frozen side by side, one torch thread each:
  sac       sac.py on the true reward;
  online    sac_rlhf.py, the online loop with the task's recommended settings (TASKS: bench/feedback_efficiency.py's
            --variant and label budget, 10 sessions every 0.9 x steps / 10 steps after 10k exploration steps);
  frozen    bench/frozen_reward.py: sac.py with its settings on the online run's final reward model, never updated, no
            exploration, no teacher (started when its online run ends);
  oracle    (only when --kinds names it) bench/oracle_loop.py: the online run's loop and flags, SAC learning the env's
            reward wherever it would learn the model's (at the same --learned-reward-std).
sac -> frozen is the cost of the reward's shape; frozen -> online the cost of the online loop (when the labels come,
the relabels, the critic reset, exploration). The frozen reward is the final one, which the online agent only met at
its last session: frozen above online says the loop, not the reward, loses the return; sac -> oracle is what the loop
costs with a reward of the right shape. The frozen run learns the model's reward at the scale the online run's SAC
last learned it (bench/frozen_reward.py's --learned-reward-std, set to the online run's).
--reuse-finished reads, instead of running, a run of any kind that finished in --workdir with exactly the flags this
invocation would start it with (bench/feedback_efficiency.py's preference and SAC runs among them); a reused online
run's frozen run is then looked for, or started, on that run's model.

Reports per task, run kind and seed, and as medians with the interquartile range over seeds: the final evaluation
return and the mean of the last three evaluations, each as a ratio to SAC; then what differs between the runs, from
their summaries: the learned reward's per-step and per-segment correlation with the true reward and its fresh-pair
accuracy (for the frozen run: the final model measured on the frozen run's own buffer), the mean and std of the reward
each agent trains on (the true reward for SAC), and the mean of SAC's last logged Q-values, policy entropy (-log pi)
and temperature alpha. The JSON keeps every evaluation of every run.
Target: cheetah-run's recommended settings reach a median >= 0.8 x SAC over 3 seeds; the decomposition says which gap
is the larger on each task.
"""

import argparse
import functools
import json
import os
import shlex
import time
from pathlib import Path

from common import (
    BENCH,
    REPO,
    earlier_run,
    machine_info,
    print_table,
    read_summary,
    results_path,
    run_pool,
    spread,
    start_script,
    write_json,
)
from feedback_efficiency import (
    RECORDED_LATER,
    baseline_flags,
    earlier_baselines,
    eval_curve,
    last_evaluations_mean,
    pebble_flags,
    run_tag,
)

# The README's recommended settings per task (bench/feedback_efficiency.py --variant and label budget), those of its figures.
TASKS = {
    "dm_control/cheetah-run-v0": {"variant": "qpa", "labels": 100},
    "Walker2d-v5": {"variant": "tuned", "labels": 200},
}
KINDS = ("sac", "oracle", "frozen", "online")
# summary.json figures reported per run (those a run lacks, e.g. sac.py's reward-model metrics, are left empty)
MEASURES = (
    "reward_correlation", "segment_correlation", "heldout_accuracy", "learned_reward_mean", "learned_reward_std",
    "true_reward_std", "final_alpha", "final_q_value", "final_policy_entropy",
)  # fmt: skip


def task_settings(args, env_id: str) -> argparse.Namespace:
    """This invocation's settings for one task, as bench/feedback_efficiency.py's flag builders read them."""
    defaults = TASKS.get(env_id, {"variant": "tuned", "labels": 200})
    feedback_frequency = args.feedback_frequency or max(1, int(0.9 * args.steps / args.sessions))
    chosen = {"variant": args.variant or defaults["variant"], "labels": args.labels or defaults["labels"]}
    # No checkpoints: this benchmark has no --resume-unfinished (a frozen run needs its online run's final model)
    fixed = {"algorithm": "sac", "env_id": env_id, "feedback_frequency": feedback_frequency, "checkpoint_frequency": 0}
    return argparse.Namespace(**vars(args) | chosen | fixed)


def gap_run_name(kind: str, task: str, seed: int, stamp: str) -> str:
    """A run's name: a folder name whatever the env id (`dm_control/...`, `module:Id`)."""
    return f"gap_{kind}_{run_tag(task, seed, stamp)}"


def run_flags(settings, kind: str, seed: int, run_name: str, online_run: str, workdir: Path) -> tuple[str, list[str]]:
    """(script, flags) of one run of `kind`."""
    extra = shlex.split(settings.run_flags)
    if kind == "sac":
        return "sac.py", [*baseline_flags(settings, seed, run_name), *extra]
    if kind == "frozen":  # sac.py's flags: the run differs from SAC in its reward only, at the online run's scale
        scale = json.loads((workdir / "runs" / online_run / "args.json").read_text()).get("learned_reward_std", 0.0)
        model = ["--reward-model-from", f"models/{online_run}/latest", "--learned-reward-std", str(scale)]
        return str(BENCH / "frozen_reward.py"), [*baseline_flags(settings, seed, run_name), *model, *extra]
    script = str(BENCH / "oracle_loop.py") if kind == "oracle" else "sac_rlhf.py"
    return script, [*pebble_flags(settings, seed, run_name), *extra, *shlex.split(settings.preference_flags)]


def summary_row(workdir: Path, task: str, kind: str, seed: int, run_name: str, origin: str = "this invocation") -> dict:
    summary = read_summary(workdir, run_name)
    curve = eval_curve(workdir, run_name)
    row = {"task": task, "kind": kind, "seed": seed, "run_name": run_name, "from": origin}
    row |= {"final_eval_return": summary["final_eval_return"], "last_return": last_evaluations_mean(curve), "eval_curve": curve}
    values = summary | {"final_q_value": mean_of(summary.get("final_qf1_values"), summary.get("final_qf2_values"))}
    if kind == "sac":  # SAC trains on the true reward: its "learned" reward is that one
        values |= {"learned_reward_mean": summary.get("true_reward_mean"), "learned_reward_std": summary.get("true_reward_std")}
    row |= {name: values.get(name) for name in MEASURES}
    row["reward_model_from"] = summary.get("reward_model_from")
    return row


def mean_of(*values) -> float | None:
    present = [value for value in values if value is not None]
    return sum(present) / len(present) if present else None


def reused_row(task: str, seed: int, earlier: dict) -> dict:
    """The sac row of a true-reward run from an earlier bench/feedback_efficiency.py result."""
    curve = earlier.get("eval_curve")
    row = {"task": task, "kind": "sac", "seed": seed, "run_name": None, "from": earlier["from"], "reward_model_from": None}
    row |= {"final_eval_return": earlier["final_eval_return"], "last_return": last_evaluations_mean(curve), "eval_curve": curve}
    return row | dict.fromkeys(MEASURES)


def decomposition(rows: list[dict]) -> list[dict]:
    """Per task and kind: medians and interquartile ranges of the returns, of their ratios to SAC's same seed, and of
    the measurements."""
    table = []
    for task in dict.fromkeys(row["task"] for row in rows):
        sac = {row["seed"]: row for row in rows if row["task"] == task and row["kind"] == "sac"}
        for kind in KINDS:
            runs = [row for row in rows if row["task"] == task and row["kind"] == kind]
            if not runs:
                continue
            entry = {"task": task, "kind": kind, "seeds": len(runs)}
            for key in ("final_eval_return", "last_return"):
                entry[key] = spread([run[key] for run in runs])
                ratios = [ratio(run[key], sac.get(run["seed"], {}).get(key)) for run in runs]
                entry[f"{key}_ratio"] = spread(ratios)
            entry |= {name: spread([run[name] for run in runs])["median"] for name in MEASURES}
            table.append(entry)
    return table


def ratio(value, baseline) -> float | None:
    return value / baseline if value is not None and baseline else None


def shown(entry: dict) -> str:
    if entry["median"] is None:
        return ""
    return f"{entry['median']:.2f} [{entry['q25']:.2f}, {entry['q75']:.2f}]" if abs(entry["median"]) < 10 else (
        f"{entry['median']:.0f} [{entry['q25']:.0f}, {entry['q75']:.0f}]"
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), help="env ids (TASKS gives each its variant and labels)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--labels", type=int, default=None, help="label budget of the online runs (default: the task's in TASKS)")
    parser.add_argument("--variant", default=None, help="bench/feedback_efficiency.py --variant of the online runs (default: TASKS)")
    parser.add_argument("--sessions", type=int, default=10)
    parser.add_argument("--feedback-frequency", type=int, default=None, help="default: 0.9 x steps / sessions")
    parser.add_argument("--explore-steps", type=int, default=10_000)
    parser.add_argument(
        "--terminate-when-unhealthy", action=argparse.BooleanOptionalAction, default=True,
        help="end an episode on a fall where the env does (--no-terminate-when-unhealthy: every run on the task without)",
    )  # fmt: skip
    parser.add_argument("--evaluation-frequency", type=int, default=10_000)
    parser.add_argument("--evaluation-episodes", type=int, default=10)
    parser.add_argument(
        "--kinds", nargs="+", choices=KINDS, default=["sac", "online", "frozen"],
        help="the runs to make per task and seed (frozen needs online; SAC reused by --baseline-from is not rerun)",
    )  # fmt: skip
    parser.add_argument("--run-flags", default="", help="more flags for every run, one quoted string (--run-flags='--batch-size 64')")
    parser.add_argument("--preference-flags", default="", help="more flags for the online runs only, one quoted string")
    parser.add_argument(
        "--baseline-from", type=Path, nargs="+", default=None,
        help="results JSON of bench/feedback_efficiency.py: reuse their SAC runs for the tasks and settings they match",
    )  # fmt: skip
    parser.add_argument(
        "--reuse-finished", action="store_true",
        help="read, not run, a run that finished in --workdir with exactly the flags this invocation would start it with",
    )  # fmt: skip
    parser.add_argument("--parallel", type=int, default=2, help="runs at once (one torch thread each): the cores to use")
    parser.add_argument("--workdir", type=Path, default=REPO / "bench" / "workdir")
    parser.add_argument("--output", type=Path, default=results_path("reward_gap", "reward-gap", "decomposition"))
    parser.add_argument(
        "--combine", type=Path, nargs="+", default=None,
        help="results JSON of earlier invocations: run nothing, report their runs together as one table (written to --output)",
    )  # fmt: skip
    args = parser.parse_args()
    if "frozen" in args.kinds and "online" not in args.kinds:
        parser.error(f"--kinds {' '.join(args.kinds)}: frozen freezes the online run's final reward model, so it needs online too")
    if args.combine:
        combine(args.combine, args.output)
        return
    args.workdir = args.workdir.resolve()

    stamp, machine = f"{int(time.time())}_{os.getpid()}", machine_info()
    settings = {task: task_settings(args, task) for task in args.tasks}
    reused = {}
    for task in args.tasks:  # an earlier result is used for the task it ran on; its other settings must match
        paths = [path for path in args.baseline_from or [] if json.loads(path.read_text())["settings"]["env_id"] == task]
        reused[task] = earlier_baselines(paths, settings[task], "sac") if paths else {}
    # the online runs first (the longest); frozen runs after them, as they read the online runs' final models
    kinds = [kind for kind in dict.fromkeys(("online", "sac", *KINDS)) if kind in args.kinds and kind != "frozen"]
    names = {(task, kind, seed): gap_run_name(kind, task, seed, stamp) for task in args.tasks for kind in KINDS for seed in args.seeds}

    finished = set()  # (task, kind, seed) read from --workdir (--reuse-finished), under the name names[] then holds

    def jobs(kinds_now: list[str]) -> tuple[list, list[str]]:
        starts, labels = [], []
        for task in args.tasks:
            for seed in args.seeds:
                for kind in kinds_now:
                    if kind == "sac" and seed in reused[task]:
                        continue
                    name = names[task, kind, seed]
                    script, flags = run_flags(settings[task], kind, seed, name, names[task, "online", seed], args.workdir)
                    if args.reuse_finished and (earlier := earlier_run(args.workdir, script, flags, finished=True)):
                        print(f"reusing {earlier.name}: {kind} run, finished with the same flags")
                        names[task, kind, seed] = earlier.name
                        finished.add((task, kind, seed))
                        continue
                    starts.append(functools.partial(start_script, script, flags, args.workdir, log=args.workdir / f"{name}.log"))
                    labels.append(name)
        return starts, labels

    run_pool(*jobs(kinds), args.parallel)
    if "frozen" in args.kinds:  # after the online runs: a frozen run reads its online run's final reward model
        run_pool(*jobs(["frozen"]), args.parallel)

    rows = []
    for task in args.tasks:
        for seed in args.seeds:
            for kind in [k for k in KINDS if k in args.kinds]:
                if kind == "sac" and seed in reused[task]:
                    rows.append(reused_row(task, seed, reused[task][seed]))
                else:
                    origin = "--reuse-finished" if (task, kind, seed) in finished else "this invocation"
                    rows.append(summary_row(args.workdir, task, kind, seed, names[task, kind, seed], origin))
    resolved = {task: {k: getattr(s, k) for k in ("variant", "labels", "feedback_frequency")} for task, s in settings.items()}
    shared = {"workdir": str(args.workdir), "output": str(args.output), "baseline_from": [str(p) for p in args.baseline_from or []]}
    report(
        rows, {"benchmark": "reward_gap", "machine": machine, "settings": vars(args) | shared | {"tasks_resolved": resolved}}, args.output
    )


def report(rows: list[dict], header: dict, output: Path) -> None:
    """Prints the runs and the decomposition, and writes them with `header` (benchmark, machine, settings) to output."""
    print_table(rows, ["task", "kind", "seed", "final_eval_return", "last_return", *MEASURES])
    table = decomposition(rows)
    print()
    returns = ["final_eval_return", "final_eval_return_ratio", "last_return", "last_return_ratio"]
    print_table([{**entry, **{key: shown(entry[key]) for key in returns}} for entry in table], ["task", "kind", "seeds", *returns])
    print("\nmedian [interquartile range] over seeds; ratios to SAC on the true reward, seed by seed\n")
    print_table(table, ["task", "kind", *MEASURES])
    print("\nmedians over seeds of what each run measured (for sac, its reward is the true one)")
    write_json(output, header | {"rows": rows, "decomposition": table})


# What two results must share to be one table: the runs' settings (a seed set and its output may differ).
COMBINED_SETTINGS = (
    "steps", "sessions", "explore_steps", "evaluation_frequency", "evaluation_episodes", "run_flags", "preference_flags",
    "terminate_when_unhealthy",
)  # fmt: skip


def combine(paths: list[Path], output: Path) -> None:
    """One decomposition from several invocations' results (e.g. seeds run on different days or machines): their rows
    together, refused in one line when the runs' settings or a task's variant and labels differ, or a run repeats."""
    results = [json.loads(path.read_text()) for path in paths]
    first = results[0]["settings"]
    for path, result in zip(paths, results):
        settings = result["settings"]
        for key in COMBINED_SETTINGS:
            ran, first_ran = (earlier.get(key, RECORDED_LATER.get(key)) for earlier in (settings, first))
            if ran != first_ran:
                raise SystemExit(f"error: --combine: {path} ran with {key}={ran!r}, {paths[0]} with {first_ran!r}")
        for task, resolved in settings["tasks_resolved"].items():
            earlier = next(r["settings"]["tasks_resolved"][task] for r in results if task in r["settings"]["tasks_resolved"])
            if {k: resolved[k] for k in ("variant", "labels")} != {k: earlier[k] for k in ("variant", "labels")}:
                raise SystemExit(f"error: --combine: {path} ran {task} with {resolved}, another result with {earlier}")
    rows = [row for result in results for row in result["rows"]]
    once, seen = [], set()  # SAC that two invocations reused from one earlier result (--baseline-from) is one run
    for row in rows:
        reused = row.get("from", "this invocation") != "this invocation"
        key = (row["task"], row["kind"], row["seed"], row.get("from"))
        if not (reused and key in seen):
            once.append(row)
            seen.add(key)
    rows = once
    keys = [(row["task"], row["kind"], row["seed"]) for row in rows]
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        raise SystemExit(f"error: --combine: more than one run of (task, kind, seed) {repeated[0]}; give each run once")
    resolved = {task: spec for result in results for task, spec in result["settings"]["tasks_resolved"].items()}
    settings = {key: first.get(key) for key in COMBINED_SETTINGS} | {"tasks_resolved": resolved, "combined_from": [str(p) for p in paths]}
    machines = [result["machine"] for result in results]  # the first as `machine`, as every results file has one
    header = {"benchmark": "reward_gap", "machine": machines[0], "machines": machines, "settings": settings}
    report(sorted(rows, key=lambda row: (row["task"], row["seed"])), header, output)


if __name__ == "__main__":
    main()
