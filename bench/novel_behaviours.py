"""Novel behaviours from labels: PEBBLE (sac_rlhf.py) with the synthetic teacher on a --teacher-objective, where the
environment's reward says nothing about the behaviour (the windmill's is 0 at every step), seeds side by side with one
torch thread each.

    python bench/novel_behaviours.py                                   # windmill, both directions, seeds 1 2 3, 50 labels
    python bench/novel_behaviours.py --behaviour hopper-backflip --steps 300000 --labels 1000 --seeds 1 2 3 \\
        --output bench/results/novel_behaviours/backflip/50k.json

Reports per run and as medians per objective: the final evaluation's objective return and objective success (windmill:
the share of evaluation time turning the preferred way; Hopper: completed backflips per episode), the env's own return
(0 by design on the windmill), and the labels used. The ceiling is the best the objective allows, measured on the same
evaluation seeds: on the windmill, full motor torque the preferred way at every step (what SAC on the objective as its
reward converges to); on the other behaviours, SAC (sac.py --reward-objective) trained on the objective as its reward
with the same seeds and steps, in the same pool of runs, and `return_ratio` is the preference run's objective return
over that SAC's. Targets: windmill, after <= 50 labels, >= 95 % of evaluation time turning the preferred way,
both directions, 3 seeds; Hopper backflip, <= 1000 labels, median >= 1 completed backflip per episode and ratio >= 0.8.
"""

import argparse
import json
import shlex
import statistics
import time
from pathlib import Path

from common import (
    REPO,
    add_resume_arguments,
    earlier_run,
    longer_runs,
    machine_info,
    preference_script,
    print_table,
    read_summary,
    results_path,
    resumed_flags,
    run_pool,
    start_script,
    write_json,
)
from feedback_efficiency import eval_curve, last_evaluations_mean

from cleanrlhf_utils.objectives import OBJECTIVES

WINDMILL = "cleanrlhf_utils.example_envs.windmill:Windmill-v0"
BEHAVIOURS = {
    "windmill": (WINDMILL, ["windmill-clockwise", "windmill-counterclockwise"]),
    "hopper-backflip": ("Hopper-v5", ["hopper-backflip"]),
    "hopper-backflip-upright": ("Hopper-v5", ["hopper-backflip-upright"]),
    "hopper-landed-backflip": ("Hopper-v5", ["hopper-landed-backflip"]),
    "ant-raise-leg": ("Ant-v5", ["ant-raise-leg"]),
    "halfcheetah-backward": ("HalfCheetah-v5", ["halfcheetah-backward"]),
}
EVALUATION_EPISODES = 5


def windmill_ceiling(objective_name: str, seed: int, episodes: int) -> dict:
    """Full torque the preferred way at every step, evaluated as the runs are (seeds seed + 100000, ...)."""
    import torch

    from cleanrlhf_utils.evaluate import evaluate_episodes

    direction = 1.0 if objective_name == "windmill-clockwise" else -1.0

    class FullTorque(torch.nn.Module):
        def deterministic_action(self, obs):
            return torch.full((obs.shape[0], 1), direction)

    measures = []
    evaluate_episodes(
        FullTorque(),
        WINDMILL,
        episodes,
        seed + 100_000,
        "cpu",
        objective=OBJECTIVES[objective_name],
        objective_measures=measures,
    )
    return {
        "ceiling_objective_return": statistics.mean(episode.objective_return for episode in measures),
        "ceiling_objective_success": statistics.mean(episode.success for episode in measures),
    }


def relative(path: Path) -> Path:
    """A path as the command line gives it: relative to the repository where it is inside it."""
    path = path.resolve()
    return path.relative_to(REPO) if path.is_relative_to(REPO) else path


