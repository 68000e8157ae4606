# Compare runs: did SURF help, how many labels does each variant need, which seed failed?
#
#   python toolbox/compare.py runs/hopper_surf_* runs/hopper_nosurf_* --group-by surf --out report/
#
# Reads each run's TensorBoard event file, args.json and (when the run has finished) summary.json, groups the
# runs, aligns the seeds of a group on a common step grid, and writes a self-contained report folder:
# index.html with PNG plots (mean and bootstrap confidence band across seeds), IQM with stratified bootstrap
# confidence intervals and the probability of improvement (rliable, Agarwal et al. 2021), a table of every
# run and group (also summary.csv, and printed with rich), and two runs' evaluation videos side by side.
#
# Read top to bottom: settings, loading runs, grouping, aligning seeds, statistics, plots, the table, the
# videos, the HTML page, and finally `main`.
import csv
import html
import json
import math
import re
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import quote

import numpy as np
import tyro

from cleanrlhf_utils.arguments import parse_args
from cleanrlhf_utils.tracking import run_name_env

# Every PNG has this size: FIG_SIZE inches at DPI dots per inch (800 x 450 pixels), saved without a
# "tight" bounding box so the size never depends on the labels.
FIG_SIZE = (8.0, 4.5)
DPI = 100

# The TensorBoard scalars the report reads (written by framework/sac_rlhf.py, pref_ppo.py, sac.py and ppo.py).
EVAL_TAG = "eval/mean_return"
SUCCESS_TAG = "eval/success_rate"  # Meta-World: the fraction of evaluation episodes that reached success
LABELS_TAG = "feedback/labels_obtained"
SPS_TAG = "charts/SPS"
HELDOUT_TAG = "reward_model/heldout_accuracy"
CORRELATION_TAG = "reward_model/reward_correlation"
EVENT_GLOB = "events.out.tfevents.*"
VIDEO_PATTERN = re.compile(r"eval_step_(\d+)\.mp4")


@dataclass
class Args:
    runs: tyro.conf.Positional[list[str]]
    """run folders (runs/<run_name>, holding events.out.tfevents.*), or folders of run folders (runs/)"""
    out: str = "report"
    """folder the report is written to: index.html, the PNG plots, summary.csv and videos/"""
    group_by: str | None = None
    """group runs by this field of their args.json (`--group-by surf` gives the groups "surf=True" and "surf=False");
    default: the run name without its seed (and time) part, i.e. the exp_name for default run names"""
    group_pattern: str | None = None
    """group runs by a regular expression on the run name: its first capture group (or the whole match) is the group"""
    common_steps_only: bool = False
    """plot each group only up to the last step that all its runs reached; by default a group's curve goes on
    to its longest run's last step, averaging over the runs that got there (its band needs two of them)"""
    videos_dir: str | None = None
    """folder of the evaluation videos (<videos_dir>/<run_name>/eval_step_<step>.mp4); default: the videos/
    folder next to each run's runs/ folder, where the training scripts write them"""
    video_runs: tuple[str, str] | None = None
    """the two runs (names or folders) whose evaluation videos are shown side by side; default: the runs with
    the best and the worst final return among those with videos"""
    video_step: int | None = None
    """the step of the compared videos; default: the largest step both runs have a video for"""
    seed: int = 0
    """seed of the bootstrap resampling: the same runs and seed give the same report"""
    bootstrap_reps: int = 2000
    """bootstrap resamples for every confidence interval (rliable's own default is 50,000: raise it for a paper)"""
    confidence: float = 0.95
    """coverage of the confidence intervals and bands"""
    metric: Literal["return", "objective_return", "objective_success"] = "return"
    """what is compared: `return`, the evaluation return on the env's reward (eval/mean_return); `objective_return` or
    `objective_success`, the --teacher-objective's measures of the same evaluations (eval/objective_return,
    eval/objective_success; summary.json's final_objective_return / final_objective_success)"""


METRICS = {
    "return": (EVAL_TAG, "final_eval_return", "evaluation return (true reward)"),
    "objective_return": ("eval/objective_return", "final_objective_return", "evaluation objective return"),
    "objective_success": ("eval/objective_success", "final_objective_success", "evaluation objective success"),
}
"""--metric -> (TensorBoard tag, summary.json key, axis label)"""


def select_metric(runs: list["Run"], metric: str) -> None:
    """Compare `metric` instead of the env's return: each run's curve and final value of it take the place of the
    return's (the rest of the report reads those). A run that never logged it is refused: the objective's measures
    exist only in runs trained with --teacher-objective."""
    tag, key, _ = METRICS[metric]
    if metric == "return":
        return
    missing = [run.name for run in runs if tag not in run.scalars and not (run.summary and key in run.summary)]
    if missing:
        raise CompareError(f"--metric {metric}: {', '.join(missing)} logged no {tag} (train with --teacher-objective to measure it)")
    for run in runs:
        if tag in run.scalars:
            run.scalars[EVAL_TAG] = run.scalars[tag]
        if run.summary is not None:
            run.summary["final_eval_return"] = run.summary.get(key, math.nan)


class CompareError(ValueError):
    """Bad input (no event files, unknown field...): the command line prints it as one line and exits with 2."""


