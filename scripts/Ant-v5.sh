#!/usr/bin/env bash
# PEBBLE on Ant-v5 from 1000 synthetic labels. Where the settings come from: the benchmarked Hopper-v5 script's
# structure (disagreement sampling, SURF, 50-step segments, CleanRL's SAC); Ant, a quadruped with 8 joints, gets the
# budget of B-Pref's quadruped-walk scripts (1000 labels, 100 per session). Not yet swept: sweep_config/ant.yaml.
# Schedule: the labels spread evenly over 10 sessions, one every 90k steps from 10k (the last at 820k), as the README
# recommends for Gymnasium MuJoCo (frequency ~ 0.9 x steps / sessions): bench/feedback_efficiency.py --variant tuned
# measured it at 100k steps on Hopper-v5 and on Walker2d-v5, where the exponential schedule's last labels (at 55k)
# had left the policy free to exploit a reward model no later label corrected.
# Run from the repository root: bash scripts/Ant-v5.sh [more flags]
set -euo pipefail
python framework/sac_rlhf.py \
  --env-id Ant-v5 \
  --total-timesteps 1000000 \
  --total-explore-steps 10000 \
  --teacher-feedback-total-queries 1000 \
  --teacher-feedback-num-queries-per-session 100 \
  --teacher-feedback-frequency 90000 \
  --teacher-feedback-schedule linear \
  --preference-sampling disagree \
  --segment-length 50 \
  --surf \
  "$@"
