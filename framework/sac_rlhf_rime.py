# RIME (Cheng et al. 2024, https://arxiv.org/abs/2402.17257): PEBBLE for a teacher who gets labels wrong.
#
# The difference from PEBBLE (sac_rlhf.py) is how the reward model learns at each feedback session: `RimeTraining`
# replaces `train_reward_model`. Every epoch it splits the labels by their loss under the ensemble-mean preference:
#   - below the trust threshold -ln(rho) + alpha rho + min(beta_t s, 3): trained as given (RIME bounds a wrong label's
#     loss from below by -ln(rho) + rho / 2, rho the largest loss of a right one);
#   - above -ln(tau) (the ensemble gives the label a probability below tau): trained flipped;
#   - in between: left out of this epoch.
# rho and s are running estimates (rate 0.1) of the maximum and the std of the trusted labels' loss, and beta_t falls
# linearly over the epochs, so that the threshold is lenient while the model is young. Optionally (RIME's warm start)
# the model first fits PEBBLE's k-NN state-entropy reward of the replay buffer, so that the first selection meets a
# model shaped by the data rather than a random one. Everything else is PEBBLE's, run by sac_rlhf.main.
#
#   python framework/sac_rlhf_rime.py --env-id Hopper-v5 --teacher-eps-mistake 0.2
import math
from dataclasses import dataclass
from typing import ClassVar

from cleanrlhf_utils.arguments import refuse_unknown_flags

if __name__ == "__main__":
    refuse_unknown_flags(__file__)  # a mistyped flag: one line at once, not after the seconds torch takes to import

import numpy as np
import torch
import torch.nn.functional as F

import sac_rlhf
from cleanrlhf_utils.cli import cli
from cleanrlhf_utils.errors import check_ranges, need
from cleanrlhf_utils.objectives import load_objective, segment_rewards
from sac_rlhf import PreferenceBuffer, RewardEnsemble, knn_state_entropy, preference_probabilities, reward_epoch


@dataclass
class RimeArgs:
    """RIME's settings (its paper's values for DMC are the defaults, but for the warm start)."""

    help_group: ClassVar[str] = "RIME"

    rime_alpha: float = 0.5
    """alpha of the trust threshold -ln(rho) + alpha rho + min(beta_t s, 3)"""
    rime_beta_max: float = 3.0
    """beta_t at the first epoch, falling linearly to --rime-beta-min over --rime-beta-decay-epochs"""
    rime_beta_min: float = 1.0
    """beta_t once --rime-beta-decay-epochs reward-model epochs (all sessions together) have trained"""
    rime_beta_decay_epochs: int = 60
    """reward-model epochs over which beta_t falls"""
    rime_flip_tau: float = 0.001
    """a label trains flipped when the ensemble gives it a probability below this"""
    rime_warm_start_steps: int = 0
    """Adam steps fitting the k-NN state-entropy reward before the first labels (RIME: 1000; on walker-walk it hurt)"""


@dataclass
class Args(RimeArgs, sac_rlhf.Args):
    """PEBBLE's settings and RIME's."""

    exp_name: str = "sac_rlhf_rime"
    """the name of this experiment (part of the run name)"""


def validate_rime_args(args: RimeArgs) -> None:
    check_ranges(args, {"rime_alpha": ">= 0", "rime_beta_min": ">= 0", "rime_beta_decay_epochs": ">= 1"})
    check_ranges(args, {"rime_flip_tau": "in (0, 0.5)", "rime_warm_start_steps": ">= 0"})
    need(
        args.rime_beta_min <= args.rime_beta_max,
        f"--rime-beta-min ({args.rime_beta_min}) must be <= --rime-beta-max ({args.rime_beta_max})",
    )


def need_pairs(args: Args) -> None:
    """RIME flips a label it distrusts: the other of a pair's two."""
    clips = args.clips_per_query
    need(clips == 2, f"RIME splits and flips pairs' labels: --clips-per-query must be 2, got {clips}")
    scale = args.rating_scale
    need(scale == 0, f"RIME splits and flips pairs' labels: ratings are not learned here, got --rating-scale {scale}")


