"""SURF's temporal crops cut out (sac_rlhf.crop_segments) against masked (the crop multiplies the mask, every step is
still computed): CPU seconds of sac_rlhf.train_reward_model with SURF, a fixed number of epochs, one torch thread.

Both arms run the same code with the same random draws; the masked arm replaces crop_segments by a function that
returns the whole segments with the crop folded into the mask. Interleaved rounds, medians.

    python bench/surf_crops.py                          # 200 labels of 50 steps, Hopper-v5 sizes, 5 epochs
    python bench/surf_crops.py --labels 1000 --obs-dim 24 --action-dim 6
"""

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from common import machine_info, print_table, results_path, write_json

import sac_rlhf
from cleanrlhf_utils.buffers import ReplayBuffer

CUT_OUT = sac_rlhf.crop_segments


def masked_crops(segments, masks, min_offset, max_offset, cut_out=True):
    """The crops folded into the mask, nothing cut out: the same draws, every step of the segment computed."""
    return CUT_OUT(segments, masks, min_offset, max_offset, cut_out=False)


def fit_cpu_seconds(crop, args, rb, prefs, seed: int) -> tuple[float, float]:
    original, sac_rlhf.crop_segments = sac_rlhf.crop_segments, crop
    try:
        torch.manual_seed(seed)
        model = sac_rlhf.RewardEnsemble(
            rb.obs.shape[1] + rb.actions.shape[1], args.reward_ensemble_size, args.reward_net_hidden_dim, args.reward_net_hidden_layers
        )
        optimizer = torch.optim.Adam(model.parameters(), lr=args.reward_net_lr)
        start = time.process_time()
        stats = sac_rlhf.train_reward_model(model, optimizer, prefs, rb, args, np.random.default_rng(seed), "cpu")
        return time.process_time() - start, stats["train_loss"]
    finally:
        sac_rlhf.crop_segments = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--labels", type=int, default=200)
    parser.add_argument("--obs-dim", type=int, default=11)
    parser.add_argument("--action-dim", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", type=Path, default=results_path("surf_crops", "speed", "surf-crops"))
    opts = parser.parse_args()
    torch.set_num_threads(1)
    args = dataclasses.replace(sac_rlhf.Args(), reward_net_epochs=opts.epochs, reward_net_target_accuracy=2.0)  # never stops early

    rng = np.random.default_rng(0)
    rb = ReplayBuffer(20_000, opts.obs_dim, opts.action_dim, 1)
    rb.obs[:], rb.actions[:] = rng.standard_normal(rb.obs.shape), rng.uniform(-1, 1, rb.actions.shape)
    rb.true_rewards[:], rb.episode_ids[:], rb.pos, rb.full = rng.standard_normal(rb.capacity), np.arange(rb.capacity) // 1000, 0, True
    idx, mask = rb.sample_segment_pairs(opts.labels, args.segment_length, rng)
    segments = rb.gather_segments(idx, mask)
    prefs = sac_rlhf.PreferenceBuffer(args.segment_length, opts.obs_dim + opts.action_dim, 1)
    labels = (segments["true_rewards"].sum(-1).argmax(-1)).astype(np.float32)
    prefs.add(
        segments["obs_actions"],
        segments["masks"],
        segments["true_rewards"],
        segments["physics_states"],
        labels,
        np.zeros(opts.labels, bool),
        1,
    )

    arms = {"cut out": sac_rlhf.crop_segments, "masked": masked_crops}
    times, losses = {name: [] for name in arms}, {}
    for round_ in range(opts.rounds):
        for name, crop in arms.items():
            seconds, losses[name] = fit_cpu_seconds(crop, args, rb, prefs, seed=round_)
            times[name].append(seconds)
    medians = {name: statistics.median(values) for name, values in times.items()}
    rows = [
        {"crops": name, "fit_cpu_s": medians[name], "speedup": medians["masked"] / medians[name], "last_loss": losses[name]}
        for name in arms
    ]
    print_table(rows, ["crops", "fit_cpu_s", "speedup", "last_loss"])
    settings = {**vars(opts), "output": str(opts.output), "segment_length": args.segment_length, "threads": 1}
    settings |= {
        k: getattr(args, k)
        for k in ("min_augmentation_offset", "max_augmentation_offset", "unlabeled_batch_ratio", "reward_net_batch_size")
    }
    command = " ".join(["python", "bench/surf_crops.py", *sys.argv[1:]])
    write_json(opts.output, {"machine": machine_info(), "settings": settings, "command": command, "rows": rows, "times": times})


if __name__ == "__main__":
    main()
