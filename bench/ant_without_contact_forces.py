"""Ant-v5 as Gymnasium builds it, less the 78 contact forces in its 105-number observation (Ant-v4's default, the
27 numbers of the body's pose and velocities): an experiment on the reward model's inputs, where the contact
forces outnumber the rest three to one and the learned reward misses the control cost that dominates the Ant's
true reward. Both runs see the same observation. The module registers the id when imported (Gymnasium's
"module:id" form); the benchmarks start their runs with bench/ on the import path:

    python bench/feedback_efficiency.py --variant norm-reset-std1 --labels 500 --seeds 1 \\
        --env-id ant_without_contact_forces:AntWithoutContactForces-v5 --no-terminate-when-unhealthy

docs/benchmarks/findings/gym-mujoco.md has what it did."""

import gymnasium as gym

ENV_ID = "AntWithoutContactForces-v5"

if ENV_ID not in gym.registry:
    gym.register(
        ENV_ID,
        entry_point="gymnasium.envs.mujoco.ant_v5:AntEnv",
        max_episode_steps=1000,
        kwargs={"include_cfrc_ext_in_observation": False},
    )
