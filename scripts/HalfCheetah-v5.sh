#!/usr/bin/env bash
# PEBBLE on HalfCheetah-v5 from 500 synthetic labels. Where the settings come from: the benchmarked Hopper-v5
# script's structure (10k exploration steps, disagreement sampling, SURF, 50-step segments, CleanRL's SAC) with
# PEBBLE's DMC cheetah budget scale; HalfCheetah never terminates, so every segment is a full 50 steps from the
# start. Not yet swept: sweep_config/halfcheetah.yaml is that sweep.
# Schedule: the labels spread evenly over 10 sessions, one every 90k steps from 10k (the last at 820k), as the README
# recommends for Gymnasium MuJoCo (frequency ~ 0.9 x steps / sessions): bench/feedback_efficiency.py --variant tuned
# measured it at 100k steps on Hopper-v5 and on Walker2d-v5, where the exponential schedule's last labels (at 55k)
# had left the policy free to exploit a reward model no later label corrected.
# Run from the repository root: bash scripts/HalfCheetah-v5.sh [more flags]
set -euo pipefail
python framework/sac_rlhf.py \
  --env-id HalfCheetah-v5 \
  --total-timesteps 1000000 \
  --total-explore-steps 10000 \
  --teacher-feedback-total-queries 500 \
  --teacher-feedback-num-queries-per-session 50 \
  --teacher-feedback-frequency 90000 \
  --teacher-feedback-schedule linear \
  --preference-sampling disagree \
  --segment-length 50 \
  --surf \
  "$@"
