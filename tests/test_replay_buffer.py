"""The replay buffer as `main` fills it from a real Hopper-v5 run, its segments, re-rendering and checkpoints."""

import imageio_ffmpeg
import mujoco
import numpy as np
import pytest
import torch

import sac_rlhf
from cleanrlhf_utils.buffers import ReplayBuffer
from cleanrlhf_utils.envs import SegmentRenderer, set_physics_state, write_mp4

ENV_ID, SEED, STEPS = "Hopper-v5", 1, 300
WIDTH, HEIGHT = 64, 48
RENDERED = 24  # stored transitions re-rendered and compared with live frames


@pytest.fixture(scope="module")
def main_run(tmp_path_factory):
    """300 random-action steps of the real training loop (no learning yet); its replay buffer from the final checkpoint."""
    folder = tmp_path_factory.mktemp("main_run")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as monkeypatch:
            monkeypatch.chdir(folder)
            args = sac_rlhf.Args(
                run_name="run",
                seed=SEED,
                env_id=ENV_ID,
                total_timesteps=STEPS,
                cuda=False,
                progress_bar=False,
                evaluation_frequency=0,
                evaluation_episodes=1,
                checkpoint_frequency=0,
                actor_hidden_dim=32,
                critic_hidden_dim=32,
                reward_net_hidden_dim=32,
            )
            summary = sac_rlhf.main(args)
    finally:
        torch.set_num_threads(threads)
    path = folder / "models" / "run" / "latest" / "replay_buffer.npz"
    with np.load(path) as data:
        rb = sac_rlhf.ReplayBuffer(int(data["capacity"]), data["obs"].shape[1], data["actions"].shape[1], data["physics_states"].shape[1])
    rb.load(path)
    return summary, rb, path


def fresh_env(render: bool = False):
    return sac_rlhf.make_env(ENV_ID, SEED, render_mode="rgb_array" if render else None, width=WIDTH, height=HEIGHT)()


# ----------------------------------------------------------------------------------------
# What main stores
# ----------------------------------------------------------------------------------------
def test_main_skips_autoreset_steps(main_run):
    summary, rb, _ = main_run
    assert summary["global_step"] == STEPS
    assert rb.capacity == STEPS and not rb.full
    n = rb.size
    terminated = rb.terminated[:n].astype(bool)
    episode_ids = rb.episode_ids[:n]
    assert terminated.sum() >= 3  # several random-action episodes ended
    # Next-step autoreset: every episode end is followed by one reset-only step, except an end at the last step.
    autoreset_steps = int(terminated.sum()) - int(terminated[-1])
    assert n == STEPS - autoreset_steps
    # Episode ids start at 0 and advance exactly after each terminal transition.
    assert episode_ids[0] == 0
    np.testing.assert_array_equal(np.diff(episode_ids), terminated[:-1].astype(int))
    assert np.all(np.diff(np.flatnonzero(np.r_[True, terminated])) <= 1000)  # no time-limit truncation in play


def test_stored_transitions_chain_within_episodes(main_run):
    _, rb, _ = main_run
    n = rb.size
    same_episode = rb.episode_ids[1:n] == rb.episode_ids[: n - 1]
    assert same_episode.sum() > 200
    np.testing.assert_array_equal(rb.obs[1:n][same_episode], rb.next_obs[: n - 1][same_episode])
    # Across an episode boundary the next stored obs is a reset observation, not the terminal next_obs.
    boundary = np.flatnonzero(~same_episode)
    assert len(boundary) >= 3
    reset_obs = rb.obs[boundary + 1]
    assert np.all(np.abs(reset_obs - rb.next_obs[boundary]).max(-1) > 0.01)
    for first in np.r_[0, boundary + 1]:
        # Hopper's reset: init pose (height 1.25) plus uniform noise of scale 5e-3.
        expected = np.zeros(rb.obs.shape[1], dtype=np.float32)
        expected[0] = 1.25
        assert np.abs(rb.obs[first] - expected).max() <= 5e-3 + 1e-6
    # No reset observation was ever stored as the result of an action.
    for obs in reset_obs:
        assert not np.any(np.all(rb.next_obs[:n] == obs, axis=-1))


