"""PEBBLE learning ratings with a set of cut points per feedback session: sac_rlhf.py exactly as it runs with
--rating-scale, except that the ordered logit places each rated clip against the cut points of the session it was
rated in, learned at --rating-cut-lr, and reward training stops once the model's returns order the rated pairs as the
ratings do (--reward-net-target-accuracy) rather than once it gives the clips their exact ratings.

A teacher who anchors the scale on the worst and best clip seen so far (the synthetic teacher, and people) rates the
same return lower once better clips have been shown, so no one set of cut points can hold every session's ratings:
bench/rating_fit.py measured it on the Ant raising a leg, where the ratings read this way taught the model more than the
same answers read as pairs or as the script reads them (docs/environments.md). A label's session is the feedback session
due at the step it was obtained (the synthetic teacher answers at once):

    python bench/session_rating_cuts.py --env-id Ant-v5 --rating-scale 10 --teacher-objective ant_raise_leg ...
    python bench/novel_behaviours.py --behaviour ant-raise-leg \\
        --preference-flags="--rating-scale 10 --rating-cut-lr 0.03 ..." ...   # --rating-cut-lr: runs this script

Runs are named session_rating_cuts (their exp_name)."""

import math
from dataclasses import dataclass

import numpy as np
import torch

import sac_rlhf
from cleanrlhf_utils.cli import cli
from cleanrlhf_utils.errors import check_ranges, need
from cleanrlhf_utils.rankings import clip_pairs
from cleanrlhf_utils.ratings import clip_ratings, rating_pair_labels


@dataclass
class Args(sac_rlhf.Args):
    exp_name: str = "session_rating_cuts"
    """the name of this experiment (part of the run name)"""
    rating_cut_lr: float = 0.03
    """the learning rate of each session's cut points (the reward network's is --reward-net-lr): the cuts have to move
    a return's width where the network's weights move a little"""


def ordered_cuts(parameters: torch.Tensor) -> torch.Tensor:
    """Increasing cut points of parameters (..., n - 1) as RewardEnsemble.rating_cuts makes them: the first cut and the
    softplus of the gaps."""
    first, gaps = parameters[..., :1], torch.nn.functional.softplus(parameters[..., 1:])
    return torch.cat([first, first + gaps.cumsum(-1)], dim=-1)


def starting_cut_parameters(ensemble_size: int, scale: int, sets: int) -> torch.Tensor:
    """`sets` copies of the cut points RewardEnsemble starts with (centred, a return apart): (E, sets, n - 1)."""
    first = torch.full((ensemble_size, sets, 1), -(scale - 2) / 2)
    gaps = torch.full((ensemble_size, sets, scale - 2), math.log(math.e - 1))  # softplus of it is 1
    return torch.cat([first, gaps], dim=-1)


def session_rating_loss(returns: torch.Tensor, labels: torch.Tensor, cuts: torch.Tensor) -> torch.Tensor:
    """The ordered logit's loss of ratings with each query's own cut points: returns (E, b, k), labels (E, b) as
    cleanrlhf_utils.ratings writes them, cuts (E, b, n - 1)."""
    flat = returns.shape[0] * returns.shape[1]
    rating = sac_rlhf.PREFERENCE_MODEL.rating_loss
    return rating(returns.reshape(flat, -1), labels.reshape(flat), cuts.reshape(flat, -1))


def ordered_pair_share(returns: np.ndarray, labels: np.ndarray, scale: int) -> float:
    """The share of the pairs of clips the ratings `labels` order (equal ratings left out) that `returns` (N, k) order
    the same way; NaN where no pair is ordered."""
    first, second = clip_pairs(returns.shape[1])
    ordered = rating_pair_labels(labels, returns.shape[1], scale)
    decided = ordered != 0.5
    if not decided.any():
        return float("nan")
    return float(((returns[:, second] > returns[:, first]) == (ordered > 0.5))[decided].mean())


class Optimizers:
    """Two optimisers stepped as one (reward_epoch zeroes and steps the one it is given): the network's, the cuts'."""

    def __init__(self, *optimizers):
        self.optimizers = optimizers

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad()

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()


