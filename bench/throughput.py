"""Throughput of SAC's learning phase: environment steps per second of this checkout's sac.py and sac_rlhf.py
against the same scripts at another commit (--against, checked out into a temporary git worktree), Hopper-v5,
one torch thread per run. Targets: sac.py >= 1.5x the steps/s of the reference commit 257de00 (plain CleanRL-style
updates), sac_rlhf.py >= 0.9x sac.py.

    python bench/throughput.py                           # 3 rounds against 257de00
    python bench/throughput.py --against HEAD~3 --rounds 5
    python bench/throughput.py --compile                 # this checkout with --compile (and --cudagraphs on a GPU)
    python bench/throughput.py --threads 2               # both versions on 2 torch threads, one run at a time
    python bench/throughput.py --against cpu --rounds 3  # on a GPU machine: this checkout on the GPU against on the CPU

How it measures. Each round runs two processes side by side, the same script from both commits, so that both see
the same machine noise; the order of the two pairs alternates between rounds. Each process runs the script's
main in-process (`throughput.py child`), with timers around the functions every version of the scripts calls
(SACAgent.update, the vector env's step, predict_rewards, and acting: SACAgent.act where it exists, else the actor's
forward pass outside the update), counting steps at the env's step. Over a window of the learning phase only:
  - sac.py: from --learning-starts + --warmup steps to the end;
  - sac_rlhf.py: default settings and feedback schedule, except that exploration ends (and the first feedback
    session is held) at --explore-steps; the window runs from --warmup steps after that session to the end, before
    the next session (every 10k steps by default). The session is not in the window: its reward training is capped
    at --session-epochs epochs so that the benchmark takes minutes.
--warmup also keeps --compile's compilation out of the window. Steps/s are given by wall clock and by the process's
CPU time; on a machine shared with other work the CPU figure is the steadier one. The split gives the window's CPU
milliseconds per step by part; `other` is the rest (buffer, sampling, tensors from numpy, logging).

--against cpu (a machine with a CUDA GPU; no git needed) compares this checkout with itself: `this` runs on the GPU
(the scripts' default --cuda, plus --compile/--cudagraphs where given), `against` with --no-cuda, one torch thread.
On a GPU the CPU figure counts only the host's side; the wall figure is the one to read.

--threads N (N > 1, for a machine with nothing else running) gives every run N intra-op threads (--torch-threads where a
version has it; a version without the flag takes torch's default, which follows OMP_NUM_THREADS). The two runs of a pair then go one after the other instead of side by side, so that neither run's
threads wait for the other's.
"""

import argparse
import importlib
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from common import FRAMEWORK, REPO, machine_info, print_table, results_path, start_process, wait_all, write_json

SCRIPTS = ("sac.py", "sac_rlhf.py")
VERSIONS = ("this", "against")
AGAINST_CPU = "cpu"  # --against: this checkout on the CPU instead of another commit
PARTS = ("update", "env step", "reward prediction", "acting")


