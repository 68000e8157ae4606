"""One point of change for the preference model: each script's PREFERENCE_MODEL states the loss and the probability it
implies side by side, and every part of preference learning asks it at the call. A model assigned there reaches query
selection (disagreement, entropy), the accuracy that stops reward training, reward training itself, SURF's confidence
test and pseudo-label loss, RIME's selection and the mistake-aware loss, in both scripts."""

import numpy as np
import pytest
import torch

import pref_ppo
import sac_rlhf
from cleanrlhf_utils.buffers import ReplayBuffer

OBS_DIM, ACTION_DIM, SEG_LEN = 4, 2, 10
CPU = torch.device("cpu")


class Recording:
    """A preference model that answers as `model` does and notes which of its questions were asked."""

    def __init__(self, model):
        self.model, self.asked = model, set()

    def __getattr__(self, name):
        self.asked.add(name)
        return getattr(self.model, name)


class Hinge:
    """A hinge loss on the margin R1 - R0 (the example of docs/architecture.md), with Bradley-Terry's probability."""

    def __init__(self, model):
        self.model = model

    def probability(self, returns):
        return self.model.probability(returns)

    def log_probabilities(self, returns):
        return self.model.log_probabilities(returns)

    def loss(self, returns, labels):
        sign = 2 * labels - 1  # +1: segment 1 preferred, -1: segment 0, 0: a tie
        return torch.relu(1 - sign * (returns[..., 1] - returns[..., 0])).mean()

    def label_losses(self, probability, labels):
        return self.model.label_losses(probability, labels)


def filled_buffer(rng: np.random.Generator, n: int = 400) -> ReplayBuffer:
    rb = ReplayBuffer(n, OBS_DIM, ACTION_DIM, 1)
    for step in range(n):
        obs = rng.normal(size=OBS_DIM).astype(np.float32)
        rb.add(obs, obs, rng.uniform(-1, 1, ACTION_DIM), 0.0, False, step // 50, np.zeros(1))
    return rb


def labelled_pairs(algo, rb: ReplayBuffer, rng: np.random.Generator, count: int = 40):
    prefs = algo.PreferenceBuffer(SEG_LEN, OBS_DIM + ACTION_DIM, 1)
    idx, mask = rb.sample_segment_pairs(count, SEG_LEN, rng)
    segments = rb.gather_segments(idx, mask)
    labels = (segments["obs_actions"][..., 0].sum(-1) @ np.array([-1.0, 1.0]) > 0).astype(np.float32)
    arrays = (segments["obs_actions"], segments["masks"], segments["true_rewards"], segments["physics_states"])
    prefs.add(*arrays, labels, np.zeros(count, bool), 0)
    return prefs


def settings(algo, **overrides):
    values = {"segment_length": SEG_LEN, "max_augmentation_offset": 4, "min_augmentation_offset": 2}
    values |= {"reward_net_epochs": 2, "reward_net_batch_size": 16, "preference_sampling_pool_factor": 3}
    return algo.Args(**values | overrides)


@pytest.mark.parametrize("algo", [sac_rlhf, pref_ppo], ids=lambda module: module.__name__)
def test_a_model_assigned_to_preference_model_reaches_selection_training_surf_and_accuracy(algo, monkeypatch):
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    rb = filled_buffer(rng)
    prefs = labelled_pairs(algo, rb, rng)
    model = algo.RewardEnsemble(OBS_DIM + ACTION_DIM, 3, 16, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    bradley_terry = algo.PREFERENCE_MODEL
    for strategy in ("disagree", "entropy"):  # query selection, and SURF's unlabelled pairs drawn the same way
        recording = Recording(bradley_terry)
        monkeypatch.setattr(algo, "PREFERENCE_MODEL", recording)
        algo.select_queries(strategy, model, rb, 5, SEG_LEN, 3, rng, CPU)
        assert recording.asked == {"probability"}, strategy
    recording = Recording(bradley_terry)
    monkeypatch.setattr(algo, "PREFERENCE_MODEL", recording)
    algo.surf_loss(model, rb, 20, settings(algo, surf_tau=0.5000001), rng, CPU)  # every pair confident
    assert recording.asked == {"probability", "loss"}, "SURF's confidence test and its pseudo-label loss"
    recording.asked.clear()
    algo.train_reward_model(model, optimizer, prefs, rb, settings(algo, surf=False), rng, CPU)
    assert recording.asked == {"loss", "probability"}, "the labelled pairs' loss and the accuracy that stops training"


@pytest.mark.parametrize("algo", [sac_rlhf, pref_ppo], ids=lambda module: module.__name__)
def test_a_hinge_loss_assigned_there_changes_what_reward_training_learns(algo, monkeypatch):
    def trained(preference_model) -> list[torch.Tensor]:
        monkeypatch.setattr(algo, "PREFERENCE_MODEL", preference_model)
        rng = np.random.default_rng(0)
        torch.manual_seed(0)
        rb = filled_buffer(rng)
        prefs = labelled_pairs(algo, rb, rng)
        model = algo.RewardEnsemble(OBS_DIM + ACTION_DIM, 3, 16, 1)
        algo.train_reward_model(model, torch.optim.Adam(model.parameters()), prefs, rb, settings(algo), rng, CPU)
        return [parameter.detach().clone() for parameter in model.parameters()]

    bradley_terry = algo.PREFERENCE_MODEL
    plain, again = trained(bradley_terry), trained(Recording(bradley_terry))
    assert all(torch.equal(a, b) for a, b in zip(plain, again, strict=True))  # the same model, the same numbers
    hinge = trained(Hinge(bradley_terry))
    assert not all(torch.equal(a, b) for a, b in zip(plain, hinge, strict=True))


def test_rime_and_the_mistake_aware_loss_ask_the_model_assigned_there(monkeypatch):
    import sac_rlhf_mistake_aware
    import sac_rlhf_rime

    recording = Recording(sac_rlhf.PREFERENCE_MODEL)
    monkeypatch.setattr(sac_rlhf, "PREFERENCE_MODEL", recording)
    sac_rlhf_rime.RimeTraining(sac_rlhf_rime.Args()).select(torch.tensor([0.9, 0.2, 0.6]), torch.tensor([1.0, 1.0, 0.0]))
    assert recording.asked == {"label_losses"}, "RIME's selection"
    returns, labels = torch.randn(3, 8, 2), torch.ones(3, 8)
    recording.asked.clear()
    sac_rlhf_mistake_aware.mistake_aware_loss(returns, labels, 0.1)
    assert recording.asked == {"log_probabilities"}
    recording.asked.clear()
    sac_rlhf_mistake_aware.mistake_aware_loss(returns, labels, 0.0)  # no mistakes: the model's own loss
    assert recording.asked == {"loss"}
