#!/usr/bin/env bash
# PEBBLE on Swimmer-v5 from 200 synthetic labels. Where the settings come from: the benchmarked Hopper-v5
# script (200 labels, 20 per session, disagreement sampling, SURF, 50-step segments) plus gamma 0.9999, the
# discount RL Baselines3 Zoo's tuned SAC uses on Swimmer: its reward is a slow drift that a 0.99 horizon barely
# sees. Not yet swept: sweep_config/swimmer.yaml is that sweep.
# Schedule: the labels spread evenly over 10 sessions, one every 90k steps from 10k (the last at 820k), as the README
# recommends for Gymnasium MuJoCo (frequency ~ 0.9 x steps / sessions): bench/feedback_efficiency.py --variant tuned
# measured it at 100k steps on Hopper-v5 and on Walker2d-v5, where the exponential schedule's last labels (at 55k)
# had left the policy free to exploit a reward model no later label corrected.
# Run from the repository root: bash scripts/Swimmer-v5.sh [more flags]
set -euo pipefail
python framework/sac_rlhf.py \
  --env-id Swimmer-v5 \
  --total-timesteps 1000000 \
  --gamma 0.9999 \
  --total-explore-steps 10000 \
  --teacher-feedback-total-queries 200 \
  --teacher-feedback-num-queries-per-session 20 \
  --teacher-feedback-frequency 90000 \
  --teacher-feedback-schedule linear \
  --preference-sampling disagree \
  --segment-length 50 \
  --surf \
  "$@"
