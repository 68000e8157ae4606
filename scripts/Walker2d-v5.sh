#!/usr/bin/env bash
# PEBBLE on Walker2d-v5 from 500 synthetic labels. Where the settings come from: bench/feedback_efficiency.py
# --variant tuned (10k exploration steps, disagreement sampling, SURF, 50-step segments, CleanRL's SAC, raw
# reward-model inputs; README figures with 200 labels at 100k steps), with the label budget raised for a 1M-step
# run within the 100-2000 range PEBBLE and B-Pref use on locomotion. sweep_config/walker2d.yaml sweeps it.
# Schedule: the labels spread evenly over 10 sessions, one every 90k steps from 10k (the last at 820k), as the README
# recommends for Walker2d (frequency ~ 0.9 x steps / sessions): bench/feedback_efficiency.py --variant tuned
# measured it at 100k steps on Walker2d-v5 (median 0.71 x SAC over 3 seeds, the reward model at 0.95 fresh-pair
# accuracy by the end but slow to start), where the exponential schedule's last labels (at 55k) had left the policy
# free to exploit a reward model no later label corrected (0.07 x SAC), and where the exponential schedule spread over
# the same ten sessions to 91k did worse on the same seeds (0.45 x SAC).
# Run from the repository root: bash scripts/Walker2d-v5.sh [more flags]
set -euo pipefail
python framework/sac_rlhf.py --preset gym-mujoco \
  --env-id Walker2d-v5 \
  --teacher-feedback-total-queries 500 \
  --teacher-feedback-num-queries-per-session 50 \
  --teacher-feedback-frequency 90000 \
  --teacher-feedback-schedule linear \
  "$@"
