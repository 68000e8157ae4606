#!/usr/bin/env bash
# PEBBLE on HalfCheetah-v5 from 500 synthetic labels. Where the settings come from: the benchmarked
# Hopper-v5 script's structure (10k exploration steps, exponential schedule, disagreement sampling, SURF,
# 50-step segments, CleanRL's SAC) with PEBBLE's DMC cheetah budget scale; HalfCheetah never terminates, so
# every segment is a full 50 steps from the start. Not yet swept: sweep_config/halfcheetah.yaml is that sweep.
# Run from the repository root: bash scripts/HalfCheetah-v5.sh [more flags]
set -euo pipefail
python framework/sac_rlhf.py --preset gym-mujoco \
  --env-id HalfCheetah-v5 \
  --teacher-feedback-total-queries 500 \
  --teacher-feedback-num-queries-per-session 50 \
  --teacher-feedback-frequency 10000 \
  "$@"
