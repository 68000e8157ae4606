"""How well PEBBLE's reward model learns a rating run's labels, against the same labels read as the pairs they imply.
Per run (sac_rlhf.py with --rating-scale and a --teacher-objective), from its labels.sqlite (nothing is relabelled):
the reward model the run's settings describe is fitted by sac_rlhf.train_reward_model to the queries of its first
--train-sessions sessions, then measured on the clips of the next --test-sessions sessions against the objective:

- `ratings`: the ratings themselves, by the ordered logit with the cut points the script starts with (a return apart);
- `ratings_gap_G`: the same, with the cut points started G returns apart (--cut-gaps; `span`: evenly over the middle
  half of the returns the model can give, segment_length apart end to end);
- `ratings_fast_cuts`: the ratings by the ordered logit on one set of cut points (started as the script's) learned at
  --cut-lr, training stopped on the pairs the ratings order rather than on exact ratings;
- `ratings_session_cuts`: the same with each session's own cut points: a teacher who anchors the scale on the best and
  worst clip seen so far (the synthetic teacher, and people) moves a rating's returns from session to session;
- `pairs`: the pairs of clips the ratings order (cleanrlhf_utils.ratings.rating_pair_labels, equal ratings a tie),
  learned by Bradley-Terry as a pair run learns its labels: the baseline, from the same answers.

Columns: `train_accuracy` (what the fit's training stops on: for `ratings` and `ratings_gap_G` the share of rated
clips whose most likely rating is the one given; for the others the pairs ordered as labelled), `segment_correlation` (the model's return of each test clip against the objective's) and
`pair_accuracy` (the test queries' clips ordered as the objective orders them, its ties left out). SURF is off in every
fit (its pseudo-labels draw from the run's replay buffer, which the labels file does not hold); a fit's torch seed is
--seed, so a rerun gives the same numbers.

How far the ratings can be one scale: per run, the most of the fitted clips any one increasing map from the
objective's return to a rating rates as the teacher did (`one_scale`), and the same with a map per session
(`session_scales`).

    python bench/rating_fit.py --workdir bench/workdir/novel_behaviours --runs <run> <run> <run> --train-sessions 8 \\
        --test-sessions 2 --cut-gaps span --cut-lr 0.03 --output bench/results/rating_fit/objectives/ant-raise-leg-rating-fit.json

docs/environments.md has what it showed for the Ant raising a leg."""

import argparse
import concurrent.futures
import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import torch
from common import (
    REPO,
    correlation,
    label_column,
    machine_info,
    objective_run_labels,
    print_table,
    results_path,
    spread,
    write_json,
)
from session_rating_cuts import ordered_cuts, ordered_pair_share, session_rating_loss

import sac_rlhf
from cleanrlhf_utils.rankings import clip_pairs
from cleanrlhf_utils.ratings import clip_ratings, rating_pair_labels

SCALE_FITS = ("ratings_fast_cuts", "ratings_session_cuts")
COLUMNS = ["run", "fit", "train_queries", "epochs", "train_accuracy", "segment_correlation", "pair_accuracy"]
SCALE_COLUMNS = ["run", "one_scale", "session_scales"]
MEASURES = ("train_accuracy", "segment_correlation", "pair_accuracy")


def without_ratings(settings: dict) -> str | None:
    """Why a run's labels are no ratings to fit (None: they are)."""
    return None if settings.get("rating_scale") else "compared or ranked its clips (rating_scale 0): it holds no ratings to fit"


def read_run(workdir: Path, run: str) -> dict:
    """A rating run's settings, labelled clips, their labels and sessions, and the objective's return of each clip."""
    settings, segments, labels, rewards = objective_run_labels(workdir, run, without_ratings)
    returns = rewards.sum(-1)
    sessions = label_column(workdir / "runs" / run / "labels.sqlite", "session")
    return {"settings": settings, "segments": segments, "labels": labels, "sessions": sessions, "rewards": rewards, "returns": returns}


def split_sessions(sessions: np.ndarray, train: int, test: int, run: str) -> tuple[np.ndarray, np.ndarray]:
    """The queries of the first `train` sessions and of the `test` sessions after them: two boolean masks."""
    order = np.unique(sessions)
    if len(order) < train + test:
        raise SystemExit(
            f"--runs {run} has {len(order)} sessions of labels; --train-sessions {train} and --test-sessions {test} need {train + test}"
        )
    return np.isin(sessions, order[:train]), np.isin(sessions, order[train : train + test])


