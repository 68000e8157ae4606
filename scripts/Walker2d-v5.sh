#!/usr/bin/env bash
# PEBBLE on Walker2d-v5 from 500 synthetic labels, as docs/benchmarks/findings/gym-mujoco.md measured it at 100k
# steps (bench/feedback_efficiency.py --variant norm-reset-std1; median 1.09 x SAC over 3 seeds): HalfCheetah's
# setting, Hopper's structure (10k exploration steps, exponential schedule, disagreement sampling, SURF, 50-step
# segments, CleanRL's SAC) with ten sessions of 50 labels every 9k steps from 10k, the reward model's inputs
# standardised, SAC's actor started afresh when exploration ends, and the learned reward rescaled for SAC to a
# standard deviation of 1. The even schedule with raw inputs (`--variant tuned`, 200 labels) had reached 0.71 x SAC
# over three seeds (docs/benchmarks/findings/walker2d.md).
# Run from the repository root: bash scripts/Walker2d-v5.sh [more flags]
set -euo pipefail
python framework/sac_rlhf.py --preset gym-mujoco \
  --env-id Walker2d-v5 \
  --teacher-feedback-total-queries 500 \
  --teacher-feedback-num-queries-per-session 50 \
  --teacher-feedback-frequency 9000 \
  --reward-net-normalize-inputs \
  --reset-actor-after-exploration \
  --learned-reward-std 1 \
  "$@"