class SessionRatingCuts:
    """The run's reward training (sac_rlhf.main's reward_training), holding one set of cut points per feedback session
    of the schedule and their optimiser, both checkpointed with the run."""

    def __init__(self, args: Args):
        budget = (args.teacher_feedback_total_queries, args.teacher_feedback_num_queries_per_session)
        kind = (args.teacher_feedback_schedule, args.teacher_feedback_exponential_decay)
        schedule = sac_rlhf.feedback_schedule(*budget, *kind)
        first = args.total_explore_steps if args.unsupervised_exploration else args.learning_starts
        self.session_starts = first + args.teacher_feedback_frequency * np.arange(max(len(schedule), 1))
        sets = len(self.session_starts)
        start = starting_cut_parameters(args.reward_ensemble_size, args.rating_scale, sets)
        self.cut_parameters = torch.nn.Parameter(start)
        self.cut_optimizer = torch.optim.Adam([self.cut_parameters], lr=args.rating_cut_lr)

    def sessions(self, prefs: sac_rlhf.PreferenceBuffer, indices: np.ndarray) -> np.ndarray:
        """The session (0 ..) each label at `indices` was rated in: the last one due at the step it was obtained."""
        due = np.searchsorted(self.session_starts, prefs.global_steps[indices], side="right") - 1
        return np.clip(due, 0, len(self.session_starts) - 1)

    def cuts(self, sessions: np.ndarray, device) -> torch.Tensor:
        """Each member's cut points for queries rated in `sessions` (b,): (E, b, n - 1)."""
        members = torch.arange(self.cut_parameters.shape[0])[:, None]
        return ordered_cuts(self.cut_parameters)[members, torch.as_tensor(sessions)].to(device)

    def rating_accuracy(self, model, prefs, indices, device, *_chunk) -> float:  # segment_returns chunks the queries
        """The share of the rated clips at `indices` whose most likely rating under the ensemble-mean ordered logit,
        with the cut points of the session each was rated in, is the one given (sac_rlhf.rating_accuracy's measure)."""
        indices = np.asarray(indices)
        if len(indices) == 0:
            return float("nan")
        segs = torch.as_tensor(prefs.obs_actions[indices], device=device)
        masks = torch.as_tensor(prefs.masks[indices], device=device, dtype=torch.float32)
        returns = sac_rlhf.segment_returns(model, segs, masks)  # (E, N, k)
        members, queries, clips = returns.shape
        with torch.no_grad():  # each (member, query) a row of its own, with its own cut points
            cuts = self.cuts(self.sessions(prefs, indices), device).reshape(members * queries, -1)
            rows = sac_rlhf.PREFERENCE_MODEL.rating_probabilities(returns.reshape(members * queries, clips), cuts)
        probabilities = rows.reshape(members, queries, clips, -1).mean(0)
        given = clip_ratings(prefs.labels[indices], prefs.clips, model.rating_scale)
        return float((probabilities.argmax(-1).cpu().numpy() == given).mean())

    def __call__(self, model, optimizer, prefs, rb, args, rng, device) -> dict:
        """Trains every epoch on every training label (sac_rlhf.reward_epoch, SURF as set) with each session's cut
        points, until the ensemble-mean returns order the rated pairs as --reward-net-target-accuracy asks or
        --reward-net-epochs have run. The stats add that last share (rated_pairs_ordered)."""
        train_idx = prefs.split(heldout=False)
        stats = {"train_loss": float("nan"), "ssl_loss": 0.0, "pseudo_labels": 0, "epochs": 0, "steps": 0}
        if len(train_idx) == 0:
            return stats
        if args.reward_net_normalize_inputs:  # as sac_rlhf.train_reward_model: the statistics of all data so far
            model.set_input_statistics(rb.obs_actions(slice(0, rb.size)))
        segments = torch.as_tensor(prefs.obs_actions[train_idx], device=device)
        masks = torch.as_tensor(prefs.masks[train_idx], device=device, dtype=torch.float32)
        given = torch.as_tensor(prefs.labels[train_idx], device=device)
        sessions = self.sessions(prefs, train_idx)

        def loss_of(returns: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
            """reward_epoch hands over each batch's query numbers in place of labels: their ratings and sessions."""
            queries = queries.long().cpu()
            return session_rating_loss(returns, given[queries.to(device)], self.cuts(sessions[queries.numpy()], device))

        both = Optimizers(optimizer, self.cut_optimizer)
        numbers = (segments, masks, torch.arange(len(train_idx), dtype=torch.float32, device=device))
        model.train()
        for epoch in range(args.reward_net_epochs):
            every = torch.arange(len(train_idx))
            epoch_stats = sac_rlhf.reward_epoch(model, both, numbers, every, rb, args, rng, device, loss_of)
            totals = {name: stats[name] + epoch_stats[name] for name in ("pseudo_labels", "steps")}
            stats |= epoch_stats | totals | {"epochs": epoch + 1}
            returns = sac_rlhf.segment_returns(model, segments, masks).mean(0).cpu().numpy()
            stats["rated_pairs_ordered"] = ordered_pair_share(returns, prefs.labels[train_idx], model.rating_scale)
            if stats["rated_pairs_ordered"] >= args.reward_net_target_accuracy:
                break
        model.train()
        return stats

    def state_dict(self) -> dict:
        cuts = self.cut_parameters.detach().clone()
        return {"cut_parameters": cuts, "cut_optimizer": self.cut_optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            self.cut_parameters.copy_(state["cut_parameters"])
        self.cut_optimizer.load_state_dict(state["cut_optimizer"])


def main(args: Args, on_evaluation=None) -> dict:
    check_ranges(args, {"rating_cut_lr": "> 0"})
    scale = args.rating_scale
    need(scale > 0, f"a set of cut points per session reads ratings: set --rating-scale N, got {scale}")
    training = SessionRatingCuts(args)
    sac_rlhf.rating_accuracy = training.rating_accuracy  # the run's rating accuracy reads each session's own cuts
    return sac_rlhf.main(args, on_evaluation, reward_training=training)


if __name__ == "__main__":
    cli(Args, main)
