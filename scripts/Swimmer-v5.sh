#!/usr/bin/env bash
# PEBBLE on Swimmer-v5 from 500 synthetic labels, as docs/benchmarks/findings/gym-mujoco.md measured it at 100k steps
# (bench/feedback_efficiency.py --variant norm-reset-std1 --labels 500: median 4.98 x SAC over 3 seeds, SAC at 9-27):
# HalfCheetah's three changes (standardised reward-model inputs, the actor started afresh after exploration, the
# learned reward at std 1) with ten sessions of 50 labels every 5k steps from 10k, and gamma 0.9999, the discount
# RL Baselines3 Zoo's tuned SAC uses on Swimmer: its reward is a slow drift that a 0.99 horizon barely sees.
# The seeds disagree (one lost its stroke after the last sessions): see the findings page.
# Run from the repository root: bash scripts/Swimmer-v5.sh [more flags]
set -euo pipefail
python framework/sac_rlhf.py --preset gym-mujoco \
  --env-id Swimmer-v5 \
  --gamma 0.9999 \
  --teacher-feedback-total-queries 500 \
  --teacher-feedback-num-queries-per-session 50 \
  --teacher-feedback-frequency 5000 \
  --reward-net-normalize-inputs \
  --reset-actor-after-exploration \
  --learned-reward-std 1 \
  "$@"
