"""toolbox/compare.py: reads runs (event files, args.json, summary.json), groups them, and writes a report whose
numbers match the logged values and rliable computed directly."""

import csv
import json
import math
import os
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "toolbox"))

import compare  # noqa: E402

REPS = 200  # bootstrap resamples: enough to test, quick on a 2-core machine
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MUJOCO_GL": "egl", "WANDB_MODE": "offline"}

# Synthetic runs: (exp_name, surf, seed) -> evaluation returns at steps 0, 250, 500, 750, 1000 (values exact in
# float32, as TensorBoard stores them). The SURF seed 3 is still running: it stopped logging at step 500.
STEPS = [0, 250, 500, 750, 1000]
RETURNS = {
    ("hop_surf", True, 1): [10.0, 120.5, 300.25, 610.0, 900.5],
    ("hop_surf", True, 2): [12.0, 100.0, 250.0, 500.5, 780.25],
    ("hop_surf", True, 3): [9.5, 90.0, 200.75],
    ("hop_nosurf", False, 1): [11.0, 60.5, 150.0, 220.25, 310.0],
    ("hop_nosurf", False, 2): [8.0, 20.0, 35.5, 40.0, 42.75],
}
LABELS = {250: 10.0, 500: 20.0, 750: 30.0}  # labels obtained after each feedback session
HELDOUT = {250: 0.5, 500: 0.75, 750: 0.875}
CORRELATION = {250: 0.25, 500: 0.5, 750: 0.625}


def write_run(root: Path, name: str, args: dict, evals: dict[int, float], feedback: bool, summary: dict | None, sps: float) -> Path:
    from torch.utils.tensorboard import SummaryWriter

    run_dir = root / "runs" / name
    writer = SummaryWriter(str(run_dir))
    for step, value in evals.items():
        writer.add_scalar("eval/mean_return", value, step)
        writer.add_scalar("charts/SPS", sps, step)
        if feedback and step in LABELS:
            writer.add_scalar("feedback/labels_obtained", LABELS[step], step)
            writer.add_scalar("reward_model/heldout_accuracy", HELDOUT[step], step)
            writer.add_scalar("reward_model/reward_correlation", CORRELATION[step], step)
    writer.flush()
    if summary is None:
        # Still running: the writer is open and its file ends in a half-written record.
        event_file = next(run_dir.glob("events.out.tfevents.*"))
        with event_file.open("ab") as file:
            file.write(event_file.read_bytes()[-30:-10])
    else:
        writer.close()
        (run_dir / "summary.json").write_text(json.dumps(summary))
    (run_dir / "args.json").write_text(json.dumps(args))
    video_dir = root / "videos" / name
    video_dir.mkdir(parents=True)
    for step in evals:
        (video_dir / f"eval_step_{step}.mp4").write_bytes(b"not a real mp4: the report only copies and links it")
    return run_dir


def run_name(exp: str, seed: int) -> str:
    return f"Hopper-v5__{exp}__{seed}__1700000000"


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic")
    dirs = {}
    for (exp, surf, seed), returns in RETURNS.items():
        evals = dict(zip(STEPS, returns))
        finished = len(returns) == len(STEPS)
        summary = (
            {
                "run_name": run_name(exp, seed),
                "env_id": "Hopper-v5",
                "global_step": 1000,
                "final_eval_return": returns[-1],
                "labels_obtained": 30,
                "wall_seconds": 10.0 + seed,
                "sps": 100.0 * seed,
                "interrupted": False,
            }
            if finished
            else None
        )
        args = {"exp_name": exp, "env_id": "Hopper-v5", "seed": seed, "surf": surf, "teacher_feedback_total_queries": 30}
        dirs[(exp, seed)] = write_run(root, run_name(exp, seed), args, evals, True, summary, sps=40.0 + seed)
    return root, dirs