def last_evaluations(workdir: Path, run_name: str, measures: tuple[str, ...] = (), until: int | None = None) -> dict:
    """The objective's return, success and further `measures` over the run's evaluations (those at or before step
    `until`, if given), and their means over the last three: one evaluation of 5 episodes of a backflipping Hopper
    swings by whole flips."""

    def curve(tag: str) -> list[list[float]]:
        return [[step, value] for step, value in eval_curve(workdir, run_name, tag) if until is None or step <= until]

    returns = curve("eval/objective_return")
    successes = curve("eval/objective_success")
    result = {
        "objective_curve": returns,
        "objective_success_curve": successes,
        "objective_return_last3": last_evaluations_mean(returns),
        "objective_success_last3": last_evaluations_mean(successes),
    }
    for name in measures:  # e.g. a backflip objective's landed backflips beside its own count
        measured = curve(f"eval/objective_{name}")
        result |= {f"objective_{name}_curve": measured, f"objective_{name}_last3": last_evaluations_mean(measured)}
    return result


def longer_ceiling(workdir: Path, flags: list[str], steps: int) -> Path | None:
    """--ceiling-from: a SAC run in `workdir` started with the ceiling's `flags` but more steps, finished or not, that
    has evaluated at `steps`. Its first `steps` steps are the run `flags` asks for (tests/test_end_to_end.py), so one
    long ceiling serves preference runs of any shorter length."""
    return next((run for run in longer_runs(workdir, "sac.py", flags) if evaluated_at(run, steps)), None)


def evaluated_at(run: Path, step: int) -> bool:
    return any(at == step for at, _ in eval_curve(run.parent.parent, run.name))


def ceiling_figures(ceiling_run: Path, steps: int, measures: tuple[str, ...]) -> dict:
    """The ceiling's figures beside a preference run of `steps` steps: from its summary where it ran exactly that
    long, else (a longer run) from its evaluation at `steps`, the last point of its curves cut there, as TensorBoard
    logged it (float32)."""
    workdir, name = ceiling_run.parent.parent, ceiling_run.name
    curves = last_evaluations(workdir, name, measures, until=steps)
    total = json.loads((ceiling_run / "args.json").read_text())["total_timesteps"]
    if total == steps:
        if not (ceiling_run / "summary.json").exists():
            raise SystemExit(f"the ceiling run {ceiling_run} has not finished (no summary.json); rerun once it has")
        ceiling = json.loads((ceiling_run / "summary.json").read_text())
    else:

        def at_steps(curve: list[list[float]]) -> float | None:
            return curve[-1][1] if curve and curve[-1][0] == steps else None

        returns = [[at, value] for at, value in eval_curve(workdir, name) if at <= steps]
        ceiling = {"final_eval_return": at_steps(returns), "final_objective_return": at_steps(curves["objective_curve"])}
        ceiling["final_objective_success"] = at_steps(curves["objective_success_curve"])
        ceiling |= {f"final_objective_{n}": at_steps(curves[f"objective_{n}_curve"]) for n in measures}
    figures = {
        "ceiling_run": name,
        "ceiling_objective_return": ceiling["final_objective_return"],
        "ceiling_objective_success": ceiling.get("final_objective_success"),
        "ceiling_env_return": ceiling["final_eval_return"],
    }
    figures |= {f"ceiling_objective_{n}": ceiling.get(f"final_objective_{n}") for n in measures}
    return figures | {f"ceiling_{key}": value for key, value in curves.items()}


