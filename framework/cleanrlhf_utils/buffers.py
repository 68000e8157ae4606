"""The replay buffer: every transition of a run with the simulator state behind it, so that any stretch of it
can be cut out as a segment, shown to a person, relabelled by the reward model and checkpointed exactly."""

import os
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .errors import ConfigError, unreadable


def check_capacity(transitions: int, capacity: int) -> None:
    """A saved replay buffer of `transitions` fits a run whose buffer holds `capacity`, or one line says why not."""
    if transitions > capacity:
        raise ConfigError(
            f"the saved replay buffer holds {transitions} transitions, more than this run's capacity {capacity} "
            "(--buffer-size / --total-timesteps)"
        )


def check_saved_buffer(path: str | Path, capacity: int) -> None:
    """Before a run writes anything: the replay buffer it is to load (--resume, --exploration-from) is readable and
    fits its capacity; one line naming the file or the sizes where not."""
    try:
        with np.load(path) as data:
            transitions = len(data["obs"])
    except (EOFError, OSError, ValueError, KeyError, zipfile.BadZipFile) as error:
        raise unreadable(Path(path), error) from None
    check_capacity(transitions, capacity)


class ReplayBuffer:
    """Circular buffer of transitions. `episode_ids` lets segments stay inside one episode."""

    FIELDS = ("obs", "next_obs", "actions", "true_rewards", "learned_rewards", "reward_std", "terminated", "episode_ids", "physics_states")

    def __init__(self, capacity: int, obs_dim: int, action_dim: int, state_dim: int):
        self.capacity = capacity
        self.obs = np.zeros((capacity, obs_dim), dtype=np.float32)
        self.next_obs = np.zeros((capacity, obs_dim), dtype=np.float32)
        self.actions = np.zeros((capacity, action_dim), dtype=np.float32)
        self.true_rewards = np.zeros(capacity, dtype=np.float32)
        self.learned_rewards = np.zeros(capacity, dtype=np.float32)  # ensemble mean
        self.reward_std = np.zeros(capacity, dtype=np.float32)  # ensemble std, RUNE's bonus
        self.terminated = np.zeros(capacity, dtype=np.float32)  # truncation is not terminal
        self.episode_ids = np.full(capacity, -1, dtype=np.int64)
        self.physics_states = np.zeros((capacity, state_dim), dtype=np.float64)  # state behind `obs`
        self.pos = 0
        self.full = False

    @property
    def size(self) -> int:
        return self.capacity if self.full else self.pos

    def add(self, obs, next_obs, action, true_reward, terminated, episode_id, physics_state) -> int:
        i = self.pos
        self.obs[i], self.next_obs[i], self.actions[i] = obs, next_obs, action
        self.true_rewards[i], self.terminated[i] = true_reward, terminated
        self.learned_rewards[i] = self.reward_std[i] = 0.0
        self.episode_ids[i], self.physics_states[i] = episode_id, physics_state
        self.pos = (self.pos + 1) % self.capacity
        self.full = self.full or self.pos == 0
        return i

    def add_many(self, obs, next_obs, actions, true_rewards, terminated, episode_ids, physics_states) -> np.ndarray:
        """`add` for N transitions at once (arrays with N rows), in their order; returns their slots."""
        slots = (self.pos + np.arange(len(obs))) % self.capacity
        self.obs[slots], self.next_obs[slots], self.actions[slots] = obs, next_obs, actions
        self.true_rewards[slots], self.terminated[slots] = true_rewards, terminated
        self.learned_rewards[slots] = self.reward_std[slots] = 0.0
        self.episode_ids[slots], self.physics_states[slots] = episode_ids, physics_states
        self.full = self.full or self.pos + len(obs) >= self.capacity
        self.pos = int((self.pos + len(obs)) % self.capacity)
        return slots

    def sample_indices(
        self, batch_size: int, rng: np.random.Generator, recent: np.ndarray | None = None, recent_share: float = 0.0
    ) -> np.ndarray:
        """Uniform slots; with `recent` (slots, e.g. recent_episode_slots), exactly round(recent_share x batch_size)
        of them are drawn from those slots first (QPA's hybrid experience replay)."""
        if recent is None or recent_share == 0 or len(recent) == 0:
            return rng.integers(0, self.size, size=batch_size)
        on_policy = round(recent_share * batch_size)
        return np.concatenate(
            [recent[rng.integers(0, len(recent), size=on_policy)], rng.integers(0, self.size, size=batch_size - on_policy)]
        )

    def recent_episode_slots(self, episodes: int) -> np.ndarray:
        """Slots of the `episodes` most recently started episodes (ids grow as episodes start, across envs too)."""
        ids = self.episode_ids[: self.size]
        return np.flatnonzero(ids > ids.max() - episodes)

    def obs_actions(self, idx: np.ndarray) -> np.ndarray:
        return np.concatenate([self.obs[idx], self.actions[idx]], axis=-1)

    def segment_indices(self, starts: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Indices (.., length) of segments starting at `starts` and the mask of steps that belong to the
        start's episode. A segment cut short by the end of its episode keeps its valid prefix; the rest is
        masked out (an absorbing state with no reward), and never crosses into another episode."""
        idx = (starts[..., None] + np.arange(length)) % self.capacity
        mask = self.episode_ids[idx] == self.episode_ids[starts][..., None]
        mask &= np.cumprod(mask, axis=-1).astype(bool)  # stop at the first step of another episode
        oldest = self.pos if self.full else 0  # never run past the newest transition (into the oldest)
        mask &= ((starts[..., None] - oldest) % self.capacity + np.arange(length)) < self.size
        return idx, mask

    def sample_segment_pairs(
        self, num_pairs: int, length: int, rng: np.random.Generator, recent_episodes: int = 0, whole: bool = True
    ) -> tuple[np.ndarray, np.ndarray]:
        """Indices (num_pairs, 2, length) of two distinct random segments, with their masks (sample_segment_sets)."""
        return self.sample_segment_sets(num_pairs, 2, length, rng, recent_episodes, whole)

    def sample_segment_sets(
        self, count: int, clips: int, length: int, rng: np.random.Generator, recent_episodes: int = 0, whole: bool = True
    ) -> tuple[np.ndarray, np.ndarray]:
        """Indices (count, clips, length) of `clips` distinct random segments each, with their masks; with
        recent_episodes, the segments start in the most recent episodes only (QPA's policy-aligned queries).

        With `whole`, a segment is drawn again (up to WHOLE_SEGMENT_DRAWS times, uniformly among the good starts) when
        it would be cut by anything but a termination: a time limit or the newest transition says nothing about the
        behaviour, yet the cut segment sums fewer rewards and loses the comparison (93 % of such pairs on walker-walk's
        random data, 9 % of all pairs), so its label would teach length. A termination inside the segment is kept: it
        is an outcome (the hopper fell). Segments of episodes shorter than `length` stay cut after the last draw."""
        slots = self.recent_episode_slots(recent_episodes) if recent_episodes else np.arange(self.size)
        starts = slots[rng.integers(0, len(slots), size=(count, clips))]
        for _ in range(self.WHOLE_SEGMENT_DRAWS if whole else 0):
            redraw = ~self.whole_segments(starts, length)
            redraw |= np.tril(starts[:, :, None] == starts[:, None, :], -1).any(-1)  # a start an earlier clip has
            if not redraw.any():
                break
            starts[redraw] = slots[rng.integers(0, len(slots), size=int(redraw.sum()))]
        for clip in range(1, clips):  # distinct segments, whatever the draws gave (a buffer of too few slots aside)
            clash = (starts[:, clip, None] == starts[:, :clip]).any(-1)
            while clash.any():
                picks = np.searchsorted(slots, starts[clash, clip])
                moved = (picks + 1 + rng.integers(0, max(len(slots) - 1, 1), size=clash.sum())) % len(slots)
                starts[clash, clip] = slots[moved]
                if len(slots) <= clip:  # no slot left that differs from every earlier clip's
                    break
                clash = (starts[:, clip, None] == starts[:, :clip]).any(-1)
        return self.segment_indices(starts, length)

    WHOLE_SEGMENT_DRAWS = 10

    def whole_segments(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Whether each segment starting at `starts` runs its full length or ends on a terminal transition."""
        idx, mask = self.segment_indices(starts, length)
        last = np.take_along_axis(idx, mask.sum(-1, keepdims=True) - 1, axis=-1)[..., 0]
        return mask[..., -1] | (self.terminated[last] == 1)

    def gather_segments(self, idx: np.ndarray, mask: np.ndarray) -> dict:
        """Copies of the segments at indices idx (..., L) with their masks (...): what a teacher is shown and a
        preference buffer keeps, never indices into this buffer, which moves on."""
        return {
            "segment_ids": idx[..., 0],
            "obs_actions": self.obs_actions(idx),
            "masks": mask,
            "true_rewards": self.true_rewards[idx] * mask,
            "physics_states": self.physics_states[idx],
        }

    def state_dict(self) -> dict:
        n = self.size
        arrays = {name: getattr(self, name)[:n] for name in self.FIELDS}
        return {**arrays, "pos": np.array(self.pos), "full": np.array(self.full), "capacity": np.array(self.capacity)}

    def load_state_dict(self, state) -> None:
        n, pos, full = len(state["obs"]), int(state["pos"]), bool(state["full"])
        check_capacity(n, self.capacity)
        same_layout = int(state["capacity"]) == self.capacity
        for name in self.FIELDS:
            values = np.asarray(state[name])
            # A wrapped buffer of another capacity is unrolled oldest-first.
            getattr(self, name)[:n] = values if same_layout or not full else np.roll(values, -pos, axis=0)
        self.pos, self.full = (pos, full) if same_layout else (n % self.capacity, n == self.capacity)

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, **self.state_dict())
        os.replace(tmp, path)

    def load(self, path: str | Path) -> None:
        try:
            with np.load(path) as data:
                self.load_state_dict(data)
        except (EOFError, OSError, ValueError, KeyError, zipfile.BadZipFile) as error:
            raise unreadable(Path(path), error) from None


class PendingRewards:
    """The learned reward (and RUNE's std) of new transitions, predicted in batches rather than with one ensemble
    call per environment step: new rows wait until a sampled batch reaches one of them (or a checkpoint is
    written), then all of them are predicted at once. The ensemble always sees whole aligned blocks of `block`
    rows because a matmul's last bits depend on how many rows it multiplies: a row's reward is then the same
    whenever it is filled, and a run resumed from a checkpoint (which fills every row) continues exactly."""

    def __init__(self, block: int = 16):
        self.block, self.count = block, 0  # count: the newest rows of the replay buffer without a learned reward yet

    def add(self, rb: ReplayBuffer) -> None:
        self.count = min(self.count + 1, rb.capacity)

    def clear(self) -> None:
        """After relabel_replay_buffer: every row has its reward."""
        self.count = 0

    def waiting_rows(self, rb: ReplayBuffer) -> np.ndarray:
        """The replay buffer's slots still without a learned reward: the newest `count`, oldest first."""
        return (rb.pos - self.count + np.arange(self.count)) % rb.capacity

    def fill_if_sampled(self, predict: Callable, rb: ReplayBuffer, idx: np.ndarray) -> None:
        if self.count and ((idx - (rb.pos - self.count)) % rb.capacity < self.count).any():
            self.fill(predict, rb)

    def fill(self, predict: Callable, rb: ReplayBuffer) -> None:
        """predict(obs_actions (N, D) array) -> (mean, std) of the learned reward, arrays (N,)."""
        rows = self.waiting_rows(rb)
        for start in np.unique(rows // self.block) * self.block:
            block = (start + np.arange(self.block)) % rb.capacity  # always `block` rows, also where the buffer wraps
            mean, std = predict(rb.obs_actions(block))
            new = np.isin(block, rows)  # rows relabelled after the last session keep that value
            rb.learned_rewards[block[new]], rb.reward_std[block[new]] = mean[new], std[new]
        self.count = 0