@pytest.fixture(scope="module")
def report(synthetic):
    root, dirs = synthetic
    # The SURF runs first: the groups (and the probability of improvement) follow the command line's order.
    order = [dirs[("hop_surf", s)] for s in (1, 2, 3)] + [dirs[("hop_nosurf", s)] for s in (1, 2)]
    args = compare.Args(runs=[str(d) for d in order], out=str(root / "report"), group_by="surf", bootstrap_reps=REPS)
    return args, compare.main(args)


def read_csv(path: Path) -> list[dict]:
    with path.open() as file:
        return list(csv.DictReader(file))


def rliable_estimate(scores: np.ndarray, aggregate, seed: int = 0):
    from rliable import library as rly

    np.random.seed(seed)  # noqa: NPY002 (rliable's bootstrap draws from numpy's global generator)
    points, intervals = rly.get_interval_estimates({"x": scores}, aggregate, reps=REPS)
    return points["x"][0], intervals["x"][0, 0], intervals["x"][1, 0]


class Sources(HTMLParser):
    def __init__(self):
        super().__init__()
        self.images, self.videos = [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img":
            self.images.append(attrs["src"])
        if tag == "video":
            self.videos.append(attrs["src"])


def html_sources(path: Path) -> Sources:
    parser = Sources()
    parser.feed(path.read_text())
    return parser


def test_csv_has_every_run_and_group_with_the_logged_numbers(report):
    args, result = report
    rows = read_csv(result["csv"])
    runs = {row["run"]: row for row in rows if row["row"] == "run"}
    assert len(runs) == 5
    for (exp, surf, seed), returns in RETURNS.items():
        row = runs[run_name(exp, seed)]
        assert row["group"] == f"surf={surf}" and row["seed"] == str(seed)
        assert float(row["final_return"]) == returns[-1]
        assert row["final_step"] == str(STEPS[len(returns) - 1])
        if len(returns) == len(STEPS):
            assert (row["status"], row["global_step"], row["labels_obtained"]) == ("finished", "1000", "30")
            assert float(row["wall_seconds"]) == 10.0 + seed and float(row["sps"]) == 100.0 * seed
        else:  # still running: its latest evaluation, labels and SPS, and the event files' time span
            assert (row["status"], row["global_step"], row["labels_obtained"]) == ("running", "500", "20")
            assert float(row["sps"]) == 40.0 + seed and float(row["wall_seconds"]) >= 0
    groups = {row["group"]: row for row in rows if row["row"] == "group"}
    assert list(groups) == ["surf=True", "surf=False"]
    assert groups["surf=True"]["num_runs"] == "3" and groups["surf=False"]["num_runs"] == "2"
    assert float(groups["surf=False"]["final_return"]) == (310.0 + 42.75) / 2
    assert float(groups["surf=False"]["wall_seconds"]) == 11.5  # mean of 11 and 12


def test_iqm_mean_and_probability_of_improvement_match_rliable(report):
    from rliable import library as rly
    from rliable import metrics

    args, result = report
    groups = {row["group"]: row for row in read_csv(result["csv"]) if row["row"] == "group"}
    scores = {
        "surf=True": np.array([[900.5], [780.25], [200.75]]),
        "surf=False": np.array([[310.0], [42.75]]),
    }
    for group, matrix in scores.items():
        iqm = rliable_estimate(matrix, lambda s: np.array([metrics.aggregate_iqm(s)]))
        mean = rliable_estimate(matrix, lambda s: np.array([metrics.aggregate_mean(s)]))
        row = groups[group]
        assert (float(row["iqm"]), float(row["iqm_ci_low"]), float(row["iqm_ci_high"])) == iqm
        assert (float(row["final_return"]), float(row["mean_ci_low"]), float(row["mean_ci_high"])) == mean

    np.random.seed(0)  # noqa: NPY002
    points, intervals = rly.get_interval_estimates(
        {"p": [scores["surf=True"], scores["surf=False"]]}, metrics.probability_of_improvement, reps=REPS
    )
    [(x, y, (point, low, high))] = result["pairs"]
    assert (x, y) == ("surf=True", "surf=False")
    assert point == metrics.probability_of_improvement(scores["surf=True"], scores["surf=False"]) == points["p"]
    assert [low, high] == np.ravel(intervals["p"]).tolist()


def test_pngs_are_images_of_the_figure_size(report):
    from PIL import Image

    _, result = report
    names = {path.name for path in result["plots"]}
    assert names == {
        "return_vs_steps.png",
        "return_vs_labels.png",
        "reward_model_vs_labels.png",
        "final_performance.png",
        "probability_of_improvement.png",
    }
    for path in result["plots"]:
        assert path.stat().st_size > 5000
        with Image.open(path) as image:
            assert image.format == "PNG"
            assert image.size == (compare.FIG_SIZE[0] * compare.DPI, compare.FIG_SIZE[1] * compare.DPI)
            assert len(set(image.convert("L").getdata())) > 10, f"{path.name} is blank"


def test_html_references_every_plot_and_the_two_videos(report):
    args, result = report
    html_path = result["html"]
    sources = html_sources(html_path)
    assert sorted(sources.images) == sorted(path.name for path in result["plots"])
    # Default videos: the best and the worst final return, at the largest step both have a video for.
    best, worst = run_name("hop_surf", 1), run_name("hop_nosurf", 2)
    assert sources.videos == [f"videos/{best}/eval_step_1000.mp4", f"videos/{worst}/eval_step_1000.mp4"]
    for source in sources.images + sources.videos + ["summary.csv"]:
        assert (html_path.parent / source).is_file(), source
    text = html_path.read_text()
    assert "surf=True" in text and "still running" in text


def test_same_seed_same_report_through_the_cli(report, tmp_path):
    args, result = report
    out = tmp_path / "cli_report"
    command = [sys.executable, str(REPO_ROOT / "toolbox/compare.py"), *args.runs, "--group-by", "surf", "--out", str(out)]
    command += ["--bootstrap-reps", str(REPS), "--video-runs", run_name("hop_surf", 3), run_name("hop_nosurf", 1)]
    completed = subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=120)
    assert completed.returncode == 0, completed.stderr
    assert "P(surf=True > surf=False)" in completed.stdout and "hop_surf" in completed.stdout
    assert (out / "summary.csv").read_text() == result["csv"].read_text()
    # Chosen runs: the running one has videos up to step 500 only.
    assert html_sources(out / "index.html").videos == [
        f"videos/{run_name('hop_surf', 3)}/eval_step_500.mp4",
        f"videos/{run_name('hop_nosurf', 1)}/eval_step_500.mp4",
    ]