# ----------------------------------------------------------------------------------------------------------
# Loading runs
# ----------------------------------------------------------------------------------------------------------
@dataclass
class Run:
    name: str
    path: Path
    args: dict  # the run's args.json ({} if it has none)
    summary: dict | None  # the run's summary.json; None while the run is still going
    scalars: dict[str, tuple[np.ndarray, np.ndarray]]  # tag -> (steps, values), sorted by step
    wall_span: float  # seconds between the first and the last event, the wall time of a run without summary
    group: str = ""

    @property
    def seed(self) -> int | None:
        return self.args.get("seed")

    @property
    def status(self) -> str:
        if self.summary is None:
            return "running"  # or killed: either way its summary.json was never written
        return "interrupted" if self.summary.get("interrupted") else "finished"

    def curve(self, tag: str) -> tuple[np.ndarray, np.ndarray]:
        """The finite points of a scalar (held-out accuracy is NaN while the held-out set is empty)."""
        steps, values = self.scalars.get(tag, (np.zeros(0, dtype=np.int64), np.zeros(0)))
        finite = np.isfinite(values)
        return steps[finite], values[finite]

    @property
    def has_feedback(self) -> bool:
        """Preference-based runs; sac.py and ppo.py baselines learn from the true reward and have no labels."""
        return LABELS_TAG in self.scalars or "teacher_feedback_total_queries" in self.args

    def labels_at(self, steps: np.ndarray) -> np.ndarray:
        """Labels obtained at each step: the last logged count at or before it, 0 before the first session."""
        label_steps, label_values = self.curve(LABELS_TAG)
        index = np.searchsorted(label_steps, steps, side="right") - 1
        return np.where(index >= 0, label_values[np.maximum(index, 0)] if len(label_values) else 0.0, 0.0)

    @property
    def final_step(self) -> float:
        steps, _ = self.curve(EVAL_TAG)
        return float(steps[-1]) if len(steps) else math.nan

    @property
    def final_return(self) -> float:
        """The last evaluation: the summary's final_eval_return, or, for a run still going, its latest evaluation."""
        if self.summary is not None and _finite(self.summary.get("final_eval_return")):
            return float(self.summary["final_eval_return"])
        _, values = self.curve(EVAL_TAG)
        return float(values[-1]) if len(values) else math.nan

    @property
    def final_success_rate(self) -> float:
        """The last evaluation's success rate (summary, else latest logged); NaN for envs that report no success."""
        if self.summary is not None and _finite(self.summary.get("final_success_rate")):
            return float(self.summary["final_success_rate"])
        _, values = self.curve(SUCCESS_TAG)
        return float(values[-1]) if len(values) else math.nan

    @property
    def labels(self) -> float:
        if not self.has_feedback:
            return math.nan
        if self.summary is not None and _finite(self.summary.get("labels_obtained")):
            return float(self.summary["labels_obtained"])
        _, values = self.curve(LABELS_TAG)
        return float(values[-1]) if len(values) else 0.0

    @property
    def global_step(self) -> float:
        if self.summary is not None and _finite(self.summary.get("global_step")):
            return float(self.summary["global_step"])
        return float(max((steps[-1] for steps, _ in self.scalars.values() if len(steps)), default=math.nan))

    @property
    def wall_seconds(self) -> float:
        if self.summary is not None and _finite(self.summary.get("wall_seconds")):
            return float(self.summary["wall_seconds"])
        return self.wall_span

    @property
    def sps(self) -> float:
        if self.summary is not None and _finite(self.summary.get("sps")):
            return float(self.summary["sps"])
        _, values = self.curve(SPS_TAG)
        return float(values[-1]) if len(values) else math.nan


def _finite(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def find_run_dirs(paths: list[str]) -> list[Path]:
    """The run folders: each given folder that holds event files, else its subfolders that do (runs/ -> every run)."""
    found: list[Path] = []
    for given in paths:
        folder = Path(given)
        if not folder.is_dir():
            raise CompareError(f"{given}: no such folder")
        if any(folder.glob(EVENT_GLOB)):
            found.append(folder)
            continue
        children = sorted(child for child in folder.iterdir() if child.is_dir() and any(child.glob(EVENT_GLOB)))
        if not children:
            raise CompareError(f"{given}: no TensorBoard event files ({EVENT_GLOB}) in this folder or its subfolders")
        found += children
    unique = {folder.resolve(): folder for folder in found}  # a shell glob and a parent folder may name a run twice
    return list(unique.values())


def read_scalars(run_dir: Path) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], float]:
    """All scalars of a run folder (every event file in it: a resumed run has several) and their wall-time span."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    # size_guidance 0 keeps every scalar (the default keeps a sample of 10,000); the rest is not needed.
    guidance = {ea.SCALARS: 0, ea.TENSORS: 1, ea.IMAGES: 1, ea.AUDIO: 1, ea.HISTOGRAMS: 1, ea.COMPRESSED_HISTOGRAMS: 1}
    accumulator = ea.EventAccumulator(str(run_dir), size_guidance=guidance)
    accumulator.Reload()  # a file still being written ends in a partial record: the loader stops before it
    scalars, wall_times = {}, []
    for tag in accumulator.Tags()["scalars"]:
        events = accumulator.Scalars(tag)
        latest = {event.step: event.value for event in events}  # a step logged twice (resume): the last one wins
        steps = np.array(sorted(latest), dtype=np.int64)
        scalars[tag] = (steps, np.array([latest[step] for step in steps], dtype=np.float64))
        wall_times += [events[0].wall_time, events[-1].wall_time]
    span = max(wall_times) - min(wall_times) if wall_times else math.nan
    return scalars, span


def read_json(path: Path) -> dict | None:
    """A JSON file, or None if it is missing or half-written (a run that is writing it right now)."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def load_runs(paths: list[str]) -> list[Run]:
    runs = []
    for run_dir in find_run_dirs(paths):
        scalars, span = read_scalars(run_dir)
        runs.append(Run(run_dir.name, run_dir, read_json(run_dir / "args.json") or {}, read_json(run_dir / "summary.json"), scalars, span))
    names = [run.name for run in runs]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise CompareError(f"two run folders share the name {duplicates[0]}: runs are told apart by their folder name")
    return runs