def start_unless_finished(args, jobs: list, script: str, flags: list[str], run_name: str) -> Path:
    """The run directory of `script` with `flags`: with --reuse-finished one that finished in --workdir; with
    --resume-unfinished one that stopped before its end, added to `jobs` to continue from its last checkpoint; else a
    new run `run_name`, added to `jobs`."""
    if args.reuse_finished and (finished := earlier_run(args.workdir, script, flags, finished=True)) is not None:
        print(f"reusing {finished.name}: finished with the same flags")
        return finished
    if args.resume_unfinished and (resumed := resumed_flags(args.workdir, script, flags)) is not None:
        print(f"resuming {resumed[1]}: stopped before its end, started with the same flags")
        jobs.append((script, *resumed))
        return args.workdir / "runs" / resumed[1]
    jobs.append((script, flags, run_name))
    return args.workdir / "runs" / run_name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--behaviour", choices=list(BEHAVIOURS), default="windmill")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=3000, help="environment steps per run")
    parser.add_argument("--labels", type=int, default=50, help="label budget per run")
    parser.add_argument("--explore-steps", type=int, default=1000)
    parser.add_argument("--feedback-frequency", type=int, default=500)
    parser.add_argument("--queries-per-session", type=int, default=10)
    parser.add_argument("--evaluation-frequency", type=int, default=1000)
    parser.add_argument(
        "--evaluation-episodes",
        type=int,
        default=EVALUATION_EPISODES,
        help="episodes per evaluation, both runs' and the windmill's ceiling",
    )
    parser.add_argument(
        "--preference-flags",
        default="",
        help="more sac_rlhf.py flags for the preference runs, one string (with --reset-agent-below-correlation the runs "
        "are sac_rlhf_agent_reset.py's)",
    )
    parser.add_argument(
        "--env-flags",
        default="",
        help="flags that shape the environment, for the preference runs and their ceiling alike, one string (e.g. "
        "--terminate-when-unhealthy: a fallen Hopper starts over)",
    )
    parser.add_argument(
        "--ceiling-from",
        type=Path,
        help="a workdir whose runs/ holds this benchmark's SAC-on-objective runs with the same env, objective, seeds, steps "
        "and evaluations (from an earlier invocation, finished or still running), or with more steps and an evaluation "
        "at --steps (read there): read, not run again",
    )
    parser.add_argument(
        "--ceiling-results",
        type=Path,
        help="a results file this benchmark wrote, whose rows hold the SAC-on-objective ceilings of the same behaviour, "
        "seeds, steps, evaluations and env flags: their figures are copied, nothing runs (for a machine where that "
        "invocation's workdir is gone)",
    )
    parser.add_argument(
        "--reuse-finished",
        action="store_true",
        help="runs in --workdir that finished with exactly the flags this invocation would start them with (an "
        "invocation cut off after its runs ended, or one given another seed) are read, not run again",
    )
    add_resume_arguments(parser, checkpoint_frequency=10_000)  # a 300k-step backflip outlasts a sitting here
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=REPO / "bench" / "workdir" / "novel_behaviours")
    parser.add_argument("--output", type=Path, default=None, help="default: bench/results/novel_behaviours/objectives/<behaviour>.json")
    return parser


def recorded_ceilings(args) -> dict:
    """(objective, seed) -> the ceiling_* figures of that row of --ceiling-results, once its command is shown to have
    measured the same ceilings: same behaviour, steps, evaluations and env flags (what the SAC runs saw)."""
    path = args.ceiling_results if args.ceiling_results.is_absolute() else REPO / args.ceiling_results
    recorded_parser = build_parser()

    def refuse(message: str):  # argparse would print its usage text and exit; this refusal is one line
        raise ValueError(f"its command: {message}")

    recorded_parser.error = refuse
    try:
        recorded = json.loads(path.read_text())
        earlier = recorded_parser.parse_args(shlex.split(recorded["command"])[2:])
    except (OSError, ValueError, KeyError) as error:
        raise SystemExit(f"--ceiling-results {args.ceiling_results}: not a results file of this benchmark ({error!r})") from None
    for setting in ("behaviour", "steps", "evaluation_frequency", "evaluation_episodes", "env_flags"):
        if getattr(earlier, setting) != getattr(args, setting):
            raise SystemExit(
                f"--ceiling-results {args.ceiling_results}: its ceilings ran with {setting} {getattr(earlier, setting)!r}, "
                f"this invocation asks for {getattr(args, setting)!r}"
            )
    ceilings = {}
    for row in recorded["rows"]:
        figures = {key: value for key, value in row.items() if key.startswith("ceiling_")}
        if "ceiling_run" in figures:
            ceilings[row["objective"], row["seed"]] = figures | {"ceiling_results": str(relative(path))}
    return ceilings


