#!/usr/bin/env bash
# PEBBLE on Walker2d-v5 from 500 synthetic labels. Where the settings come from: the structure of the
# benchmarked Hopper-v5 script (10k exploration steps, exponential schedule, disagreement sampling, SURF,
# 50-step segments, CleanRL's SAC), with the label budget raised for a harder task within the 100-2000
# range PEBBLE and B-Pref use on locomotion. Not yet swept: sweep_config/walker2d.yaml is that sweep.
# Run from the repository root: bash scripts/Walker2d-v5.sh [more flags]
set -euo pipefail
python framework/sac_rlhf.py \
  --env-id Walker2d-v5 \
  --total-timesteps 1000000 \
  --total-explore-steps 10000 \
  --teacher-feedback-total-queries 500 \
  --teacher-feedback-num-queries-per-session 50 \
  --teacher-feedback-frequency 5000 \
  --teacher-feedback-schedule exponential \
  --preference-sampling disagree \
  --segment-length 50 \
  --surf \
  "$@"