# ----------------------------------------------------------------------------------------------------------
# Grouping
# ----------------------------------------------------------------------------------------------------------
def default_group(run: Run, single_env: bool) -> str:
    """The run name without its seed: `<env>__<exp_name>__<seed>__<time>` gives the exp_name (prefixed with the
    env when the runs span several), a custom name like `hopper_surf_3` gives `hopper_surf`."""
    seed = run.seed
    parts = run.name.split("__")
    if seed is not None and str(seed) in parts[1:]:
        kept = parts[: parts.index(str(seed), 1)]  # the seed and what follows it (the start time)
        env = run_name_env(str(run.args.get("env_id", "")))
        if single_env and len(kept) > 1 and kept[0] == env:
            kept = kept[1:]
        return "__".join(kept)
    if seed is not None:
        stripped = re.sub(rf"(?:[_\-.]+(?:seed[_\-=]?)?|seed[_\-=]?){seed}$", "", run.name)
        if stripped:
            return stripped
    return run.name


def assign_groups(runs: list[Run], group_by: str | None = None, group_pattern: str | None = None) -> list[str]:
    """Sets every run's group and returns the groups in the order their first run was given."""
    if group_by is not None and group_pattern is not None:
        raise CompareError("give either --group-by or --group-pattern, not both")
    if group_by is not None:
        allowed = sorted({key for run in runs for key in run.args})
        if group_by not in allowed:
            raise CompareError(f"unknown --group-by field {group_by!r}; allowed fields (from args.json): {', '.join(allowed) or 'none'}")
        for run in runs:
            run.group = f"{group_by}={run.args.get(group_by, 'missing')}"
    elif group_pattern is not None:
        try:
            pattern = re.compile(group_pattern)
        except re.error as error:
            raise CompareError(f"--group-pattern {group_pattern!r} is not a regular expression: {error}") from None
        for run in runs:
            match = pattern.search(run.name)
            if match is None:
                raise CompareError(f"--group-pattern {group_pattern!r} does not match the run name {run.name!r}")
            run.group = match.group(1) if pattern.groups else match.group(0)
    else:
        single_env = len({run.args.get("env_id") for run in runs}) == 1
        for run in runs:
            run.group = default_group(run, single_env)
    return list(dict.fromkeys(run.group for run in runs))


# ----------------------------------------------------------------------------------------------------------
# Aligning seeds
# ----------------------------------------------------------------------------------------------------------
def align(curves: list[tuple[np.ndarray, np.ndarray]], common_only: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Puts the curves of a group's runs on one grid: the union of their x values (evaluations are usually at the
    same steps for every seed). A run is interpolated linearly between its own points and is NaN outside them, so
    a shorter (or still running) run simply stops contributing. Returns the grid and a runs x grid matrix."""
    curves = [(x, y) for x, y in curves if len(x)]
    if not curves:
        return np.zeros(0), np.zeros((0, 0))
    grid = np.unique(np.concatenate([x for x, _ in curves])).astype(np.float64)
    if common_only:
        grid = grid[grid <= min(x[-1] for x, _ in curves)]
    matrix = np.full((len(curves), len(grid)), np.nan)
    for i, (x, y) in enumerate(curves):
        inside = (grid >= x[0]) & (grid <= x[-1])
        matrix[i, inside] = np.interp(grid[inside], x, y)
    return grid, matrix


def bootstrap_band(matrix: np.ndarray, reps: int, confidence: float, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """Mean across runs (rows) at each grid point and a percentile bootstrap band of that mean; the band is NaN
    where fewer than two runs have a value (a single seed has no spread to resample)."""
    mean, low, high = (np.full(matrix.shape[1], np.nan) for _ in range(3))
    tail = 100 * (1 - confidence) / 2
    for j in range(matrix.shape[1]):
        values = matrix[:, j][np.isfinite(matrix[:, j])]
        if len(values) == 0:
            continue
        mean[j] = values.mean()
        if len(values) >= 2:
            means = values[rng.integers(0, len(values), size=(reps, len(values)))].mean(axis=1)
            low[j], high[j] = np.percentile(means, [tail, 100 - tail])
    return mean, low, high


def dedupe_last(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Keeps the last y of each repeated x (x sorted): a session where every query was skipped adds no label."""
    keep = np.append(x[1:] != x[:-1], True) if len(x) else np.zeros(0, dtype=bool)
    return x[keep], y[keep]


# ----------------------------------------------------------------------------------------------------------
# Statistics (rliable)
# ----------------------------------------------------------------------------------------------------------
@contextmanager
def numpy_global_seed(seed: int) -> Iterator[None]:
    """rliable's stratified bootstraps draw their indices with np.random.choice, numpy's global generator, whatever
    random_state says: seed it for the call and put the caller's state back afterwards."""
    state = np.random.get_state()  # noqa: NPY002 (the legacy global generator is the one rliable uses)
    np.random.seed(seed)  # noqa: NPY002
    try:
        yield
    finally:
        np.random.set_state(state)  # noqa: NPY002