def main() -> None:
    args = build_parser().parse_args()

    env_id, objective_names = BEHAVIOURS[args.behaviour]
    if (args.ceiling_from is not None or args.ceiling_results is not None) and args.behaviour == "windmill":
        raise SystemExit("--ceiling-from/--ceiling-results: the windmill's ceiling is scripted (full torque), not a SAC run")
    if args.ceiling_from is not None and args.ceiling_results is not None:
        raise SystemExit("--ceiling-from and --ceiling-results: give one, the ceilings' runs or their recorded figures")
    ceilings_recorded = recorded_ceilings(args) if args.ceiling_results is not None else {}
    script = preference_script(args.preference_flags)
    stamp = int(time.time())
    ceiling_runs = {}  # (objective, seed) -> the SAC-on-objective run's directory
    jobs, runs = [], []  # jobs: (script, flags, run name) to start; runs: (objective, seed, preference run's directory)
    for objective_name in objective_names:
        for seed in args.seeds:
            run_name = f"{args.behaviour}__{objective_name}__{seed}__{stamp}"
            flags = [
                "--env-id", env_id, "--teacher-objective", objective_name, "--seed", str(seed), "--run-name", run_name,
                "--total-timesteps", str(args.steps), "--total-explore-steps", str(args.explore_steps),
                "--learning-starts", str(min(1000, args.explore_steps)), "--teacher-feedback-total-queries", str(args.labels),
                "--teacher-feedback-num-queries-per-session", str(args.queries_per_session),
                "--teacher-feedback-frequency", str(args.feedback_frequency), "--evaluation-frequency", str(args.evaluation_frequency),
                "--evaluation-episodes", str(args.evaluation_episodes), "--checkpoint-frequency", str(args.checkpoint_frequency),
                "--torch-threads", "1", "--no-cuda", *shlex.split(args.preference_flags), *shlex.split(args.env_flags),
            ]  # fmt: skip
            runs.append((objective_name, seed, start_unless_finished(args, jobs, script, flags, run_name)))
            if args.behaviour == "windmill":
                continue  # its ceiling is scripted: full torque the preferred way
            ceiling_flags = [
                "--env-id", env_id, "--reward-objective", objective_name, "--seed", str(seed),
                "--run-name", f"{run_name}__sac", "--total-timesteps", str(args.steps),
                "--evaluation-frequency", str(args.evaluation_frequency), "--evaluation-episodes", str(args.evaluation_episodes),
                "--checkpoint-frequency", str(args.checkpoint_frequency), "--torch-threads", "1", "--no-cuda",
                *shlex.split(args.env_flags),
            ]  # fmt: skip
            if args.ceiling_results is not None:
                if (objective_name, seed) not in ceilings_recorded:
                    raise SystemExit(f"--ceiling-results {args.ceiling_results}: no ceiling of {objective_name} seed {seed} there")
            elif args.ceiling_from is not None:
                ceiling_run = earlier_run(args.ceiling_from, "sac.py", ceiling_flags, finished=False)
                ceiling_run = ceiling_run or longer_ceiling(args.ceiling_from, ceiling_flags, args.steps)
                if ceiling_run is None:
                    shown = shlex.join(flag for flag in ceiling_flags if flag not in ("--run-name", f"{run_name}__sac"))
                    raise SystemExit(f"--ceiling-from {args.ceiling_from}: no SAC run there started with {shown}")
                ceiling_runs[objective_name, seed] = ceiling_run
            else:  # the ceiling: SAC with the objective as its reward, same seed and steps
                ceiling_runs[objective_name, seed] = start_unless_finished(args, jobs, "sac.py", ceiling_flags, f"{run_name}__sac")
    started = time.time()
    run_pool(
        [
            lambda script=script, flags=flags, name=name: start_script(
                script, flags, args.workdir, log=args.workdir / f"{name}_{stamp}.log"
            )
            for script, flags, name in jobs
        ],
        [name for *_, name in jobs],
        args.parallel,
    )
    rows = []
    for objective_name, seed, preference_run in runs:
        summary = read_summary(preference_run.parent.parent, preference_run.name)
        row = {
            "objective": objective_name, "seed": seed, "run": preference_run.name, "steps": summary["global_step"],
            "labels": summary["labels_obtained"], "env_return": summary["final_eval_return"],
            "objective_return": summary.get("final_objective_return"), "objective_success": summary.get("final_objective_success"),
            "wall_seconds": round(summary["wall_seconds"], 1),
        }  # fmt: skip
        measures = tuple(OBJECTIVES[objective_name].measures)
        row |= {f"objective_{name}": summary.get(f"final_objective_{name}") for name in measures}
        row |= last_evaluations(preference_run.parent.parent, preference_run.name, measures)
        if args.behaviour == "windmill":
            ceiling = windmill_ceiling(objective_name, seed, args.evaluation_episodes)
            row |= ceiling | {
                "ceiling_objective_return_last3": ceiling["ceiling_objective_return"],
                "ceiling_objective_success_last3": ceiling["ceiling_objective_success"],
            }
        elif args.ceiling_results is not None:
            row |= ceilings_recorded[objective_name, seed]
        else:
            row |= ceiling_figures(ceiling_runs[objective_name, seed], args.steps, measures)
        row["return_ratio"] = row["objective_return"] / row["ceiling_objective_return"]
        if row["objective_return_last3"] is not None and row["ceiling_objective_return_last3"] is not None:
            row["return_ratio_last3"] = row["objective_return_last3"] / row["ceiling_objective_return_last3"]
        rows.append(row)
    medians = []
    for objective_name in objective_names:
        mine = [row for row in rows if row["objective"] == objective_name]
        medians.append(
            {"objective": objective_name, "seeds": len(mine)}
            | {
                key: statistics.median(row[key] for row in mine)
                for key in mine[0]
                if key != "seed" and all(isinstance(row.get(key), (int, float)) for row in mine)
            }
        )
    columns = ["objective", "seed", "labels", "env_return", "objective_return", "objective_success", "objective_success_last3"]
    columns += ["ceiling_objective_return", "ceiling_objective_success", "ceiling_objective_success_last3", "return_ratio"]
    print_table(rows, [*columns, "return_ratio_last3", "wall_seconds"])
    output = args.output or results_path("novel_behaviours", "objectives", args.behaviour)
    output = output if output.is_absolute() else REPO / output
    command = "python bench/novel_behaviours.py " + " ".join(
        [f"--behaviour {args.behaviour}", "--seeds " + " ".join(map(str, args.seeds)), f"--steps {args.steps}", f"--labels {args.labels}"]
        + [f"--explore-steps {args.explore_steps}", f"--feedback-frequency {args.feedback_frequency}"]
        + [f"--queries-per-session {args.queries_per_session}", f"--evaluation-frequency {args.evaluation_frequency}"]
        + ([f"--evaluation-episodes {args.evaluation_episodes}"] if args.evaluation_episodes != EVALUATION_EPISODES else [])
        + ([f"--preference-flags={shlex.quote(args.preference_flags)}"] if args.preference_flags else [])
        + ([f"--env-flags={shlex.quote(args.env_flags)}"] if args.env_flags else [])
        + ([f"--ceiling-from {relative(args.ceiling_from)}"] if args.ceiling_from else [])
        + ([f"--ceiling-results {relative(args.ceiling_results)}"] if args.ceiling_results else [])
        + (["--reuse-finished"] if args.reuse_finished else [])
        + (["--resume-unfinished"] if args.resume_unfinished else [])
        + [f"--output {relative(output)}"]
    )
    write_json(
        output,
        {"command": command, "machine": machine_info(), "wall_seconds": round(time.time() - started, 1), "rows": rows, "medians": medians},
    )


if __name__ == "__main__":
    main()
