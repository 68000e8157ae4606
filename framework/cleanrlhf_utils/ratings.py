"""Ratings: each clip of a query placed on a scale of 1 to n (--rating-scale n), and how they are written as a label.

A rating query shows k clips (--clips-per-query, 2 to rankings.MAX_CLIPS) and the person rates every one of them, 1
the worst and n the best, as rating-based RL (White et al. 2024) asks of single clips; showing k at once lets the
person place them against each other. The label is one number, as a ranking's is: the clips' ratings less one, read
as the digits of a base-n number with clip 0 the lowest digit, sum_i (rating_i - 1) n^i. Every label store keeps one
float per query (the preference buffer, labels.sqlite, corrections, file mode), exact for every scale and k here
(10^6 < 2^24), with nan = skipped."""

import numpy as np

from .rankings import clip_pairs

MAX_SCALE = 10
"""the longest scale a clip is rated on"""
RATING_SCALE_RANGE = f"0 (queries compared or ranked) or in [2, {MAX_SCALE}]"
"""--rating-scale: 0, or the points of the scale"""


def rating_labels(ratings: np.ndarray, scale: int) -> np.ndarray:
    """The labels of ratings (N, k), each in 0 .. scale - 1 (a person's rating less one): (N,) floats."""
    digits = scale ** np.arange(ratings.shape[-1], dtype=np.int64)
    return (ratings.astype(np.int64) @ digits).astype(np.float32)


def clip_ratings(labels: np.ndarray, clips: int, scale: int) -> np.ndarray:
    """Each clip's rating less one (0 .. scale - 1) of labels (N,): (N, k) integers (rating_labels' inverse)."""
    digits = scale ** np.arange(clips, dtype=np.int64)
    return (np.asarray(labels, dtype=np.int64)[:, None] // digits) % scale


def rating_pair_labels(labels: np.ndarray, clips: int, scale: int) -> np.ndarray:
    """What the ratings `labels` (N,) say of each pair of clips (i, j) in rankings.clip_pairs order: 1 when clip j is
    rated above clip i, 0 below, 0.5 the same (N, k (k - 1) / 2)."""
    first, second = clip_pairs(clips)
    rated = clip_ratings(labels, clips, scale)
    return (np.sign(rated[:, second] - rated[:, first]) / 2 + 0.5).astype(np.float32)


def ratings_problem(ratings, clips: int, scale: int) -> str | None:
    """Why `ratings` (a person's answer, parsed from JSON) are not ratings of `clips` clips on the scale 1 .. `scale`,
    or None when they are: a list of one integer per clip, in the order the clips are shown."""
    if not isinstance(ratings, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in ratings):
        return f"ratings are a list of integers, one per clip, got {str(ratings)[:60]}"
    if len(ratings) != clips:
        return f"{len(ratings)} ratings given; rate each of the {clips} clips once, in the order shown"
    off = sorted({rating for rating in ratings if not 1 <= rating <= scale})
    if off:
        return f"ratings {off} are off the scale; rate each clip from 1 (worst) to {scale} (best)"
    return None