def final_scores(runs: list[Run]) -> np.ndarray:
    """rliable's score matrix of a group: runs x tasks, one task here; runs without any evaluation are left out."""
    scores = [run.final_return for run in runs]
    return np.array([score for score in scores if math.isfinite(score)], dtype=np.float64).reshape(-1, 1)


def iqm(scores: np.ndarray) -> np.ndarray:
    from rliable import metrics

    return np.array([metrics.aggregate_iqm(scores)])


def mean(scores: np.ndarray) -> np.ndarray:
    from rliable import metrics

    return np.array([metrics.aggregate_mean(scores)])


def interval_estimate(scores: np.ndarray, aggregate, reps: int, confidence: float, seed: int) -> tuple[float, float, float]:
    """(point, low, high) of an aggregate with rliable's stratified bootstrap. Each group is resampled on its own
    freshly seeded generator, so its interval does not depend on which other groups are in the report."""
    from rliable import library as rly

    with numpy_global_seed(seed):
        points, intervals = rly.get_interval_estimates({"group": scores}, aggregate, reps=reps, confidence_interval_size=confidence)
    return float(points["group"][0]), float(intervals["group"][0, 0]), float(intervals["group"][1, 0])


def probability_of_improvement(x: np.ndarray, y: np.ndarray, reps: int, confidence: float, seed: int) -> tuple[float, float, float]:
    """P(a run of X beats a run of Y) (Mann-Whitney U / (n_x n_y)) with its stratified bootstrap interval."""
    from rliable import library as rly
    from rliable import metrics

    with numpy_global_seed(seed):
        points, intervals = rly.get_interval_estimates(
            {"pair": [x, y]}, metrics.probability_of_improvement, reps=reps, confidence_interval_size=confidence
        )
    low, high = np.ravel(intervals["pair"])  # (2, 1) here: the metric returns a scalar, not an array
    return float(points["pair"]), float(low), float(high)


@dataclass
class GroupStats:
    name: str
    runs: list[Run]
    scores: np.ndarray  # runs x 1, finite final returns
    iqm: tuple[float, float, float] = (math.nan, math.nan, math.nan)  # point, low, high
    mean: tuple[float, float, float] = (math.nan, math.nan, math.nan)


def group_statistics(runs: list[Run], groups: list[str], reps: int, confidence: float, seed: int) -> list[GroupStats]:
    stats = []
    for group in groups:
        members = [run for run in runs if run.group == group]
        entry = GroupStats(group, members, final_scores(members))
        if len(entry.scores):
            entry.iqm = interval_estimate(entry.scores, iqm, reps, confidence, seed)
            entry.mean = interval_estimate(entry.scores, mean, reps, confidence, seed)
        stats.append(entry)
    return stats


def improvement_pairs(
    stats: list[GroupStats], reps: int, confidence: float, seed: int
) -> list[tuple[str, str, tuple[float, float, float]]]:
    """P(X > Y) for every two groups with final returns, X the one given first on the command line."""
    scored = [entry for entry in stats if len(entry.scores)]
    return [
        (x.name, y.name, probability_of_improvement(x.scores, y.scores, reps, confidence, seed))
        for i, x in enumerate(scored)
        for y in scored[i + 1 :]
    ]


# ----------------------------------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------------------------------
def new_figure(columns: int = 1):
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, columns, figsize=FIG_SIZE, dpi=DPI, layout="constrained", squeeze=False)
    return figure, list(axes[0])


def save(figure, path: Path) -> Path:
    import matplotlib.pyplot as plt

    figure.savefig(path, dpi=DPI)  # no bbox_inches="tight": every PNG keeps FIG_SIZE x DPI pixels
    plt.close(figure)
    return path


def colors(groups: list[str]) -> dict[str, str]:
    palette = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
    return {group: palette[i % len(palette)] for i, group in enumerate(groups)}


def draw_band(axis, x, mean_y, low, high, color: str, label: str) -> None:
    axis.plot(x, mean_y, color=color, linewidth=2, label=label)
    banded = np.isfinite(low)
    if banded.any():
        axis.fill_between(x, low, high, where=banded, color=color, alpha=0.2, linewidth=0)


def plot_return_vs_steps(stats: list[GroupStats], palette, args: Args, path: Path, tag: str = EVAL_TAG) -> Path:
    rng = np.random.default_rng(args.seed)
    figure, (axis,) = new_figure()
    for entry in stats:
        curves = [run.curve(tag) for run in entry.runs]
        for run, (steps, values) in zip(entry.runs, curves):  # every seed, thin: a failed seed stands out
            axis.plot(steps, values, color=palette[entry.name], alpha=0.3, linewidth=0.8)
            if run.status == "running" and len(steps):  # an x where a run still going has got to
                axis.plot(steps[-1], values[-1], marker="x", color=palette[entry.name], alpha=0.6)
        grid, matrix = align(curves, args.common_steps_only)
        if len(grid):
            draw_band(axis, grid, *bootstrap_band(matrix, args.bootstrap_reps, args.confidence, rng), palette[entry.name], _legend(entry))
    if tag == SUCCESS_TAG:
        axis.set(
            xlabel="environment steps", ylabel="success rate", title="Evaluation success rate vs environment steps", ylim=(-0.05, 1.05)
        )
    else:
        axis.set(xlabel="environment steps", ylabel=METRICS[args.metric][2], title="Evaluation return vs environment steps")
    _finish(axis, args)
    return save(figure, path)


