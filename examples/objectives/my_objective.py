"""An objective of your own for the synthetic teacher: `--teacher-objective my_objective:hop_high`.

Put this file's folder on PYTHONPATH (or install it in a package), then:

    PYTHONPATH=examples/objectives python framework/sac_rlhf.py --env-id Hopper-v5 --teacher-objective my_objective:hop_high

The signature (cleanrlhf_utils/objectives.py):

    def objective(obs, actions, states) -> rewards
        obs:     float array [n_segments, segment_len, obs_dim]     the observation each action was taken in
        actions: float array [n_segments, segment_len, action_dim]
        states:  float array [n_segments, segment_len, state_dim]   the simulator state behind each observation
                 (MuJoCo: mj_getState's mjSTATE_FULLPHYSICS = [time, qpos, qvel, act, ...])
        returns: float array [n_segments, segment_len], the objective's reward of every step

Vectorise it (numpy on whole arrays, no loop over segments or steps): the teacher labels a whole feedback session's
pairs in one call. Optional attributes: `success` (whole episodes [n, T + 1, ...] -> [n], logged as
eval/objective_success), `envs` (env names it is for; others are refused) and `settings` ({Args field: value}
the behaviour needs, e.g. {"terminate_when_unhealthy": False}).
"""

import numpy as np

HOPPER_NQ = 6  # Hopper's qpos: [x, z, pitch, thigh, leg, foot]


def hop_high(obs: np.ndarray, actions: np.ndarray, states: np.ndarray) -> np.ndarray:
    """Torso height above 1.3 m (the Hopper stands at 1.25 m), minus a small control cost."""
    height = states[..., 1 + 1]  # states = [time, qpos...]: qpos[1] is the torso's height
    return np.maximum(0.0, height - 1.3) - 1e-3 * np.square(actions).sum(-1)


def time_airborne(obs: np.ndarray, actions: np.ndarray, states: np.ndarray) -> np.ndarray:
    """Per episode: the share of steps with the torso above 1.3 m."""
    return (states[..., 2] > 1.3)[:, :-1].mean(1)


hop_high.success = time_airborne
hop_high.envs = ("Hopper",)