def as_pairs(segments: dict, labels: np.ndarray, clips: int, scale: int) -> tuple[dict, np.ndarray]:
    """The pairs of clips each rated query orders, as pair queries: segments (N P, 2, ...) and labels (N P,)."""
    first, second = clip_pairs(clips)
    pairs = {name: np.stack([value[:, first], value[:, second]], 2) for name, value in segments.items()}
    pairs = {name: value.reshape(-1, *value.shape[2:]) for name, value in pairs.items()}
    return pairs, rating_pair_labels(labels, clips, scale).reshape(-1)


def start_cuts(model: sac_rlhf.RewardEnsemble, gap: float) -> None:
    """The ordered logit's cut points started `gap` returns apart, centred on 0 (the script's own start: 1 apart)."""
    with torch.no_grad():
        model.rating_cut_parameters[:, :1] = -(model.rating_scale - 2) / 2 * gap
        model.rating_cut_parameters[:, 1:] = math.log(math.expm1(gap))  # the softplus of it is the gap


def fit_gap(fit: str, segment_length: int, scale: int) -> float | None:
    """The cut points' starting gap of a fit's name: none for `pairs`, 1 for `ratings`, G for `ratings_gap_G`."""
    if fit == "pairs":
        return None
    if fit in SCALE_FITS:
        return 1.0
    gap = fit.removeprefix("ratings").removeprefix("_gap_") or "1"
    return segment_length / max(scale - 2, 1) if gap == "span" else float(gap)


def ordered_pair_accuracy(model: sac_rlhf.RewardEnsemble, segments: dict, labels: np.ndarray, scale: int) -> float:
    """The share of the pairs of clips the ratings `labels` order (ties left out) that the ensemble-mean returns order
    the same way."""
    steps, masks = torch.as_tensor(segments["obs_actions"]), torch.as_tensor(segments["masks"], dtype=torch.float32)
    return ordered_pair_share(sac_rlhf.segment_returns(model, steps, masks).mean(0).numpy(), labels, scale)


