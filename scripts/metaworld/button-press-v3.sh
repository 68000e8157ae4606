#!/usr/bin/env bash
# PEBBLE on Meta-World's button-press-v3 (metaworld/button-press-v3) from 20000 synthetic labels on Meta-World's shaped reward.
# Where the settings come from:
# - label budget: the PEBBLE paper's button-press budget (20000 labels; B-Pref's scripts/button_press/ has 10000 and 20000).
# - feedback: 50 queries per session every 5000 steps, the same number each session (linear schedule), 50-step
#   segments, disagreement sampling: B-Pref's Meta-World PEBBLE scripts (reward_batch=50, num_interact=5000,
#   reward_schedule=0, segment=50; feed_type is their command-line choice). At 50 per session the budget lasts
#   400 sessions, more than the 1M steps hold (199 sessions, 9,950 labels): as in B-Pref with this budget,
#   the run ends before the budget does.
# - reward model: 3 members, learning rate 0.0003, at most 10 epochs per session (B-Pref: ensemble_size=3, reward_lr,
#   reward_update=10); SURF on (our default, as in the other run scripts; PEBBLE itself has none).
# - SAC: B-Pref's config/agent/sac_metaworld.yaml and the PEBBLE paper's Meta-World SAC: 3 x 256 units for actor and critic,
#   batch 512, initial temperature 0.1, target update every 2 steps with tau 0.005, actor every step, discount 0.99;
#   actor and critic learning rate 0.0003 as B-Pref's Meta-World run scripts pass it (the yaml's default is 0.0001).
# - 1000 random + 9000 exploration steps (num_seed_steps=1000, num_unsup_steps=9000), 1M steps (num_train_steps).
# - environment: one layout per --seed (MT1 task 0 of that seed), goal observed, 500-step episodes; the metric is
#   eval/success_rate (fraction of the 10 evaluation episodes that reached success at any step).
# Run from the repository root: bash scripts/metaworld/button-press-v3.sh [more flags, e.g. --seed 2]
set -euo pipefail
python framework/sac_rlhf.py --preset metaworld \
  --env-id metaworld/button-press-v3 \
  --teacher-feedback-total-queries 20000 \
  "$@"