def plot_success_vs_steps(stats: list[GroupStats], palette, args: Args, path: Path) -> Path:
    """Meta-World's metric: the fraction of evaluation episodes that reached success, like the return plot."""
    return plot_return_vs_steps(stats, palette, args, path, SUCCESS_TAG)


def plot_return_vs_labels(stats: list[GroupStats], palette, args: Args, path: Path) -> Path:
    """Return against labels, parametrised by the step: at every step of the grid, x is the mean number of labels
    the group's runs had and y their mean return. Once the label budget is spent the curve rises vertically."""
    rng = np.random.default_rng(args.seed)
    figure, (axis,) = new_figure()
    for entry in stats:
        runs = [run for run in entry.runs if run.has_feedback]
        if not runs:
            continue
        curves = [run.curve(EVAL_TAG) for run in runs]
        for run, (steps, values) in zip(runs, curves):
            axis.plot(run.labels_at(steps), values, color=palette[entry.name], alpha=0.3, linewidth=0.8)
        grid, returns = align(curves, args.common_steps_only)
        if not len(grid):
            continue
        labels = np.stack([run.labels_at(grid) for run in runs])
        labels[~np.isfinite(returns)] = np.nan  # average the labels of the runs that are in the return's mean
        draw_band(
            axis,
            np.nanmean(labels, axis=0),
            *bootstrap_band(returns, args.bootstrap_reps, args.confidence, rng),
            palette[entry.name],
            _legend(entry),
        )
    axis.set(xlabel="labels obtained", ylabel=METRICS[args.metric][2], title="Evaluation return vs labels obtained")
    _finish(axis, args)
    return save(figure, path)


def plot_reward_model(stats: list[GroupStats], palette, args: Args, path: Path) -> Path:
    """Held-out accuracy and reward correlation after each feedback session, against the labels obtained then."""
    rng = np.random.default_rng(args.seed)
    figure, axes = new_figure(2)
    for axis, tag, title in zip(axes, [HELDOUT_TAG, CORRELATION_TAG], ["Held-out preference accuracy", "Correlation with the true reward"]):
        for entry in stats:
            curves = []
            for run in entry.runs:
                steps, values = run.curve(tag)
                labels, values = dedupe_last(run.labels_at(steps), values)
                axis.plot(labels, values, color=palette[entry.name], alpha=0.3, linewidth=0.8, marker=".")
                curves.append((labels, values))
            grid, matrix = align(curves, args.common_steps_only)
            if len(grid):
                draw_band(axis, grid, *bootstrap_band(matrix, args.bootstrap_reps, args.confidence, rng), palette[entry.name], entry.name)
        axis.set(xlabel="labels obtained", title=title)
        _finish(axis, args)
    return save(figure, path)


def plot_final_performance(stats: list[GroupStats], palette, args: Args, path: Path) -> Path:
    """rliable's interval-estimate view: IQM and mean of the final returns with their CIs, plus every run's score."""
    scored = [entry for entry in stats if len(entry.scores)]
    figure, axes = new_figure(2)
    for axis, key, title in zip(axes, ["iqm", "mean"], ["IQM", "Mean"]):
        for row, entry in enumerate(scored):
            point, low, high = getattr(entry, key)
            axis.barh(row, high - low, left=low, height=0.5, color=palette[entry.name], alpha=0.35)
            axis.plot([point, point], [row - 0.25, row + 0.25], color=palette[entry.name], linewidth=2.5)
            axis.scatter(entry.scores[:, 0], np.full(len(entry.scores), row), color="black", s=12, zorder=3)
        axis.set_yticks(range(len(scored)), [entry.name for entry in scored] if axis is axes[0] else [""] * len(scored))
        axis.set_ylim(len(scored) - 0.4, -0.6)  # first group on top
        axis.use_sticky_edges = False  # bars stick to their left edge otherwise: the lowest run's dot would sit on the frame
        axis.margins(x=0.08)
        axis.set(xlabel="final evaluation return", title=f"{title} ({args.confidence:.0%} stratified bootstrap CI)")
        axis.grid(axis="x", alpha=0.3)
    return save(figure, path)


def plot_improvement(pairs, args: Args, path: Path) -> Path:
    figure, (axis,) = new_figure()
    for row, (_, _, (point, low, high)) in enumerate(pairs):
        axis.barh(row, high - low, left=low, height=0.4, color="#1f77b4", alpha=0.35)
        axis.plot([point, point], [row - 0.2, row + 0.2], color="#1f77b4", linewidth=2.5)
        side = "right" if point > 0.8 else "left" if point < 0.2 else "center"  # keep the text inside the frame
        axis.annotate(f"{point:.2f} [{low:.2f}, {high:.2f}]", (point, row - 0.2), xytext=(0, 4), textcoords="offset points", ha=side)
    axis.axvline(0.5, color="gray", linestyle="--", linewidth=1)
    axis.set_yticks(range(len(pairs)), [f"P({x} > {y})" for x, y, _ in pairs])
    axis.set_ylim(max(len(pairs), 2) - 0.5, -0.5)  # first pair on top; a lone pair is not a full-height slab
    axis.set_xlim(-0.02, 1.02)  # a certain improvement (1.0) stays visible
    axis.set(xlabel="probability of improvement", title=f"Probability of improvement ({args.confidence:.0%} stratified bootstrap CI)")
    axis.grid(axis="x", alpha=0.3)
    return save(figure, path)