def test_stored_transitions_are_real_env_transitions(main_run):
    """Putting the stored simulator state into a fresh env and taking the stored action reproduces the transition."""
    _, rb, _ = main_run
    env = fresh_env()
    env.reset(seed=0)
    try:
        worst = {"obs": 0.0, "next_obs": 0.0, "reward": 0.0}
        for i in range(rb.size):
            set_physics_state(env, rb.physics_states[i])
            worst["obs"] = max(worst["obs"], float(np.abs(env.unwrapped._get_obs() - rb.obs[i]).max()))
            next_obs, reward, terminated, _, _ = env.step(rb.actions[i])
            worst["next_obs"] = max(worst["next_obs"], float(np.abs(next_obs - rb.next_obs[i]).max()))
            worst["reward"] = max(worst["reward"], abs(reward - float(rb.true_rewards[i])))
            assert terminated == bool(rb.terminated[i]), i
    finally:
        env.close()
    assert max(worst.values()) < 1e-5, worst  # float32 storage


# ----------------------------------------------------------------------------------------
# Segments
# ----------------------------------------------------------------------------------------
def expected_mask(episode_ids: np.ndarray, size: int, start: int, length: int) -> np.ndarray:
    """Walks forward in time from `start` (a buffer that never wrapped) until the episode or the data ends."""
    mask = np.zeros(length, dtype=bool)
    for j in range(length):
        if start + j >= size or episode_ids[start + j] != episode_ids[start]:
            break
        mask[j] = True
    return mask


def test_segment_masks_stop_at_episode_ends(main_run):
    _, rb, _ = main_run
    length, n = 16, rb.size
    starts = np.arange(n)
    idx, mask = rb.segment_indices(starts, length)
    np.testing.assert_array_equal(idx, (starts[:, None] + np.arange(length)) % rb.capacity)
    for start in starts:
        np.testing.assert_array_equal(mask[start], expected_mask(rb.episode_ids, n, start, length), err_msg=str(start))
    assert mask[:, 0].all()
    truncated = ~mask.all(-1)
    assert truncated.sum() > 30
    # A segment cut short ends on a terminal transition or on the newest one, never elsewhere.
    last_valid = idx[truncated, mask[truncated].sum(-1) - 1]
    assert np.all((rb.terminated[last_valid] == 1) | (last_valid == n - 1))
    # Pairs sampled for queries never mix episodes either.
    pair_idx, pair_mask = rb.sample_segment_pairs(500, length, np.random.default_rng(0))
    start_episode = rb.episode_ids[pair_idx[..., :1]]
    assert np.all(rb.episode_ids[pair_idx][pair_mask] == np.broadcast_to(start_episode, pair_idx.shape)[pair_mask])
    assert np.all(pair_idx[pair_mask] < n)


def small_buffer(capacity: int, episode_ids: list[int]):
    """obs[i] = [t] where t is the time the transition was added."""
    rb = sac_rlhf.ReplayBuffer(capacity, 1, 1, 1)
    for t, episode in enumerate(episode_ids):
        rb.add(np.array([t]), np.array([t + 1]), np.zeros(1), float(t), 0.0, episode, np.full(1, float(t)))
    return rb


def test_segment_indices_wrap_around_in_a_full_buffer():
    # 13 transitions in 10 slots: slots 0-2 hold t=10..12, slots 3-9 hold t=3..9.
    rb = small_buffer(10, [0] * 5 + [1] * 8)
    assert rb.full and rb.pos == 3
    np.testing.assert_array_equal(rb.obs[:, 0], [10, 11, 12, 3, 4, 5, 6, 7, 8, 9])
    idx, mask = rb.segment_indices(np.array([8, 2, 3, 4]), 5)
    np.testing.assert_array_equal(idx[0], [8, 9, 0, 1, 2])
    np.testing.assert_array_equal(rb.obs[idx[0][mask[0]], 0], [8, 9, 10, 11, 12])  # wraps inside episode 1
    np.testing.assert_array_equal(mask[1], [True, False, False, False, False])  # newest: stops at pos
    np.testing.assert_array_equal(mask[2], [True, True, False, False, False])  # t=3, 4 then episode 1
    np.testing.assert_array_equal(mask[3], [True, False, False, False, False])


