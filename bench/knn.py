"""PEBBLE's k-NN intrinsic reward: CPU milliseconds per call of the k-NN, this checkout against another commit and
against a plain top-k, at a 10k-state replay buffer's reference sample (one torch thread, as the scripts run), and the
whole per-step cost of this checkout's sac_rlhf.exploration_rewards beside it.

During unsupervised exploration every SAC update first computes the intrinsic reward of its batch
(sac_rlhf.exploration_rewards: a random reference sample of the buffer's states, the distance of each batch state to
its k-th nearest reference state, the running std). The implementations differ only in knn_state_entropy, so that is
what is compared. Each one runs in a worker process of its own checkout: this one, a git worktree of `--against` (its
sac_rlhf.py and cleanrlhf_utils exactly as they were), and the textbook full top-k; the workers are timed on the same
seeded inputs in interleaved rounds and must return the same distances. Medians over rounds of CPU time per call.

    python bench/knn.py                                  # Hopper / walker-walk / humanoid sizes, against 257de00
    python bench/knn.py --against HEAD~3 --obs-dims 11 --rounds 9
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from common import REPO, machine_info, print_table, results_path, write_json

import sac_rlhf
from cleanrlhf_utils.buffers import ReplayBuffer
from cleanrlhf_utils.training import RunningMoments

# A worker times one checkout's knn_state_entropy (imported from its working directory, a checkout's framework/, which
# is first on a `python -c` process's path) on requests read from stdin, one JSON line each, answered the same way.
WORKER = """
import json, sys, time
import torch
torch.set_num_threads(1)
if sys.argv[1] == "full_topk":  # the textbook form: every distance, then a top-k over all of them
    def knn(states, reference, k):
        return torch.cdist(states, reference).topk(k, dim=1, largest=False).values[:, -1]
else:
    from sac_rlhf import knn_state_entropy as knn
for line in sys.stdin:
    request = json.loads(line)
    generator = torch.Generator().manual_seed(request["seed"])
    states = torch.randn(request["batch"], request["dim"], generator=generator)
    reference = torch.randn(request["reference"], request["dim"], generator=generator)
    for _ in range(10):
        distances = knn(states, reference, request["k"])
    start = time.process_time()
    for _ in range(request["steps"]):
        knn(states, reference, request["k"])
    ms = (time.process_time() - start) / request["steps"] * 1e3
    print(json.dumps({"ms": ms, "distances": distances.tolist()}), flush=True)
"""


class Worker:
    """One implementation's worker process: `time(request)` -> (ms per call, the distances it computed)."""

    def __init__(self, implementation: str, checkout: Path):
        self.process = subprocess.Popen(
            [sys.executable, "-c", WORKER, implementation],
            cwd=checkout / "framework",
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            # no PYTHONPATH: the checkout's own framework/ (the working directory) must be the one imported
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
        )

    def time(self, request: dict) -> tuple[float, torch.Tensor]:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"bench/knn.py: error: the worker for {self.process.args[-1]} ended (exit code {self.process.wait()})")
        reply = json.loads(line)
        return reply["ms"], torch.tensor(reply["distances"])

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=30)


def exploration_ms_per_step(obs_dim: int, buffer_states: int, args, steps: int) -> float:
    """CPU ms per call of this checkout's sac_rlhf.exploration_rewards (sampling, k-NN, running std) as training calls it."""
    rb = ReplayBuffer(buffer_states, obs_dim, 1, 1)
    rb.next_obs[:] = np.random.default_rng(obs_dim).standard_normal(rb.next_obs.shape)
    rb.pos, rb.full = 0, True
    batch = torch.randn(args.batch_size, obs_dim)
    rng, moments = np.random.default_rng(0), RunningMoments()
    for _ in range(10):
        sac_rlhf.exploration_rewards(rb, batch, moments, args, rng, "cpu")
    start = time.process_time()
    for _ in range(steps):
        sac_rlhf.exploration_rewards(rb, batch, moments, args, rng, "cpu")
    return (time.process_time() - start) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--against", default="257de00", help="commit whose knn_state_entropy is the reference (257de00: before the speed work)"
    )
    parser.add_argument("--obs-dims", type=int, nargs="+", default=[11, 24, 67], help="Hopper-v5: 11, walker-walk: 24, humanoid: 67")
    parser.add_argument("--buffer-states", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=200, help="calls timed per round and implementation")
    parser.add_argument("--output", type=Path, default=results_path("knn", "speed", "knn"))
    opts = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    args = sac_rlhf.Args()
    against = subprocess.run(["git", "rev-parse", "--short", opts.against], cwd=REPO, capture_output=True, text=True)
    if against.returncode != 0:
        raise SystemExit(f"bench/knn.py: error: --against {opts.against!r} is not a commit of this repository")

    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        worktree = Path(scratch) / "against"
        subprocess.run(["git", "worktree", "add", "--detach", str(worktree), opts.against], cwd=REPO, capture_output=True, check=True)
        workers = {"this": Worker("module", REPO), opts.against: Worker("module", worktree), "full_topk": Worker("full_topk", REPO)}
        try:
            for obs_dim in opts.obs_dims:
                request = {
                    "seed": obs_dim,
                    "batch": args.batch_size,
                    "dim": obs_dim,
                    "reference": min(args.explore_knn_sample_size, opts.buffer_states),
                    "k": args.explore_knn_k,
                    "steps": opts.steps,
                }
                times = {name: [] for name in workers}
                for _ in range(opts.rounds):
                    distances = {}
                    for name, worker in workers.items():
                        ms, distances[name] = worker.time(request)
                        times[name].append(ms)
                    for name, computed in distances.items():  # every implementation must give the same distances
                        torch.testing.assert_close(computed, distances["this"], msg=f"{name} at obs_dim {obs_dim}")
                medians = {name: statistics.median(values) for name, values in times.items()}
                step_ms = exploration_ms_per_step(obs_dim, opts.buffer_states, args, opts.steps)
                for name, values in times.items():
                    rows.append(
                        {
                            "obs_dim": obs_dim,
                            "implementation": name,
                            "knn_ms_per_call": medians[name],
                            "min_ms": min(values),
                            "speedup_vs_against": medians[opts.against] / medians[name],
                            "exploration_ms_per_step": step_ms if name == "this" else None,
                        }
                    )
        finally:
            for worker in workers.values():
                worker.close()
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=REPO, capture_output=True)
    columns = ["obs_dim", "implementation", "knn_ms_per_call", "min_ms", "speedup_vs_against", "exploration_ms_per_step"]
    print_table(rows, columns)
    settings = {
        "batch_size": args.batch_size,
        "explore_knn_k": args.explore_knn_k,
        "explore_knn_sample_size": args.explore_knn_sample_size,
        "buffer_states": opts.buffer_states,
        "rounds": opts.rounds,
        "steps": opts.steps,
        "against": opts.against,
        "against_commit": against.stdout.strip(),
        "threads": 1,
    }
    command = " ".join(["python", "bench/knn.py", *sys.argv[1:]])
    write_json(opts.output, {"machine": machine_info(), "settings": settings, "command": command, "rows": rows})


if __name__ == "__main__":
    main()
