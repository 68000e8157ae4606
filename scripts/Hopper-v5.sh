#!/usr/bin/env bash
# PEBBLE on Hopper-v5 from 200 synthetic labels. Settings of bench/feedback_efficiency.py --variant tuned (the
# figures in the README): 10k exploration steps, 10 sessions of 20 queries, disagreement sampling, SURF on;
# everything else is sac_rlhf.py's default (CleanRL's SAC, PEBBLE's reward model: 3 members x 3 layers x 256,
# lr 3e-4, segments of 50 steps, raw reward-model inputs: standardising them did not help on Hopper).
# Schedule: the labels spread evenly over 10 sessions, one every 90k steps from 10k (the last at 820k), as the README
# recommends for Gymnasium MuJoCo (frequency ~ 0.9 x steps / sessions): bench/feedback_efficiency.py --variant tuned
# measured it at 100k steps on Hopper-v5 and on Walker2d-v5, where the exponential schedule's last labels (at 55k)
# had left the policy free to exploit a reward model no later label corrected.
# Run from the repository root: bash scripts/Hopper-v5.sh [more flags]
set -euo pipefail
python framework/sac_rlhf.py \
  --env-id Hopper-v5 \
  --total-timesteps 1000000 \
  --total-explore-steps 10000 \
  --teacher-feedback-total-queries 200 \
  --teacher-feedback-num-queries-per-session 20 \
  --teacher-feedback-frequency 90000 \
  --teacher-feedback-schedule linear \
  --preference-sampling disagree \
  --segment-length 50 \
  "$@"