def test_segment_indices_never_run_from_newest_to_oldest():
    # One episode longer than the buffer: slot pos-1 holds the newest step, slot pos the oldest.
    rb = small_buffer(10, [0] * 13)
    assert rb.full and rb.pos == 3
    idx, mask = rb.segment_indices(np.array([2, 0, 8]), 4)
    np.testing.assert_array_equal(mask[0], [True, False, False, False])  # t=12 is not followed by t=3
    np.testing.assert_array_equal(mask[1], [True, True, True, False])  # t=10, 11, 12
    np.testing.assert_array_equal(mask[2], [True, True, True, True])  # t=8, 9, 10, 11
    # The valid steps of any segment are consecutive in time.
    starts = np.arange(10)
    idx, mask = rb.segment_indices(starts, 6)
    times = rb.obs[idx, 0]
    for t, m in zip(times, mask):
        np.testing.assert_array_equal(np.diff(t[m]), np.ones(m.sum() - 1))


# ----------------------------------------------------------------------------------------
# Re-rendering stored segments and writing videos
# ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rendered(main_run):
    """Frames of the first stored transitions: live (replaying the run in a rendering env) and re-rendered."""
    _, rb, _ = main_run
    live_env = fresh_env(render=True)
    renderer = SegmentRenderer(ENV_ID, WIDTH, HEIGHT)
    try:
        obs, _ = live_env.reset(seed=SEED)  # main resets with its seed, then autoresets without one
        live, lockstep_error = [], 0.0
        for i in range(RENDERED):
            if i > 0 and rb.episode_ids[i] != rb.episode_ids[i - 1]:
                obs, _ = live_env.reset()
            lockstep_error = max(lockstep_error, float(np.abs(obs.astype(np.float32) - rb.obs[i]).max()))
            # Gymnasium renders after mj_step, whose positions (xpos) are those before the last substep's
            # integration; mj_forward brings them to the current state (it changes no state: the run goes on
            # identically, see lockstep_error), so the live frame shows the state behind obs[i].
            mujoco.mj_forward(live_env.unwrapped.model, live_env.unwrapped.data)
            live.append(live_env.render())
            obs, *_ = live_env.step(rb.actions[i])
        again = renderer.render_states(rb.physics_states[:RENDERED])
        fps = renderer.fps
    finally:
        live_env.close()
        renderer.close()
    return np.stack(live), again, lockstep_error, fps


def test_rerendered_frames_equal_live_frames(main_run, rendered):
    _, rb, _ = main_run
    live, again, lockstep_error, _ = rendered
    assert lockstep_error == 0.0  # the rendering env followed the stored run exactly
    assert np.any(rb.episode_ids[:RENDERED] != rb.episode_ids[0])  # an episode boundary is among them
    assert live.shape == again.shape == (RENDERED, HEIGHT, WIDTH, 3) and again.dtype == np.uint8
    assert np.abs(live.astype(int) - again.astype(int)).max() == 0
    assert len({frame.tobytes() for frame in again}) > RENDERED // 2  # the hopper moves: frames differ