def validate_args(args: Args) -> None:
    """PEBBLE's settings and RIME's (what a sweep checks before its trials)."""
    sac_rlhf.validate_args(args)
    validate_rime_args(args)
    need_pairs(args)


def teacher_mistakes(prefs: PreferenceBuffer, indices: np.ndarray, objective, obs_dim: int) -> np.ndarray:
    """Which labels at `indices` contradict the reward the teacher judges by (the env's, or --teacher-objective's): a
    decided label for the segment with the lower return; ties are no mistake. What the selection is measured against:
    with the synthetic teacher, exactly its noise."""
    pairs = {name: getattr(prefs, name)[indices] for name in ("obs_actions", "physics_states", "masks")}
    rewards = prefs.true_rewards[indices] if objective is None else segment_rewards(objective, pairs, obs_dim)
    returns = (rewards * pairs["masks"]).sum(-1)
    return np.sign(prefs.labels[indices] - 0.5) * np.sign(returns[:, 1] - returns[:, 0]) < 0


class RimeTraining:
    """sac_rlhf.main's reward training with RIME's label selection, and the state it carries across epochs and
    sessions (checkpointed with the run)."""

    RATE = 0.1  # of the running estimates, as RIME's
    UNCERTAINTY_CAP = 3.0  # of beta_t s, as RIME's code

    def __init__(self, settings: RimeArgs):
        self.settings = settings
        self.loss_max, self.loss_std, self.epochs, self.warm_started = 0.0, 0.0, 0, False  # rho = 0: trust all at first

    def thresholds(self) -> tuple[float, float]:
        """(trust below, flip above) for the next selection."""
        settings = self.settings
        progress = min(1.0, self.epochs / settings.rime_beta_decay_epochs)
        beta = settings.rime_beta_max + (settings.rime_beta_min - settings.rime_beta_max) * progress
        uncertainty = min(beta * self.loss_std, self.UNCERTAINTY_CAP)
        trust_below = -math.log(self.loss_max + 1e-8) + settings.rime_alpha * self.loss_max + uncertainty
        return trust_below, -math.log(settings.rime_flip_tau)

    def select(self, probabilities: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Masks (trusted, flipped) of the labels (N,) given the ensemble-mean P(segment 1 > segment 0) of their pairs,
        by each label's loss under the preference model (sac_rlhf.PREFERENCE_MODEL); updates the running estimates
        with the trusted labels' losses and counts the epoch."""
        losses = sac_rlhf.PREFERENCE_MODEL.label_losses(probabilities, labels)
        trust_below, flip_above = self.thresholds()
        flipped = losses > flip_above
        trusted = (losses < trust_below) & ~flipped
        if trusted.any():
            kept = losses[trusted]
            self.loss_max += self.RATE * (float(kept.max()) - self.loss_max)
            self.loss_std += self.RATE * (float(kept.std(unbiased=False)) - self.loss_std)
        self.epochs += 1
        return trusted, flipped

    def warm_start(self, model: RewardEnsemble, optimizer, rb, args, rng, device, batch_size: int = 256) -> float:
        """Every member fits (mean squared error) the k-NN state entropy of the state each of up to 10,000 buffer
        transitions reaches (PEBBLE's exploration reward), standardised and scaled into the model's range [-1, 1].
        Returns the last loss."""
        if self.settings.rime_warm_start_steps == 0 or rb.size < 2:
            return float("nan")
        rows = rb.sample_indices(min(rb.size, 10_000), rng)
        sample = rb.sample_indices(min(args.explore_knn_sample_size, rb.size), rng)
        reference = torch.as_tensor(rb.next_obs[sample], device=device)
        states, k = torch.as_tensor(rb.next_obs[rows], device=device), min(args.explore_knn_k, len(reference))
        entropy = torch.cat([knn_state_entropy(chunk, reference, k) for chunk in states.split(4096)])
        target = (entropy - entropy.mean()) / entropy.std().clamp_min(1e-8)
        target = target / target.abs().max().clamp_min(1e-8)
        inputs, ensemble = torch.as_tensor(rb.obs_actions(rows), device=device), model.ensemble_size
        model.train()
        for _ in range(self.settings.rime_warm_start_steps):
            batch = torch.as_tensor(rng.integers(0, len(rows), (ensemble, batch_size)), device=device)  # one a member
            loss = F.mse_loss(model.forward_members(inputs[batch]), target[batch]) * ensemble  # sum over members
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return loss.item() / ensemble

    def __call__(self, model: RewardEnsemble, optimizer, prefs: PreferenceBuffer, rb, args, rng, device) -> dict:
        """Trains every epoch on the labels the selection trusts (as given) or flips; stops once the model agrees with
        those labels as they trained. The stats give the last selection's shares (labels_trusted, _flipped, _dropped)
        and how many of each the teacher got wrong (labels_trusted_wrong, ...; labels_wrong over all)."""
        train_idx = prefs.split(heldout=False)
        stats = {"train_loss": float("nan"), "ssl_loss": 0.0, "pseudo_labels": 0, "epochs": 0, "steps": 0}
        if len(train_idx) == 0:
            return stats
        if args.reward_net_normalize_inputs:
            model.set_input_statistics(rb.obs_actions(slice(0, rb.size)))
        segments = torch.as_tensor(prefs.obs_actions[train_idx], device=device)
        masks = torch.as_tensor(prefs.masks[train_idx], device=device, dtype=torch.float32)
        given = torch.as_tensor(prefs.labels[train_idx], device=device)
        mistakes = teacher_mistakes(prefs, train_idx, load_objective(args.teacher_objective), rb.obs.shape[-1])
        mistakes = torch.as_tensor(mistakes, device=device)
        stats["labels_wrong"] = float(mistakes.float().mean())
        if not self.warm_started:
            stats["warm_start_loss"] = self.warm_start(model, optimizer, rb, args, rng, device)
            self.warm_started = True
        model.train()
        probabilities = preference_probabilities(model, segments, masks).mean(0)
        for epoch in range(args.reward_net_epochs):
            trusted, flipped = self.select(probabilities, given)
            labels = torch.where(flipped, 1 - given, given)
            active = torch.nonzero(trusted | flipped).flatten().cpu()
            shares = {"trusted": trusted, "flipped": flipped, "dropped": ~(trusted | flipped)}
            stats |= {f"labels_{name}": float(mask.float().mean()) for name, mask in shares.items()}
            # how many of each the teacher got wrong (NaN for none): a flip should fix a mistake, a trust keep a truth
            stats |= {f"labels_{name}_wrong": float(mistakes[mask].float().mean()) for name, mask in shares.items()}
            if len(active) == 0:
                break
            epoch_stats = reward_epoch(model, optimizer, (segments, masks, labels), active, rb, args, rng, device)
            totals = {name: stats[name] + epoch_stats[name] for name in ("pseudo_labels", "steps")}
            stats |= epoch_stats | totals | {"epochs": epoch + 1}
            # stop on the labels the epoch trained on, as it trained on them; the probabilities select the next epoch's
            probabilities = preference_probabilities(model, segments, masks).mean(0)
            decided = active[(given[active] != 0.5).cpu()]
            agree = (probabilities[decided] > 0.5) == (labels[decided] > 0.5)
            if len(decided) and float(agree.float().mean()) >= args.reward_net_target_accuracy:
                break
        model.train()
        return stats

    def state_dict(self) -> dict:
        state = {"loss_max": self.loss_max, "loss_std": self.loss_std, "epochs": self.epochs}
        return state | {"warm_started": self.warm_started}

    def load_state_dict(self, state: dict) -> None:
        self.loss_max, self.loss_std = float(state["loss_max"]), float(state["loss_std"])
        self.epochs = int(state["epochs"])
        self.warm_started = bool(state["warm_started"])


def main(args: Args, on_evaluation=None) -> dict:
    validate_rime_args(args)
    need_pairs(args)
    return sac_rlhf.main(args, on_evaluation, reward_training=RimeTraining(args))


if __name__ == "__main__":
    cli(Args, main)