def fit_scales(model, args, fitted: dict, labels: np.ndarray, scale_of: np.ndarray, cut_lr: float, seed: int) -> dict:
    """Fits `model` to ratings by the ordered logit with one set of cut points per value of `scale_of` (each query's
    scale, 0 ..), every set started as the model's own and learned at `cut_lr` (the network at --reward-net-lr), epoch
    after epoch of sac_rlhf.reward_epoch until the returns order the rated pairs as --reward-net-target-accuracy asks
    or --reward-net-epochs have run. Returns the epochs, the last accuracy and the cut points (E, scales, n - 1)."""
    scales = int(scale_of.max()) + 1
    cut_parameters = torch.nn.Parameter(model.rating_cut_parameters.detach()[:, None].repeat(1, scales, 1))
    network = [value for name, value in model.named_parameters() if name != "rating_cut_parameters"]
    groups = [{"params": network}, {"params": [cut_parameters], "lr": cut_lr}]
    optimizer = torch.optim.Adam(groups, lr=args.reward_net_lr)
    given, query_scale = torch.as_tensor(labels), torch.as_tensor(scale_of)
    members = torch.arange(model.ensemble_size)[:, None]

    def rating_loss(returns: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        """The ratings' loss with each query's own cut points: reward_epoch hands over query numbers as labels."""
        queries = queries.long()
        return session_rating_loss(returns, given[queries], ordered_cuts(cut_parameters)[members, query_scale[queries]])

    queries = len(labels)
    data = (
        torch.as_tensor(fitted["obs_actions"]),
        torch.as_tensor(fitted["masks"], dtype=torch.float32),
        torch.arange(queries, dtype=torch.float32),
    )
    rng, cpu = np.random.default_rng(seed), torch.device("cpu")
    model.train()
    epochs, accuracy = 0, float("nan")
    while epochs < args.reward_net_epochs:
        epochs += 1
        sac_rlhf.reward_epoch(model, optimizer, data, torch.arange(queries), None, args, rng, cpu, rating_loss)
        accuracy = ordered_pair_accuracy(model, fitted, labels, model.rating_scale)
        if accuracy >= args.reward_net_target_accuracy:
            break
    return {"epochs": epochs, "train_accuracy": accuracy, "cuts": ordered_cuts(cut_parameters).detach()}


def one_scale_share(returns: np.ndarray, ratings: np.ndarray, scale: int) -> float:
    """The largest share of clips that one increasing map from return to rating rates as `ratings` (0 .. scale - 1)
    say: the longest run of the ratings, in the order of the returns, that never goes down."""
    best = np.zeros(scale)  # best[c]: the most clips so far rated right by a map that has reached at most rating c
    for rating in ratings[np.argsort(returns, kind="stable")]:
        best = np.maximum.accumulate(best + (np.arange(scale) == rating))
    return float(best[-1] / len(ratings))


def scale_shares(data: dict, run: str, train_sessions: int) -> dict:
    """How far the ratings of a run's first `train_sessions` sessions are one scale of the returns the teacher judged
    (the objective's, weighed by its --teacher-gamma): one_scale_share over all of them, and over each session apart.
    `data`: the run's read_run."""
    segments, settings = data["segments"], data["settings"]
    clips, scale = segments["masks"].shape[1], settings["rating_scale"]
    rewards = data["rewards"]
    judged = rewards @ settings.get("teacher_gamma", 1.0) ** np.arange(rewards.shape[-1] - 1, -1, -1)  # (N, k)
    ratings = clip_ratings(data["labels"], clips, scale)
    sessions = data["sessions"]
    first = np.unique(sessions)[:train_sessions]
    train = np.isin(sessions, first)
    rated_right = [
        one_scale_share(judged[sessions == s].ravel(), ratings[sessions == s].ravel(), scale) * (sessions == s).sum() for s in first
    ]
    return {
        "run": run,
        "one_scale": one_scale_share(judged[train].ravel(), ratings[train].ravel(), scale),
        "session_scales": float(sum(rated_right) / train.sum()),
    }


def fit_row(workdir: Path, run: str, fit: str, train_sessions: int, test_sessions: int, seed: int, cut_lr: float) -> dict:
    """One fit of one run's first sessions, measured on the next ones (`cut_lr`: SCALE_FITS' cut points' rate)."""
    torch.set_num_threads(1)
    data = read_run(workdir, run)
    settings, segments, labels = data["settings"], data["segments"], data["labels"]
    train, test = split_sessions(data["sessions"], train_sessions, test_sessions, run)
    scale, clips, length = settings["rating_scale"], segments["masks"].shape[1], segments["masks"].shape[-1]
    known = {field.name for field in dataclasses.fields(sac_rlhf.Args)}
    args = sac_rlhf.Args(**{key: value for key, value in settings.items() if key in known})
    args = dataclasses.replace(args, surf=False, reward_net_normalize_inputs=False)
    fitted = {name: value[train] for name, value in segments.items()}
    fitted_labels, gap = labels[train], fit_gap(fit, length, scale)
    if gap is None:
        fitted, fitted_labels = as_pairs(fitted, fitted_labels, clips, scale)
        args = dataclasses.replace(args, rating_scale=0, clips_per_query=2)
    torch.manual_seed(seed)
    input_dim = segments["obs_actions"].shape[-1]
    model = sac_rlhf.RewardEnsemble.from_args(input_dim, args)
    if settings.get("reward_net_normalize_inputs"):  # the run's statistics came from its buffer: the clips' stand in
        model.set_input_statistics(fitted["obs_actions"][fitted["masks"].astype(bool)])
    if gap is not None:
        start_cuts(model, gap)
    if fit in SCALE_FITS:
        sessions = np.unique(data["sessions"][train], return_inverse=True)[1]
        scale_of = sessions if fit == "ratings_session_cuts" else np.zeros_like(sessions)
        stats = fit_scales(model, args, fitted, fitted_labels, scale_of, cut_lr, seed)
    else:
        input_sizes = (length, input_dim, segments["physics_states"].shape[-1], fitted["masks"].shape[1])
        prefs = sac_rlhf.PreferenceBuffer(*input_sizes)
        arrays = (fitted["obs_actions"], fitted["masks"], fitted["true_rewards"], fitted["physics_states"])
        prefs.add(*arrays, fitted_labels, np.zeros(len(fitted_labels), bool), 0)
        optimizer = torch.optim.Adam(model.parameters(), lr=args.reward_net_lr)
        cpu = torch.device("cpu")
        stats = sac_rlhf.train_reward_model(model, optimizer, prefs, None, args, np.random.default_rng(seed), cpu)
        stats["train_accuracy"] = sac_rlhf.preference_accuracy(model, prefs, np.arange(len(prefs)), cpu)
    model.eval()
    with torch.no_grad():
        steps = torch.as_tensor(segments["obs_actions"][test])
        returns = (model(steps).mean(0) * torch.as_tensor(segments["masks"][test], dtype=torch.float32)).sum(-1).numpy()
    truth = data["returns"][test]
    first, second = clip_pairs(clips)
    decided = truth[:, first] != truth[:, second]
    agree = (returns[:, second] > returns[:, first]) == (truth[:, second] > truth[:, first])
    return {
        "run": run,
        "fit": fit,
        "train_queries": int(train.sum()),
        "epochs": stats["epochs"],
        "train_accuracy": stats["train_accuracy"],
        "segment_correlation": correlation(returns.ravel(), truth.ravel()),
        "pair_accuracy": float(agree[decided].mean()) if decided.any() else None,
    }


def fmt_median(figures: dict) -> str:
    return "-" if figures["median"] is None else f"{figures['median']:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=REPO / "bench" / "workdir", help="holds runs/<run>")
    parser.add_argument("--runs", nargs="+", required=True, help="sac_rlhf.py rating runs under --workdir/runs")
    parser.add_argument("--train-sessions", type=int, default=8, help="the first sessions whose labels are fitted (> 0)")
    parser.add_argument("--test-sessions", type=int, default=2, help="the sessions after them the fit is measured on (> 0)")
    parser.add_argument("--cut-gaps", nargs="*", default=[], help="also fit the ratings with the cut points this far apart")
    parser.add_argument("--cut-lr", type=float, default=0.03, help="the cut points' learning rate of the fits that stop on order (> 0)")
    parser.add_argument("--seed", type=int, default=0, help="the torch and sampling seed of every fit")
    parser.add_argument("--parallel", type=int, default=1, help="fits at once, one core each")
    parser.add_argument(
        "--output", type=Path, default=None, help="the JSON file (default: rating_fit/objectives/<objective>-rating-fit.json)"
    )
    args = parser.parse_args()
    positive = ("--train-sessions", args.train_sessions), ("--test-sessions", args.test_sessions), ("--parallel", args.parallel)
    for flag, value in (*positive, ("--cut-lr", args.cut_lr)):
        if value <= 0:
            raise SystemExit(f"{flag} {value}: must be > 0")
    for gap in args.cut_gaps:
        if gap != "span" and not (gap.replace(".", "", 1).isdigit() and float(gap) > 0):
            raise SystemExit(f"--cut-gaps {gap}: a gap is a return > 0, or span")
    runs = {run: read_run(args.workdir, run) for run in args.runs}  # every run refused before any fit starts
    fits = ["pairs", "ratings", *(f"ratings_gap_{gap}" for gap in args.cut_gaps), *SCALE_FITS]
    jobs = [(run, fit) for run in args.runs for fit in fits]
    with concurrent.futures.ProcessPoolExecutor(args.parallel) as pool:
        fit_args = (args.train_sessions, args.test_sessions, args.seed, args.cut_lr)
        futures = [pool.submit(fit_row, args.workdir, run, fit, *fit_args) for run, fit in jobs]
        rows = [future.result() for future in futures]
    scales = [scale_shares(data, run, args.train_sessions) for run, data in runs.items()]
    print_table(scales, SCALE_COLUMNS)
    print_table(rows, COLUMNS)
    medians = {fit: {name: spread([r[name] for r in rows if r["fit"] == fit]) for name in MEASURES} for fit in fits}
    for fit in fits:
        print(f"{fit}: " + ", ".join(f"{name} median {fmt_median(medians[fit][name])}" for name in MEASURES))
    objective = json.loads((args.workdir / "runs" / args.runs[0] / "args.json").read_text())["teacher_objective"]
    args.output = args.output or results_path("rating_fit", "objectives", f"{objective}-rating-fit")
    command = (
        f"python bench/rating_fit.py --workdir {args.workdir} --runs {' '.join(args.runs)} --train-sessions "
        f"{args.train_sessions} --test-sessions {args.test_sessions}"
        + (f" --cut-gaps {' '.join(args.cut_gaps)}" if args.cut_gaps else "")
        + f" --cut-lr {args.cut_lr} --seed {args.seed} --output {args.output}"
    )
    payload = {"benchmark": "rating_fit", "command": command, "machine": machine_info(), "runs": args.runs}
    write_json(args.output, payload | {"rows": rows, "medians": medians, "scales": scales})


if __name__ == "__main__":
    main()
