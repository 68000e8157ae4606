#!/usr/bin/env bash
# A short PEBBLE run on Hopper-v5 that shows the whole loop, and the evaluation return rising, in about 15 minutes
# on one CPU thread, before you commit hours to scripts/Hopper-v5.sh: 1000 random steps, unsupervised exploration
# until step 5000, then a feedback session every 5000 steps until the 100 synthetic labels are used (5 sessions,
# more labels in the early ones), each followed by reward-model training and a relabelling of the replay buffer,
# and an evaluation (5 episodes, true return) every 5000 steps; 40 000 steps in all. docs/getting-started.md ("See it
# learn in about 15 minutes") has the returns and the time it took on the development machine (14 min, 2 shared
# cores); the progress bar shows yours (eval=, labels=), TensorBoard the curves (eval/mean_return, reward_model/*).
# Run from the repository root: bash scripts/Hopper-v5-demo.sh [more flags]
set -euo pipefail
python framework/sac_rlhf.py \
  --env-id Hopper-v5 \
  --exp-name demo \
  --total-timesteps 40000 \
  --learning-starts 1000 \
  --total-explore-steps 5000 \
  --teacher-feedback-total-queries 100 \
  --teacher-feedback-num-queries-per-session 20 \
  --teacher-feedback-frequency 5000 \
  --evaluation-frequency 5000 \
  --evaluation-episodes 5 \
  "$@"
