#!/usr/bin/env bash
# PEBBLE on HalfCheetah-v5 from 500 synthetic labels, as docs/benchmarks/findings/gym-mujoco.md measured it at 100k
# steps (bench/feedback_efficiency.py --variant norm-reset-std1): Hopper's structure (10k exploration steps, exponential
# schedule, disagreement sampling, SURF, 50-step segments, CleanRL's SAC) with ten sessions of 50 labels every 9k
# steps from 10k, and three changes that page found the gap in: the reward model's inputs standardised, SAC's actor
# started afresh when exploration ends (its state-entropy policy rolls the cheetah onto its back), and the learned
# reward rescaled for SAC to a standard deviation of 1 (the model's own scale, about a quarter of the env's, trained
# SAC as slowly as the true reward shrunk to it).
# Run from the repository root: bash scripts/HalfCheetah-v5.sh [more flags]
set -euo pipefail
python framework/sac_rlhf.py --preset gym-mujoco \
  --env-id HalfCheetah-v5 \
  --teacher-feedback-total-queries 500 \
  --teacher-feedback-num-queries-per-session 50 \
  --teacher-feedback-frequency 9000 \
  --reward-net-normalize-inputs \
  --reset-actor-after-exploration \
  --learned-reward-std 1 \
  "$@"
