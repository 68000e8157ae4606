#!/usr/bin/env bash
# PEBBLE on Swimmer-v5 from 200 synthetic labels. Where the settings come from: the benchmarked Hopper-v5
# script (200 labels, 20 per session, exponential schedule, disagreement sampling, SURF, 50-step segments)
# plus gamma 0.9999, the discount RL Baselines3 Zoo's tuned SAC uses on Swimmer: its reward is a slow drift
# that a 0.99 horizon barely sees. Not yet swept: sweep_config/swimmer.yaml is that sweep.
# Run from the repository root: bash scripts/Swimmer-v5.sh [more flags]
set -euo pipefail
python framework/sac_rlhf.py --preset gym-mujoco \
  --env-id Swimmer-v5 \
  --gamma 0.9999 \
  --teacher-feedback-total-queries 200 \
  --teacher-feedback-num-queries-per-session 20 \
  --teacher-feedback-frequency 5000 \
  "$@"