def _legend(entry: GroupStats) -> str:
    return f"{entry.name} ({len(entry.runs)} run{'s' if len(entry.runs) != 1 else ''})"


def _finish(axis, args: Args) -> None:
    axis.grid(alpha=0.3)
    if axis.get_legend_handles_labels()[0]:
        axis.legend(fontsize="small", title=f"mean, {args.confidence:.0%} bootstrap band", title_fontsize="small")


# ----------------------------------------------------------------------------------------------------------
# The table
# ----------------------------------------------------------------------------------------------------------
COLUMNS = [
    "row",  # "run" or "group"
    "group",
    "run",
    "seed",
    "status",
    "global_step",
    "final_step",  # the step of the final return (a running run's latest evaluation)
    "final_return",  # group rows: the mean over its runs
    "final_success_rate",  # Meta-World runs; group rows: the mean over its runs
    "labels_obtained",
    "wall_seconds",
    "sps",
    "num_runs",
    "iqm",
    "iqm_ci_low",
    "iqm_ci_high",
    "mean_ci_low",
    "mean_ci_high",
]


def table_rows(stats: list[GroupStats]) -> list[dict]:
    """One row per run (grouped, by seed), then one per group; NaN (no value) becomes an empty cell."""
    rows = []
    for entry in stats:
        for run in sorted(entry.runs, key=lambda run: (run.seed is None, run.seed if run.seed is not None else 0, run.name)):
            rows.append(
                {
                    "row": "run",
                    "group": entry.name,
                    "run": run.name,
                    "seed": run.seed,
                    "status": run.status,
                    "global_step": _int(run.global_step),
                    "final_step": _int(run.final_step),
                    "final_return": run.final_return,
                    "final_success_rate": run.final_success_rate,
                    "labels_obtained": _int(run.labels),
                    "wall_seconds": run.wall_seconds,
                    "sps": run.sps,
                }
            )
    for entry in stats:
        rows.append(
            {
                "row": "group",
                "group": entry.name,
                "num_runs": len(entry.runs),
                "final_return": entry.mean[0],
                "final_success_rate": _nanmean([run.final_success_rate for run in entry.runs]),
                "labels_obtained": _nanmean([run.labels for run in entry.runs]),
                "wall_seconds": _nanmean([run.wall_seconds for run in entry.runs]),
                "sps": _nanmean([run.sps for run in entry.runs]),
                "iqm": entry.iqm[0],
                "iqm_ci_low": entry.iqm[1],
                "iqm_ci_high": entry.iqm[2],
                "mean_ci_low": entry.mean[1],
                "mean_ci_high": entry.mean[2],
            }
        )
    return [{column: _cell(row.get(column)) for column in COLUMNS} for row in rows]


def _int(value: float) -> int | None:
    return int(value) if math.isfinite(value) else None


def _nanmean(values: list[float]) -> float:
    finite = [value for value in values if math.isfinite(value)]
    return float(np.mean(finite)) if finite else math.nan


