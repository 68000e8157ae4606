#!/usr/bin/env bash
# PEBBLE on Ant-v5 from 500 synthetic labels, as docs/benchmarks/findings/gym-mujoco.md measured it at 100k steps
# (bench/feedback_efficiency.py --variant norm-reset-std1-linear --sessions 16), the best of the settings measured on
# the Ant and still short of SAC (0.57 x at the median of three seeds): Ant-v5 less the 78 contact forces of its
# observation (cleanrlhf_utils/example_envs/ant_without_contact_forces.py; on them the reward model missed the control
# cost) and with no end on a fall, as Christiano et al. (2017) ran it, so that no constant in the learned reward can
# make ending an episode pay; HalfCheetah's three changes (standardised reward inputs, the actor started afresh after
# exploration, the learned reward at std 1); and the budget spread evenly, 31 labels every 5k steps from 10k to 90k,
# so that the late sessions price the states the agent reaches then. SAC on the same task, to compare with, is
# framework/sac.py with the same --env-id and --no-terminate-when-unhealthy (no end on a fall either)
# Run from the repository root: bash scripts/Ant-v5.sh [more flags]
set -euo pipefail
python framework/sac_rlhf.py --preset gym-mujoco \
  --env-id cleanrlhf_utils.example_envs.ant_without_contact_forces:AntWithoutContactForces-v5 \
  --no-terminate-when-unhealthy \
  --teacher-feedback-total-queries 500 \
  --teacher-feedback-num-queries-per-session 31 \
  --teacher-feedback-frequency 5000 \
  --teacher-feedback-schedule linear \
  --reward-net-normalize-inputs \
  --reset-actor-after-exploration \
  --learned-reward-std 1 \
  "$@"
