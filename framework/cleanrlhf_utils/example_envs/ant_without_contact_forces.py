"""Ant-v5 as Gymnasium builds it, less the 78 contact forces of its 105-number observation: the 27 numbers of the
body's pose and velocities that Ant-v4 observed by default. The physics, the reward (the contact cost included) and the
episode's end are Ant-v5's; only what the agent and the reward model see is smaller. An example of bringing your own
environment by changing a Gymnasium one: the module registers the id when imported, which Gymnasium's "module:id" form
does first:

    python framework/sac_rlhf.py --no-terminate-when-unhealthy \\
        --env-id cleanrlhf_utils.example_envs.ant_without_contact_forces:AntWithoutContactForces-v5

Why it exists: on Ant-v5 the contact forces outnumber the rest of the observation three to one, and a reward model
learned from 500 labels on them missed the control cost that dominates the Ant's true reward. Without them PEBBLE and
SAC both did better (docs/benchmarks/findings/gym-mujoco.md); scripts/Ant-v5.sh runs the best setting measured on it."""

import gymnasium as gym

ENV_ID = "AntWithoutContactForces-v5"

if ENV_ID not in gym.registry:
    gym.register(
        ENV_ID,
        entry_point="gymnasium.envs.mujoco.ant_v5:AntEnv",
        max_episode_steps=1000,
        kwargs={"include_cfrc_ext_in_observation": False},
    )
