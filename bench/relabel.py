"""Relabelling the replay buffer: seconds per million transitions for several chunk sizes, and the GFLOP/s the
reward ensemble reaches against this machine's matmul peak (one torch thread, as the scripts run).

After every feedback session PEBBLE recomputes the learned reward of every stored transition
(sac_rlhf.relabel_replay_buffer, chunked by --relabel-chunk-size). The default chunk is chosen from this table.

    python bench/relabel.py                     # Hopper-v5 sizes, 262144 transitions, 5 rounds
    python bench/relabel.py --obs-dim 24 --action-dim 6 --transitions 1000000
"""

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from common import machine_info, print_table, results_path, write_json

import sac_rlhf
from cleanrlhf_utils.buffers import ReplayBuffer


def ensemble_flops_per_row(input_dim: int, members: int, hidden: int, layers: int) -> int:
    """Multiply-adds x 2 of one (obs, action) row through every member."""
    widths = [input_dim, *[hidden] * layers, 1]
    return 2 * members * sum(a * b for a, b in zip(widths, widths[1:]))


def matmul_peak_gflops(size: int = 1024, repeats: int = 5) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--obs-dim", type=int, default=11, help="Hopper-v5: 11")
    parser.add_argument("--action-dim", type=int, default=3, help="Hopper-v5: 3")
    parser.add_argument("--transitions", type=int, default=262_144)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1024, 4096, 8192, 16384, 65536])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", type=Path, default=results_path("relabel", "speed", "relabel"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    defaults = sac_rlhf.Args()
    model = sac_rlhf.RewardEnsemble(
        args.obs_dim + args.action_dim, defaults.reward_ensemble_size, defaults.reward_net_hidden_dim, defaults.reward_net_hidden_layers
    )
    rb = ReplayBuffer(args.transitions, args.obs_dim, args.action_dim, 1)
    rng = np.random.default_rng(0)
    rb.obs[:] = rng.standard_normal(rb.obs.shape)
    rb.actions[:] = rng.uniform(-1, 1, rb.actions.shape)
    rb.pos, rb.full = 0, True
    flops = ensemble_flops_per_row(
        args.obs_dim + args.action_dim, defaults.reward_ensemble_size, defaults.reward_net_hidden_dim, defaults.reward_net_hidden_layers
    )

    seconds = {chunk: [] for chunk in args.chunks}
    for _ in range(args.rounds):  # rounds interleave the chunk sizes, so they share the machine's noise
        for chunk in args.chunks:
            start = time.process_time()
            sac_rlhf.relabel_replay_buffer(model, rb, torch.device("cpu"), chunk)
            seconds[chunk].append(time.process_time() - start)
    peak = matmul_peak_gflops()
    rows = []
    for chunk, values in seconds.items():
        median = statistics.median(values)
        gflops = flops * args.transitions / median / 1e9
        rows.append(
            {
                "chunk": chunk,
                "cpu_s_per_1M": median * 1_000_000 / args.transitions,
                "gflops": gflops,
                "of_matmul_peak": gflops / peak,
            }
        )
    print(f"reward ensemble: {flops / 1e6:.2f} MFLOP per transition; 1024x1024 matmul peak {peak:.1f} GFLOP/s (one thread)")
    print_table(rows, ["chunk", "cpu_s_per_1M", "gflops", "of_matmul_peak"])
    write_json(
        args.output,
        {
            "machine": machine_info(),
            "settings": vars(args) | {"output": str(args.output)},
            "matmul_peak_gflops": peak,
            "rows": rows,
            "seconds": seconds,
        },
    )


if __name__ == "__main__":
    main()
