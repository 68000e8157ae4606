#!/usr/bin/env bash
# PEBBLE on Ant-v5 from 1000 synthetic labels. Where the settings come from: the benchmarked Hopper-v5
# script's structure (exponential schedule, disagreement sampling, SURF, 50-step segments, CleanRL's SAC);
# Ant, a quadruped with 8 joints, gets the budget of B-Pref's quadruped-walk scripts (1000 labels, 100 per
# session), spread over sessions every 10k steps. Not yet swept: sweep_config/ant.yaml is that sweep.
# Run from the repository root: bash scripts/Ant-v5.sh [more flags]
set -euo pipefail
python framework/sac_rlhf.py --preset gym-mujoco \
  --env-id Ant-v5 \
  --teacher-feedback-total-queries 1000 \
  --teacher-feedback-num-queries-per-session 100 \
  --teacher-feedback-frequency 10000 \
  "$@"
