#!/usr/bin/env bash
# PEBBLE on dm_control/walker-walk-v0 from 100 synthetic labels.
# Where the settings come from: the PEBBLE paper's walker-walk setting (100 labels, 10 per session every 20k steps; published PEBBLE 453 and SURF 661 at 500k steps),
# with the SAC of PEBBLE's public DMC configuration (2 x 1024 units, batch 1024, initial temperature 0.1,
# actor and critic learning rate 0.0005, target update every 2 steps, actor every step) and its 1000 random + 9000
# exploration steps, constant (linear) schedule, 50-step segments, disagreement sampling; SURF on (our default).
# These networks are sized for a GPU: bench/feedback_efficiency.py runs this task with CleanRL's 256-unit SAC.
# Reward-model inputs standardised (--reward-net-normalize-inputs): on walker-walk it raised fresh-pair accuracy on the
# latest policy's data by 0.06-0.13 (bench/reward_learning.py, 3 seeds; on Hopper-v5 it did not help, so it is off by default).
# Run from the repository root: bash scripts/dm_control/walker-walk-v0.sh [more flags]
set -euo pipefail
python framework/sac_rlhf.py --preset dmc \
  --env-id dm_control/walker-walk-v0 \
  --total-timesteps 500000 \
  --policy-lr 0.0005 \
  --q-lr 0.0005 \
  --teacher-feedback-total-queries 100 \
  --teacher-feedback-num-queries-per-session 10 \
  --teacher-feedback-frequency 20000 \
  "$@"