def _cell(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value


def write_csv(rows: list[dict], path: Path) -> Path:
    """Floats are written at full precision (Python's repr), so the CSV reads back exactly."""
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return path


def fmt(value, digits: int = 1) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def display_rows(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The table as text, for the terminal and the HTML page (the CSV keeps every digit)."""
    header = ["group", "run", "seed", "status", "steps", "final return", "success", "labels", "wall (s)", "SPS", "IQM [CI]"]
    lines = []
    for row in rows:
        is_group = row["row"] == "group"
        ci = f"{fmt(row['iqm'])} [{fmt(row['iqm_ci_low'])}, {fmt(row['iqm_ci_high'])}]" if is_group and row["iqm"] is not None else ""
        lines.append(
            [
                row["group"],
                f"{row['num_runs']} runs (mean)" if is_group else row["run"],
                "" if is_group else fmt(row["seed"]),
                "" if is_group else row["status"],
                "" if is_group else fmt(row["global_step"]),
                fmt(row["final_return"]),
                fmt(row["final_success_rate"], 2),
                fmt(row["labels_obtained"], 0),
                fmt(row["wall_seconds"], 0),
                fmt(row["sps"], 0),
                ci,
            ]
        )
    return header, lines


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    header, lines = display_rows(rows)
    table = Table(title="Runs and groups (final return = last evaluation)")
    for name in header:
        table.add_column(name, justify="left" if name in ("group", "run", "status") else "right", overflow="fold")
    previous = "run"
    for row, line in zip(rows, lines):
        if row["row"] != previous:  # a rule between the runs and the groups
            table.add_section()
        previous = row["row"]
        table.add_row(*line, style="bold" if row["row"] == "group" else None)
    console = Console()
    if not console.is_terminal:  # piped or captured: rich would assume 80 columns and fold every cell
        console = Console(width=180)
    console.print(table)


# ----------------------------------------------------------------------------------------------------------
# Videos
# ----------------------------------------------------------------------------------------------------------
def video_folder(run: Run, videos_dir: str | None) -> Path:
    """runs/<name> was written next to videos/<name> (both relative to where the training script was started)."""
    return Path(videos_dir) / run.name if videos_dir else run.path.parent.parent / "videos" / run.name


def list_videos(run: Run, videos_dir: str | None) -> dict[int, Path]:
    folder = video_folder(run, videos_dir)
    videos = {}
    for path in folder.glob("eval_step_*.mp4") if folder.is_dir() else []:
        match = VIDEO_PATTERN.fullmatch(path.name)
        if match:
            videos[int(match.group(1))] = path
    return dict(sorted(videos.items()))


def find_run(runs: list[Run], name: str) -> Run:
    for run in runs:
        if name in (run.name, str(run.path)) or Path(name).name == run.name:
            return run
    raise CompareError(f"--video-runs: no run named {name!r}; runs: {', '.join(run.name for run in runs)}")


def choose_videos(runs: list[Run], args: Args) -> tuple[list[tuple[Run, int, Path]], str]:
    """The compared videos as (run, step, file) and a note for the page."""
    videos = {run.name: list_videos(run, args.videos_dir) for run in runs}
    if args.video_runs is not None:
        chosen = [find_run(runs, name) for name in args.video_runs]
        for run in chosen:
            if not videos[run.name]:
                raise CompareError(f"--video-runs: run {run.name} has no evaluation videos in {video_folder(run, args.videos_dir)}")
    else:
        with_videos = [run for run in runs if videos[run.name]]
        if not with_videos:
            return [], "No evaluation videos found (train with --capture-video; see also --videos-dir)."
        ranked = sorted(with_videos, key=lambda run: run.final_return if math.isfinite(run.final_return) else -math.inf)
        chosen = [ranked[-1], ranked[0]] if len(ranked) > 1 else ranked  # best and worst final return
    if args.video_step is not None:
        for run in chosen:
            if args.video_step not in videos[run.name]:
                steps = ", ".join(map(str, videos[run.name]))
                raise CompareError(f"--video-step {args.video_step}: run {run.name} has videos at steps {steps} only")
        return [(run, args.video_step, videos[run.name][args.video_step]) for run in chosen], ""
    common = set.intersection(*(set(videos[run.name]) for run in chosen))
    if common:
        step = max(common)
        return [(run, step, videos[run.name][step]) for run in chosen], ""
    note = "The two runs have no video at a common step: each shows its latest one."
    return [(run, max(videos[run.name]), videos[run.name][max(videos[run.name])]) for run in chosen], note


def copy_videos(chosen: list[tuple[Run, int, Path]], out: Path) -> list[tuple[Run, int, str]]:
    """Copies the videos into the report (out/videos/<run>/) so the folder can be moved or shared on its own."""
    copied = []
    for run, step, source in chosen:
        relative = Path("videos") / run.name / source.name
        (out / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, out / relative)
        copied.append((run, step, relative.as_posix()))
    return copied


# ----------------------------------------------------------------------------------------------------------
# The HTML page
# ----------------------------------------------------------------------------------------------------------
STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; padding: 0 1em; }
h1 { font-size: 1.6em; } h2 { font-size: 1.25em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.9em; } th, td { padding: 0.25em 0.7em; border-bottom: 1px solid #eee; }
td.num { text-align: right; font-variant-numeric: tabular-nums; } tr.group td { font-weight: bold; background: #f4f6fa; }
.plots { display: flex; flex-wrap: wrap; gap: 1em; } .plots figure { flex: 1 1 560px; max-width: 800px; }
figure { margin: 0; } figure img { width: 100%; border: 1px solid #eee; }
figcaption { font-size: 0.85em; color: #555; }
.meta { color: #555; font-size: 0.9em; }
.videos { display: flex; gap: 1em; } .videos figure { flex: 1; max-width: 560px; } video { width: 100%; background: #000; }
.note { color: #8a5a00; }
"""


def render_html(
    title: str, meta: list[str], rows: list[dict], plots: list[tuple[str, str]], videos: list[tuple[Run, int, str]], notes: list[str]
) -> str:
    """The page; every file it names (plots, summary.csv, videos/) is relative to it, inside the report folder."""
    esc = html.escape
    header, lines = display_rows(rows)
    table = ["<table>", "<tr>" + "".join(f"<th>{esc(name)}</th>" for name in header) + "</tr>"]
    for row, line in zip(rows, lines):
        cells = "".join(f'<td class="{"" if i in (0, 1, 3) else "num"}">{esc(str(cell))}</td>' for i, cell in enumerate(line))
        table.append(f'<tr class="{row["row"]}">{cells}</tr>')
    table.append("</table>")
    figures = "".join(
        f'<figure><img src="{quote(name)}" alt="{esc(name)}"><figcaption>{esc(caption)}</figcaption></figure>' for name, caption in plots
    )
    video_tags = "".join(
        f'<figure><video src="{quote(path)}" controls loop muted autoplay playsinline></video>'
        f"<figcaption>{esc(run.name)} ({esc(run.group)}): step {step}; final return {fmt(run.final_return)}</figcaption></figure>"
        for run, step, path in videos
    )
    meta_lines = "<br>".join(esc(line) for line in meta)
    note_items = "".join(f"<li>{esc(note)}</li>" for note in notes)
    return f"""<!DOCTYPE html>
<html lang="en">
<head><meta charset="utf-8"><title>{esc(title)}</title><style>{STYLE}</style></head>
<body>
<h1>{esc(title)}</h1>
<p class="meta">{meta_lines}</p>
{f'<ul class="note">{note_items}</ul>' if notes else ""}
<h2>Summary</h2>
<p>Final return = each run's last evaluation (true reward). Group rows: mean over runs, and the IQM with its stratified bootstrap CI.
Every number at full precision: <a href="summary.csv">summary.csv</a>.</p>
{"".join(table)}
<h2>Plots</h2>
<div class="plots">{figures}</div>
<h2>Evaluation videos</h2>
{f'<div class="videos">{video_tags}</div>' if videos else ""}
</body>
</html>
"""


# ----------------------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------------------
def write_plots(runs: list[Run], stats: list[GroupStats], pairs, groups: list[str], args: Args, out: Path) -> list[tuple[str, str]]:
    """Draws the plots that the runs have data for; returns (file name, caption) for each."""
    palette = colors(groups)
    plots = []

    def add(name: str, caption: str, draw, *draw_args) -> None:
        draw(*draw_args, args, out / name)
        plots.append((name, caption))

    add(
        "return_vs_steps.png",
        "Evaluation return (true reward) vs environment steps: thin lines are runs (x: still running), thick lines the group means.",
        plot_return_vs_steps,
        stats,
        palette,
    )
    if any(len(run.curve(SUCCESS_TAG)[0]) for run in runs):  # only envs that report success (Meta-World)
        add(
            "success_vs_steps.png",
            "Evaluation success rate (fraction of episodes that reached success at any step) vs environment steps.",
            plot_success_vs_steps,
            stats,
            palette,
        )
    if any(run.has_feedback and len(run.curve(EVAL_TAG)[0]) for run in runs):  # true-reward baselines have no labels
        add(
            "return_vs_labels.png",
            "Evaluation return vs labels obtained: the group's mean labels and mean return at each evaluation step.",
            plot_return_vs_labels,
            stats,
            palette,
        )
    if any(len(run.curve(HELDOUT_TAG)[0]) or len(run.curve(CORRELATION_TAG)[0]) for run in runs):
        add(
            "reward_model_vs_labels.png",
            "Reward model after each feedback session: held-out preference accuracy and correlation with the true reward.",
            plot_reward_model,
            stats,
            palette,
        )
    if any(len(entry.scores) for entry in stats):
        add(
            "final_performance.png",
            "Final return per group: IQM and mean (rliable) with stratified bootstrap CIs; dots are runs.",
            plot_final_performance,
            stats,
            palette,
        )
    if pairs:
        add(
            "probability_of_improvement.png",
            "Probability that a run of the first group beats a run of the second (0.5: no difference).",
            plot_improvement,
            pairs,
        )
    return plots


def main(args: Args) -> dict:
    """Writes the report into args.out and returns what it wrote: {"html", "csv", "plots", "videos", "rows", "stats", "pairs"}."""
    if not args.runs:
        raise CompareError("give at least one run folder (python toolbox/compare.py runs/<run_name> ...)")
    if args.bootstrap_reps < 1 or not 0 < args.confidence < 1:
        raise CompareError(f"--bootstrap-reps must be >= 1 and --confidence in (0, 1), got {args.bootstrap_reps} and {args.confidence}")
    runs = load_runs(args.runs)
    select_metric(runs, args.metric)
    groups = assign_groups(runs, args.group_by, args.group_pattern)
    chosen_videos, video_note = choose_videos(runs, args)  # before the statistics, so a bad --video-runs fails fast
    stats = group_statistics(runs, groups, args.bootstrap_reps, args.confidence, args.seed)
    pairs = improvement_pairs(stats, args.bootstrap_reps, args.confidence, args.seed)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plots = write_plots(runs, stats, pairs, groups, args, out)
    rows = table_rows(stats)
    write_csv(rows, out / "summary.csv")
    videos = copy_videos(chosen_videos, out)

    grouping = (
        f"args.json field {args.group_by}" if args.group_by else f"pattern {args.group_pattern}" if args.group_pattern else "run name"
    )
    improvements = [f"P({x} > {y}) = {point:.2f} [{low:.2f}, {high:.2f}]" for x, y, (point, low, high) in pairs]
    meta = [
        f"{len(runs)} runs in {len(groups)} groups (by {grouping}); bootstrap: {args.bootstrap_reps} resamples, seed {args.seed}, "
        f"{args.confidence:.0%} intervals; metric: {METRICS[args.metric][2]}.",
        *(["Probability of improvement: " + "; ".join(improvements)] if improvements else []),
    ]
    notes = [
        f"{run.name}: still running (no summary.json), as of step {fmt(run.global_step, 0)}." for run in runs if run.status == "running"
    ]
    notes += [
        f"{run.name}: no evaluation yet, left out of the final-return statistics." for run in runs if not math.isfinite(run.final_return)
    ]
    notes += [video_note] if video_note else []
    title = f"Run comparison: {' vs '.join(groups)}"
    (out / "index.html").write_text(render_html(title, meta, rows, plots, videos, notes))

    print_table(rows)
    for line in improvements:
        print(line)
    print(f"report: {out / 'index.html'}")
    return {
        "html": out / "index.html",
        "csv": out / "summary.csv",
        "plots": [out / name for name, _ in plots],
        "videos": [out / path for _, _, path in videos],
        "rows": rows,
        "stats": stats,
        "pairs": pairs,
    }


def cli() -> None:
    args = parse_args(Args)
    try:
        main(args)
    except CompareError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    cli()
