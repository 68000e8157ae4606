"""Rankings of k clips, and how one is written as a label.

A query shows k clips (--clips-per-query: 2 is a pair, 3 to 6 a ranking). A ranking is an order of the query's clips,
best first, and its label is one number: the order's index among the k! orders of range(k) in lexicographic order
(itertools.permutations). For k = 2 the orders are (0, 1) and (1, 0), so label 0 = segment 0 preferred and 1 =
segment 1: a pair's label, whose 0.5 is a tie (both orders equally likely). A ranking of more than two clips is strict.
One float per query keeps every label store as it is (the preference buffer, labels.sqlite, corrections, file mode),
with nan = skipped; the stored segments' shape (k, L, ...) says how many clips a label orders."""

import collections
import functools
import itertools
import math

import numpy as np

MAX_CLIPS = 6
"""clips a query may show at most: six to rank have 720 orders"""
CLIPS_PER_QUERY_RANGE = f"in [2, {MAX_CLIPS}]"
"""clips a query may show: a pair, up to MAX_CLIPS to rank"""


@functools.cache
def orders(clips: int) -> np.ndarray:
    """The k! orders of k clips, best first, in label order: (k!, k)."""
    return np.array(list(itertools.permutations(range(clips))), dtype=np.int64)


@functools.cache
def clip_pairs(clips: int) -> tuple[np.ndarray, np.ndarray]:
    """The k (k - 1) / 2 pairs (i, j), i < j, of a query's clips in itertools.combinations order: (first, second)."""
    first, second = np.array(list(itertools.combinations(range(clips), 2)), dtype=np.int64).T
    return first, second


def order_labels(ranked: np.ndarray) -> np.ndarray:
    """The labels of orders `ranked` (N, k), best first: each one's lexicographic index among the k! orders (its
    Lehmer code: at each place, how many of the later clips have a lower number, weighed by the factorial of the places
    left)."""
    clips = ranked.shape[-1]
    later_lower = np.triu(ranked[..., None, :] < ranked[..., :, None], 1).sum(-1)  # (N, k)
    return later_lower @ np.array([math.factorial(clips - 1 - place) for place in range(clips)])


def places(labels: np.ndarray, clips: int) -> np.ndarray:
    """Each clip's place in the rankings `labels` (N,), 0 = best: (N, k)."""
    return np.argsort(orders(clips)[labels.astype(np.int64)], axis=-1)


def pair_labels(labels: np.ndarray, clips: int) -> np.ndarray:
    """The label of each pair of clips (i, j) within the rankings `labels` (N,), in clip_pairs order: 1 when clip j
    is ranked above clip i, else 0 (N, k (k - 1) / 2). A pair's label is its own (N,), a tie's 0.5 included."""
    if clips == 2:
        return labels
    first, second = clip_pairs(clips)
    ranked = places(labels, clips)
    return (ranked[:, second] < ranked[:, first]).astype(np.float32)


def order_problem(order, clips: int) -> str | None:
    """Why `order` (a person's answer, parsed from JSON) is not a ranking of `clips` clips, or None when it is one: a list
    holding each clip position 0 .. clips - 1 exactly once, best first."""
    if not isinstance(order, list) or not all(isinstance(place, int) and not isinstance(place, bool) for place in order):
        return f"a ranking is a list of clip positions (integers), got {str(order)[:60]}"
    outside = sorted({place for place in order if not 0 <= place < clips})
    if outside:
        return f"positions {outside} are not clips of this query; its {clips} clips are 0 to {clips - 1}"
    repeated = sorted(place for place, count in collections.Counter(order).items() if count > 1)
    if repeated:
        return f"clips {repeated} appear more than once; name each of the {clips} clips once"
    missing = sorted(set(range(clips)) - set(order))
    if missing:
        return f"clips {missing} are missing; name each of the {clips} clips once, best first"
    return None