def test_default_grouping_pattern_and_curves(synthetic, tmp_path):
    root, dirs = synthetic
    runs = compare.load_runs([str(root / "runs")])  # a folder of run folders
    assert compare.assign_groups(runs) == ["hop_nosurf", "hop_surf"]  # exp_name: the run name without seed and time
    assert compare.assign_groups(runs, group_pattern=r"__hop_(\w+?)__") == ["nosurf", "surf"]
    surf = [run for run in runs if run.group == "surf"]
    grid, matrix = compare.align([run.curve("eval/mean_return") for run in surf])
    assert grid.tolist() == STEPS and np.isnan(matrix[2, 3:]).all()  # the running seed stops at 500
    assert compare.align([run.curve("eval/mean_return") for run in surf], common_only=True)[0].tolist() == STEPS[:3]
    assert surf[0].labels_at(np.array([0, 249, 250, 600, 1000])).tolist() == [0, 0, 10, 20, 30]
    assert compare.default_group(runs[0], single_env=False) == "Hopper-v5__hop_nosurf"
    custom = compare.Run("hopper_surf_3", Path("x"), {"seed": 3}, None, {}, math.nan)
    assert compare.default_group(custom, single_env=True) == "hopper_surf"


def test_baseline_without_labels_only_plots_against_steps(tmp_path):
    evals = {0: 1.0, 500: 50.0, 1000: 80.0}
    summary = {"run_name": "base", "env_id": "Hopper-v5", "global_step": 1000, "final_eval_return": 80.0, "wall_seconds": 5.0, "sps": 200.0}
    write_run(tmp_path, "sac_base_1", {"exp_name": "sac", "env_id": "Hopper-v5", "seed": 1}, evals, False, summary, sps=1.0)
    result = compare.main(compare.Args(runs=[str(tmp_path / "runs")], out=str(tmp_path / "out"), bootstrap_reps=REPS))
    assert [path.name for path in result["plots"]] == ["return_vs_steps.png", "final_performance.png"]
    [run_row, group_row] = read_csv(result["csv"])
    assert run_row["group"] == "sac_base" and run_row["labels_obtained"] == "" and float(run_row["final_return"]) == 80.0
    assert float(group_row["iqm"]) == 80.0 and result["pairs"] == []