def test_write_mp4_round_trip(tmp_path, rendered):
    _, frames, _, fps = rendered
    path = tmp_path / "videos" / "segment.mp4"  # the parent folder is created
    write_mp4(path, frames, fps)
    assert path.stat().st_size > 0
    reader = imageio_ffmpeg.read_frames(str(path))
    meta = next(reader)
    decoded = np.stack([np.frombuffer(frame, dtype=np.uint8).reshape(HEIGHT, WIDTH, 3) for frame in reader])
    assert tuple(meta["size"]) == (WIDTH, HEIGHT)
    assert len(decoded) == len(frames)
    assert np.abs(decoded.astype(int) - frames.astype(int)).mean() < 6  # lossy, but the same pictures

    # Frame order and content: uniform grey levels 0, 20, ..., 220 come back in order.
    grey = np.repeat(np.arange(0, 240, 20, dtype=np.uint8), HEIGHT * WIDTH * 3).reshape(12, HEIGHT, WIDTH, 3)
    write_mp4(tmp_path / "grey.mp4", grey, 10)
    reader = imageio_ffmpeg.read_frames(str(tmp_path / "grey.mp4"))
    next(reader)
    levels = [np.frombuffer(frame, dtype=np.uint8).mean() for frame in reader]
    np.testing.assert_allclose(levels, np.arange(0, 240, 20), atol=4)


# ----------------------------------------------------------------------------------------
# Buffer checkpoints
# ----------------------------------------------------------------------------------------
def assert_same_buffer(a, b):
    assert (a.pos, a.full, a.capacity) == (b.pos, b.full, b.capacity)
    for name in sac_rlhf.ReplayBuffer.FIELDS:
        np.testing.assert_array_equal(getattr(a, name)[: a.size], getattr(b, name)[: b.size], err_msg=name)


def test_buffer_save_load_round_trip(main_run, tmp_path):
    _, rb, _ = main_run
    rb.learned_rewards[: rb.size] = np.linspace(-1, 1, rb.size)  # non-default values survive too
    path = tmp_path / "rb.npz"
    rb.save(path)
    assert path.is_file() and not list(tmp_path.glob("*.tmp*"))
    loaded = sac_rlhf.ReplayBuffer(rb.capacity, rb.obs.shape[1], rb.actions.shape[1], rb.physics_states.shape[1])
    loaded.load(path)
    assert_same_buffer(loaded, rb)

    wrapped = small_buffer(10, [0] * 5 + [1] * 8)
    wrapped.save(tmp_path / "wrapped.npz")
    same = sac_rlhf.ReplayBuffer(10, 1, 1, 1)
    same.load(tmp_path / "wrapped.npz")
    assert_same_buffer(same, wrapped)
    np.testing.assert_array_equal(same.obs[:, 0], [10, 11, 12, 3, 4, 5, 6, 7, 8, 9])


def test_loading_a_wrapped_buffer_into_a_larger_one_unrolls_it(tmp_path):
    wrapped = small_buffer(10, [0] * 5 + [1] * 8)
    wrapped.save(tmp_path / "wrapped.npz")
    larger = sac_rlhf.ReplayBuffer(20, 1, 1, 1)
    larger.load(tmp_path / "wrapped.npz")
    assert (larger.pos, larger.full, larger.size) == (10, False, 10)
    np.testing.assert_array_equal(larger.obs[:10, 0], np.arange(3, 13))  # oldest first
    np.testing.assert_array_equal(larger.next_obs[:10, 0], np.arange(4, 14))
    np.testing.assert_array_equal(larger.physics_states[:10, 0], np.arange(3, 13))
    np.testing.assert_array_equal(larger.episode_ids[:10], [0, 0] + [1] * 8)
    # Segments now run contiguously across the old wrap point, and new steps go after the newest.
    idx, mask = larger.segment_indices(np.array([4]), 5)
    np.testing.assert_array_equal(larger.obs[idx[0], 0], [7, 8, 9, 10, 11])
    assert mask.all()
    assert larger.add(np.array([13]), np.array([14]), np.zeros(1), 13.0, 0.0, 1, np.zeros(1)) == 10

    smaller = sac_rlhf.ReplayBuffer(5, 1, 1, 1)
    with pytest.raises(sac_rlhf.ConfigError, match="more than this run's capacity"):
        smaller.load(tmp_path / "wrapped.npz")

    partial = small_buffer(10, [0] * 7)
    partial.save(tmp_path / "partial.npz")
    larger = sac_rlhf.ReplayBuffer(20, 1, 1, 1)
    larger.load(tmp_path / "partial.npz")
    assert (larger.pos, larger.full) == (7, False)
    np.testing.assert_array_equal(larger.obs[:7, 0], np.arange(7))


