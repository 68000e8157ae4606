"""Twin critics as one batched network (sac_rlhf.TwinQNetwork) vs two nn.Sequential critics: time of
one critic update (forward, MSE loss, backward, Adam step) on a SAC batch, one torch thread.

    python bench/critic_batching.py [--obs-dim 11 --action-dim 3 --batch-size 256 --rounds 7]
"""

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn as nn
from common import machine_info, print_table, results_path, write_json

import sac_rlhf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--obs-dim", type=int, default=11, help="Hopper-v5: 11")
    parser.add_argument("--action-dim", type=int, default=3, help="Hopper-v5: 3")
    parser.add_argument("--hidden-dim", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--updates", type=int, default=200, help="updates timed per round")
    parser.add_argument("--output", default=str(results_path("critic_batching", "speed", "critic-batching")))
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    obs, actions, target = (
        torch.randn(args.batch_size, args.obs_dim),
        torch.randn(args.batch_size, args.action_dim),
        torch.randn(args.batch_size),
    )
    twin = sac_rlhf.TwinQNetwork(args.obs_dim, args.action_dim, args.hidden_dim, 2)
    width = args.obs_dim + args.action_dim

    def critic() -> nn.Module:
        return nn.Sequential(
            nn.Linear(width, args.hidden_dim),
            nn.ReLU(),
            nn.Linear(args.hidden_dim, args.hidden_dim),
            nn.ReLU(),
            nn.Linear(args.hidden_dim, 1),
        )

    qf1, qf2 = critic(), critic()
    twin_optimizer = torch.optim.Adam(twin.parameters())
    pair_optimizer = torch.optim.Adam([*qf1.parameters(), *qf2.parameters()])

    def batched_update():
        loss = ((twin(obs, actions) - target) ** 2).mean(1).sum()
        twin_optimizer.zero_grad()
        loss.backward()
        twin_optimizer.step()

    def separate_update():
        x = torch.cat([obs, actions], 1)
        loss = ((qf1(x).squeeze(1) - target) ** 2).mean() + ((qf2(x).squeeze(1) - target) ** 2).mean()
        pair_optimizer.zero_grad()
        loss.backward()
        pair_optimizer.step()

    times = {"batched": [], "separate": []}
    for _ in range(args.rounds):  # interleaved, so both see the same machine noise
        for name, update in (("batched", batched_update), ("separate", separate_update)):
            for _ in range(10):
                update()
            start = time.perf_counter()
            for _ in range(args.updates):
                update()
            times[name].append((time.perf_counter() - start) / args.updates * 1000)
    rows = [{"critics": name, "median_ms": statistics.median(t), "min_ms": min(t), "max_ms": max(t)} for name, t in times.items()]
    ratio = rows[1]["median_ms"] / rows[0]["median_ms"]
    print_table(rows, ["critics", "median_ms", "min_ms", "max_ms"])
    print(f"separate / batched = {ratio:.3f}")
    write_json(
        Path(args.output),
        {"benchmark": "critic_batching", "machine": machine_info(), "settings": vars(args), "rows": rows, "separate_over_batched": ratio},
    )


if __name__ == "__main__":
    main()
