#!/usr/bin/env bash
# QPA (Query-Policy Alignment, Hu et al. 2024) on dm_control/quadruped-walk-v0 from 1000 synthetic labels.
# Where the settings come from: the QPA paper's public DMC configuration for this task: 1000 labels, 100 per session every
# 30000 steps after 1000 random + 9000 exploration steps, uniform queries drawn from the last 10 episodes
# (--qpa-query-episodes 10), half of every SAC batch from those episodes while labels remain (--qpa-hybrid-ratio 0.5),
# 20 cropped copies of every labelled pair (--qpa-augmentations 20), one reward network, no SURF, 50-step segments,
# actor and critic learning rate 0.0001, 1000000 steps; SAC otherwise as in scripts/dm_control/quadruped-walk-v0.sh.
# QPA trains its reward model a fixed 2000 x labels / batch gradient steps per session; here the epochs stop at the
# script's usual training-accuracy rule (bench/reward_learning.py measures the difference).
# Reward-model inputs standardised (--reward-net-normalize-inputs), as in this task's PEBBLE script: QPA changes which
# pairs are asked and replayed, not the model's inputs, and bench/feedback_efficiency.py --variant qpa runs it so.
# Run from the repository root: bash scripts/dm_control/quadruped-walk-v0_qpa.sh [more flags]
set -euo pipefail
python framework/sac_rlhf.py --preset dmc-qpa \
  --env-id dm_control/quadruped-walk-v0 \
  --total-timesteps 1000000 \
  --policy-lr 0.0001 \
  --q-lr 0.0001 \
  --teacher-feedback-total-queries 1000 \
  --teacher-feedback-num-queries-per-session 100 \
  --teacher-feedback-frequency 30000 \
  "$@"