def episodes_buffer(lengths_and_ends: list[tuple[int, bool]]):
    """Consecutive episodes of given lengths; `True` ends the episode on a terminal transition, `False` on a time limit
    (the last entry may be the unfinished current episode)."""
    rb = sac_rlhf.ReplayBuffer(1000, 1, 1, 1)
    t = 0
    for episode, (length, terminal) in enumerate(lengths_and_ends):
        for i in range(length):
            rb.add(np.array([t]), np.array([t + 1]), np.zeros(1), 1.0, float(terminal and i == length - 1), episode, np.zeros(1))
            t += 1
    return rb


def test_query_segments_are_never_cut_by_a_time_limit_or_the_newest_step():
    # Episodes: 60 steps cut by a time limit, 12 ending in a fall, 100 cut by a time limit, 70 still running.
    rb = episodes_buffer([(60, False), (12, True), (100, False), (70, False)])
    length = 25
    idx, mask = rb.sample_segment_pairs(2000, length, np.random.default_rng(0))
    cut = ~mask.all(-1)
    last = np.take_along_axis(idx, mask.sum(-1, keepdims=True) - 1, axis=-1)[..., 0]
    assert np.all(rb.terminated[last[cut]] == 1)  # only the fall cuts a segment
    starts = idx[..., 0]
    assert np.all(starts[:, 0] != starts[:, 1])
    # Every good start is drawn, about uniformly: 36 + 12 + 76 + 46 of them.
    good = np.flatnonzero(rb.whole_segments(np.arange(rb.size), length))
    assert len(good) == 36 + 12 + 76 + 46
    counts = np.bincount(starts.ravel(), minlength=rb.size)
    assert set(np.flatnonzero(counts)) == set(good)
    assert counts[good].min() > 5 and counts[good].max() < 50  # mean 23.5 per start
    # The sampler before this rule (whole=False) cuts segments at time limits: a quarter of them here.
    idx, mask = rb.sample_segment_pairs(2000, length, np.random.default_rng(0), whole=False)
    last = np.take_along_axis(idx, mask.sum(-1, keepdims=True) - 1, axis=-1)[..., 0]
    assert (~mask.all(-1) & (rb.terminated[last] == 0)).mean() > 0.2


def test_episodes_shorter_than_a_segment_still_give_queries():
    rb = episodes_buffer([(8, False)] * 5)
    idx, mask = rb.sample_segment_pairs(50, 25, np.random.default_rng(1))
    assert idx.shape == (50, 2, 25) and mask.sum(-1).max() <= 8
    assert np.all(idx[:, 0, 0] != idx[:, 1, 0])


def test_adding_many_at_once_fills_the_buffer_as_adding_them_one_by_one():
    """PrefPPO copies a rollout into the replay buffer in one call: the same slots, contents, position and fullness as
    one add per transition, also when the rollout wraps past the end of the buffer."""
    rng = np.random.default_rng(0)
    one_by_one, at_once = ReplayBuffer(7, 3, 2, 4), ReplayBuffer(7, 3, 2, 4)
    for count in (3, 6, 2):  # the second wraps around, the third lands after it
        rows = (rng.normal(size=(count, 3)), rng.normal(size=(count, 3)), rng.normal(size=(count, 2)), rng.normal(size=count))
        rows += (rng.random(count) < 0.3, rng.integers(0, 9, count), rng.normal(size=(count, 4)))
        slots = [one_by_one.add(*(column[i] for column in rows)) for i in range(count)]
        np.testing.assert_array_equal(at_once.add_many(*rows), slots)
        for name, values in one_by_one.state_dict().items():
            np.testing.assert_array_equal(at_once.state_dict()[name], values, err_msg=name)
        assert (at_once.pos, at_once.full) == (one_by_one.pos, one_by_one.full)