def cli_error(*arguments: str) -> subprocess.CompletedProcess:
    completed = subprocess.run(
        [sys.executable, str(REPO_ROOT / "toolbox/compare.py"), *arguments], capture_output=True, text=True, env=ENV, timeout=120
    )
    assert completed.returncode != 0
    assert len(completed.stderr.strip().splitlines()) == 1, completed.stderr
    return completed


def test_folder_without_event_files_is_one_clear_error(tmp_path):
    empty = tmp_path / "not_a_run"
    empty.mkdir()
    (empty / "notes.txt").write_text("no events here")
    completed = cli_error(str(empty), "--out", str(tmp_path / "out"))
    assert completed.stderr.startswith("error: ") and str(empty) in completed.stderr and "no TensorBoard event files" in completed.stderr
    assert not (tmp_path / "out").exists()


def test_unknown_group_by_field_names_it_and_the_allowed_fields(synthetic, tmp_path):
    root, dirs = synthetic
    completed = cli_error(str(dirs[("hop_surf", 1)]), "--group-by", "suurf", "--out", str(tmp_path / "out"))
    assert "'suurf'" in completed.stderr and "surf" in completed.stderr.split("allowed fields")[1] and "seed" in completed.stderr


def test_tiny_sac_rlhf_runs_compared(chdir_tmp):
    """Two seeds of a real (tiny) PEBBLE run with evaluation videos, then the report on them. The runs go through
    sac_rlhf.main in this process (as `python framework/sac_rlhf.py` from this folder would): no second start-up."""
    import sac_rlhf

    for seed in (1, 2):
        sac_rlhf.main(
            sac_rlhf.Args(
                exp_name="tiny",
                seed=seed,
                total_timesteps=600,
                learning_starts=100,
                total_explore_steps=200,
                teacher_feedback_total_queries=20,
                teacher_feedback_num_queries_per_session=10,
                teacher_feedback_frequency=200,
                segment_length=20,
                max_augmentation_offset=5,
                min_augmentation_offset=2,
                batch_size=32,
                actor_hidden_dim=32,
                critic_hidden_dim=32,
                reward_net_hidden_dim=32,
                reward_net_epochs=3,
                explore_knn_sample_size=200,
                evaluation_frequency=300,
                evaluation_episodes=1,
                checkpoint_frequency=0,
                progress_bar=False,
                capture_video=True,
                video_width=128,  # small frames: software rendering of the videos is most of a tiny run's time
                video_height=96,
            )
        )

    result = compare.main(compare.Args(runs=["runs"], out="report", bootstrap_reps=REPS))
    rows = read_csv(result["csv"])
    runs = [row for row in rows if row["row"] == "run"]
    assert [(row["group"], row["seed"], row["status"], row["global_step"]) for row in runs] == [
        ("tiny", "1", "finished", "600"),
        ("tiny", "2", "finished", "600"),
    ]
    for row in runs:
        summary = json.loads((chdir_tmp / "runs" / row["run"] / "summary.json").read_text())
        assert float(row["final_return"]) == summary["final_eval_return"] and row["labels_obtained"] == "20"
    sources = html_sources(result["html"])
    assert len(sources.images) == 4 and len(sources.videos) == 2  # one group: no probability of improvement
    assert all(source.endswith("eval_step_600.mp4") for source in sources.videos)
    for source in sources.images + sources.videos:
        assert (result["html"].parent / source).stat().st_size > 1000