def git(*argv: str) -> str:
    return subprocess.run(["git", *argv], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


@contextmanager
def worktree(ref: str):
    """The framework/ folder of `ref`, checked out into a temporary worktree that is removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="throughput_against_")) / "checkout"
    git("worktree", "add", "--detach", str(folder), ref)
    try:
        yield folder / "framework"
    finally:
        git("worktree", "remove", "--force", str(folder))
        shutil.rmtree(folder.parent, ignore_errors=True)


def run_flags(script: str, args) -> tuple[list[str], int]:
    """Command-line flags of a benchmark run and the first step of its measured window."""
    flags = ["--env-id", args.env_id, "--evaluation-frequency", "0", "--evaluation-episodes", "1", "--no-progress-bar"]
    flags += ["--learning-starts", str(args.learning_starts)]
    if script == "sac.py":
        start = args.learning_starts + args.warmup
        return [*flags, "--total-timesteps", str(start + args.window)], start
    start = args.explore_steps + args.warmup
    return [
        *flags, "--total-explore-steps", str(args.explore_steps), "--reward-net-epochs", str(args.session_epochs),
        "--checkpoint-frequency", "0", "--total-timesteps", str(start + args.window),
    ], start  # fmt: skip


class StepTimer:
    """Wall and CPU time of the steps from `start` on, and the CPU time of their parts, from timers wrapped around
    the functions main calls (restored afterwards)."""

    def __init__(self, module, sac_rlhf, start: int):
        import gymnasium as gym

        agent = module.SACAgent  # sac.py's own agent class, or the one it imports from sac_rlhf.py
        acting = (agent, "act") if hasattr(agent, "act") else (getattr(module, "Actor", sac_rlhf.Actor), "get_action")
        self.targets = {
            "update": (agent, "update"),
            "env step": (gym.vector.SyncVectorEnv, "step"),
            "reward prediction": (sac_rlhf, "predict_rewards"),
            "acting": acting,
        }
        self.start, self.steps, self.in_update = start, 0, False
        self.first = self.last = None
        self.cpu = dict.fromkeys(PARTS, 0.0)

    def timed(self, part: str, function):
        def wrapper(*args, **kwargs):
            if part == "env step":  # a step begins; the window runs from step `start` to the last step's start
                self.steps += 1
                if self.steps == self.start:
                    self.first = (time.process_time(), time.perf_counter())
                self.last = (time.process_time(), time.perf_counter())
            if self.first is None or (part == "acting" and self.in_update):  # the update's actor passes are the update's
                return function(*args, **kwargs)
            begin, self.in_update = time.process_time(), part == "update"
            try:
                return function(*args, **kwargs)
            finally:
                self.cpu[part] += time.process_time() - begin
                self.in_update = False

        return wrapper

    def __enter__(self):
        self.saved = [(owner, name, getattr(owner, name)) for owner, name in self.targets.values()]
        for part, (owner, name) in self.targets.items():
            setattr(owner, name, self.timed(part, getattr(owner, name)))
        return self

    def __exit__(self, *exc):
        for owner, name, function in self.saved:
            setattr(owner, name, function)

    def result(self) -> dict:
        steps = self.steps - self.start
        cpu, wall = self.last[0] - self.first[0], self.last[1] - self.first[1]
        split = {part: seconds / steps * 1000 for part, seconds in self.cpu.items()}
        return {"wall_sps": steps / wall, "cpu_sps": steps / cpu, "split_ms": {**split, "other": cpu / steps * 1000 - sum(split.values())}}


def child(framework: str, script: str, start: str, output: str, *flags: str) -> None:
    """One benchmark run: `script` of `framework` run in this process, its window timed; the result as JSON."""
    import tyro

    module, sac_rlhf = importlib.import_module(script[:-3]), importlib.import_module("sac_rlhf")
    assert Path(module.__file__).parent == Path(framework), f"imported {module.__file__}, not {framework}'s"
    run_args = tyro.cli(module.Args, args=list(flags))
    if hasattr(run_args, "torch_threads"):  # versions with --torch-threads set their threads; older ones follow OMP_NUM_THREADS
        run_args.torch_threads = int(os.environ["OMP_NUM_THREADS"])
    with StepTimer(module, sac_rlhf, int(start)) as timer:
        module.main(run_args)
    Path(output).write_text(json.dumps(timer.result()))


def run_groups(threads: int, round_: int) -> list[list[str]]:
    """The versions' runs of one script in a round, as groups started together, one group after the other: both side by
    side with one thread each (the same machine noise for both); with more threads each alone, so that no run's threads
    wait for the other's, the first alternating between rounds."""
    if threads <= 1:
        return [list(VERSIONS)]
    return [[version] for version in (VERSIONS if round_ % 2 == 0 else VERSIONS[::-1])]


def measure_rounds(args, frameworks: dict[str, Path]) -> list[dict]:
    rows, stamp = [], int(time.time())
    for round_ in range(args.rounds):
        for script in SCRIPTS if round_ % 2 == 0 else SCRIPTS[::-1]:
            flags, start = run_flags(script, args)
            names = {version: f"throughput_{stamp}_{round_}_{version}_{script[:-3]}" for version in VERSIONS}
            for group in run_groups(args.threads, round_):
                processes = [
                    start_process(
                        [
                            str(Path(__file__).resolve()),
                            "child",
                            str(frameworks[version]),
                            script,
                            str(start),
                            str(args.workdir / f"{names[version]}.json"),
                            *flags,
                            *(args.speed_flags if version == "this" else args.against_flags),
                            "--seed",
                            str(round_ + 1),
                            "--run-name",
                            names[version],
                        ],  # fmt: skip
                        args.workdir,
                        threads=args.threads,
                        log=args.workdir / f"{names[version]}.log",
                        import_from=frameworks[version],
                    )
                    for version in group
                ]
                wait_all(processes, [names[version] for version in group])
            for version, name in names.items():
                result = json.loads((args.workdir / f"{name}.json").read_text())
                rows.append({"round": round_, "script": script, "version": version, **result})
                print(
                    f"round {round_}: {version:7s} {script:11s} {result['wall_sps']:6.1f} steps/s, {result['cpu_sps']:6.1f} per CPU-s",
                    flush=True,
                )
    return rows


def median_of(rows: list[dict], version: str, script: str, key) -> float:
    return statistics.median(key(r) for r in rows if r["version"] == version and r["script"] == script)


def main() -> None:
    if sys.argv[1:2] == ["child"]:
        return child(*sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--against",
        default="257de00",
        help="git ref to compare with (default: the reference commit 257de00), or `cpu`: this checkout with --no-cuda (on a GPU machine)",
    )
    parser.add_argument("--env-id", default="Hopper-v5")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window", type=int, default=2000, help="learning steps measured per run")
    parser.add_argument("--warmup", type=int, default=300, help="learning steps before the window (compilation, the session's end)")
    parser.add_argument("--learning-starts", type=int, default=1000, help="random steps before SAC learns (the scripts' default)")
    parser.add_argument("--explore-steps", type=int, default=2000, help="sac_rlhf.py: exploration steps before the first session")
    parser.add_argument("--session-epochs", type=int, default=5, help="sac_rlhf.py: cap on the session's reward-training epochs")
    parser.add_argument("--compile", action="store_true", help="run this checkout's scripts with --compile")
    parser.add_argument("--cudagraphs", action="store_true", help="run this checkout's scripts with --cudagraphs (a CUDA GPU)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run; above 1 the runs of a pair go one at a time")
    parser.add_argument("--workdir", type=Path, default=REPO / "bench" / "workdir")
    parser.add_argument("--output", type=Path, default=results_path("throughput", "speed", "throughput"))
    args = parser.parse_args()
    args.workdir = args.workdir.resolve()
    args.speed_flags = [flag for flag, on in (("--compile", args.compile), ("--cudagraphs", args.cudagraphs)) if on]

    machine = machine_info()
    if args.against == AGAINST_CPU:
        if not machine["gpu"]:
            raise SystemExit("--against cpu compares the GPU with the CPU, and torch sees no CUDA GPU here: use a git ref")
        against, args.against_flags = "--no-cuda", ["--no-cuda"]
        rows = measure_rounds(args, {"this": FRAMEWORK, "against": FRAMEWORK})
    else:
        against, args.against_flags = git("rev-parse", "--short", args.against), []
        with worktree(args.against) as against_framework:
            rows = measure_rounds(args, {"this": FRAMEWORK, "against": against_framework})

    median = {
        (version, script, key): median_of(rows, version, script, lambda r, key=key: r[key])
        for version in VERSIONS
        for script in SCRIPTS
        for key in ("wall_sps", "cpu_sps")
    }
    speed = [
        {
            "script": script,
            "clock": clock,
            f"this ({machine['commit']})": median["this", script, key],
            f"against ({against})": median["against", script, key],
            "this/against": median["this", script, key] / median["against", script, key],
        }
        for script in SCRIPTS
        for clock, key in (("wall", "wall_sps"), ("CPU", "cpu_sps"))
    ]
    rlhf_over_sac = {
        f"{version} ({clock})": median[version, "sac_rlhf.py", key] / median[version, "sac.py", key]
        for version in VERSIONS
        for clock, key in (("wall", "wall_sps"), ("CPU", "cpu_sps"))
    }
    split = [
        {
            "script": script,
            "version": version,
            **{part: median_of(rows, version, script, lambda r, p=part: r["split_ms"][p]) for part in (*PARTS, "other")},
        }
        for script in SCRIPTS
        for version in VERSIONS
    ]
    print(
        f"\nmedian learning-phase steps per second (wall) and per CPU-second over {args.rounds} rounds, {args.threads} torch thread(s) per run"
    )
    print_table(speed, list(speed[0]))
    print("\nsac_rlhf.py / sac.py: " + ", ".join(f"{name} {ratio:.3f}" for name, ratio in rlhf_over_sac.items()))
    print("\nmedian CPU milliseconds per learning step, by part")
    print_table(split, list(split[0]))
    write_json(
        args.output,
        {
            "benchmark": "throughput",
            "command": shlex.join(["python", "bench/throughput.py", *sys.argv[1:]]),
            "machine": machine,
            "against": against,
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "rows": rows,
            "median": speed,
            "sac_rlhf_over_sac": rlhf_over_sac,
            "step_split_ms": split,
        },
    )


if __name__ == "__main__":
    main()
