"""The seed project's README is the interface people arrive with: every command line in it works as written, where a
name changed spelt as today's. The commands, each beside what it runs here (SEED_COMMANDS), from the framework folder
as the seed ran them, cut to a few hundred steps where they train:

- `poetry run python3 X.py` is the venv's python (the Quick start's install; tests/test_first_run.py runs `poetry
  install` on a clean clone);
- `<PLACEHOLDER>`s get values, `models/myrun/10000/` is the exploration checkpoint of a run that explored 200 steps;
- the feedback server and the trainer meet on a free port instead of 5001 (other tests may hold it);
- sweep.py's W&B commands run up to W&B, which needs an account this machine has not: they stop there in one line,
  and the same sweep runs a trial on the local backend;
- not run: `git clone` and `wandb login` (the network), `sh setup_venv.sh` (installs Miniconda), `sh start_job.sh`
  and `squeue` (tests/test_slurm.py runs a SLURM array job)."""

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from cleanrlhf_utils.cli import command_line_args

REPO = Path(__file__).resolve().parents[1]
FRAMEWORK = REPO / "framework"

SEED_COMMANDS = {
    "train": "poetry run python3 sac_rlhf.py --env-id Hopper-v5",
    "headless": "xvfb-run -- python3 sac_rlhf.py --env-id Hopper-v5",
    "human": "poetry run python3 sac_rlhf.py --teacher-feedback-mode human",
    "server-url": "poetry run python3 sac_rlhf.py --feedback-server-url remoteurl:1234",
    "server": "python3 humanFeedback/feedback_server.py",
    "help": "poetry run python3 sac_rlhf.py -h",
    "video": "poetry run python3 sac_rlhf.py --capture-video",
    "watch": "poetry run python3 sac_rlhf.py --render-mode human",
    "exploration-load": "poetry run python3 sac_rlhf.py --exploration-load --path-to-replay-buffer "
    "models/myrun/10000/replay_buffer.pth --path-to-model models/myrun/10000/checkpoint.pth",
    "evaluation": "poetry run python3 evaluation.py --path-to-model <PATH> --env-id <ENV_ID>",
    "track": "poetry run python3 sac_rlhf.py --track  --wandb-project-name <PROJECT_NAME> --wandb-entity <WANDB_ENTITY>",
    "tensorboard": "tensorboard --logdir=runs",
    "sweep": "poetry run python3 sweep.py --project-name <PROJECT_NAME> --entity <WANDB_ENTITY> --sweep-count <N_RUNS> "
    "--config-filename ./sweep_config/<SWEEP_NAME>.yaml --algorithm <ALGORITHM>",
    "sweep-join": "poetry run python3 sweep.py --project-name --sweep_id <SWEEP_ID> --sweep_count 3 --algorithm <ALGORITHM>",
}
"""the seed README's command lines that run this project's code, by a short name"""

# The seed's flags from its feature tables (SURF, RUNE, sampling, schedule, exploration, the server).
SEED_TABLE_FLAGS = [
    ["--unlabeled-batch-ratio", "1"], ["--surf-sampling-strategy", "uniform"], ["--surf-tau", "0.999"],
    ["--lambda-ssl", "0.1"], ["--max-augmentation-offset", "10"], ["--min-augmentation-offset", "5"], ["--rune"],
    ["--rune-beta", "0.05"], ["--rune-beta-decay", "0.0001"], ["--no-unsupervised-exploration"],
    ["--preference-sampling", "entropy"], ["--teacher-feedback-schedule", "linear"], ["--no-surf"],
    ["--feedback-server-autostart"],
]  # fmt: skip

SHORT = [
    *["--total-timesteps", "300", "--learning-starts", "100", "--total-explore-steps", "200"],
    *["--teacher-feedback-frequency", "50", "--teacher-feedback-total-queries", "20"],
    *["--teacher-feedback-num-queries-per-session", "10", "--segment-length", "20", "--max-augmentation-offset", "5"],
    *["--min-augmentation-offset", "2", "--batch-size", "32", "--actor-hidden-dim", "32", "--critic-hidden-dim", "32"],
    *["--reward-net-hidden-dim", "32", "--reward-net-epochs", "3", "--explore-knn-sample-size", "200"],
    *["--evaluation-frequency", "0", "--evaluation-episodes", "1", "--no-progress-bar"],
]
"""a few hundred steps: 100 random, 100 exploring, sessions of 10 labels at steps 200 and 250"""


def seed_argv(name: str) -> list[str]:
    """A seed command's arguments after its script, as written."""
    words = SEED_COMMANDS[name].split()
    script = next(i for i, word in enumerate(words) if word.endswith(".py"))
    return words[script + 1 :]


def filled(argv: list[str], placeholders: dict[str, str]) -> list[str]:
    """argv with each <PLACEHOLDER> given its value, also inside a word (./sweep_config/<SWEEP_NAME>.yaml)."""
    for placeholder, value in placeholders.items():
        argv = [word.replace(placeholder, value) for word in argv]
    return argv


def run(argv: list[str], cwd: Path, timeout: int = 600, **env) -> subprocess.CompletedProcess:
    environment = os.environ | {"WANDB_MODE": "offline"} | env
    environment = {key: value for key, value in environment.items() if value is not None}
    return subprocess.run(argv, cwd=cwd, env=environment, capture_output=True, text=True, timeout=timeout)


def framework_copy(tmp_path: Path) -> Path:
    """A folder to run the framework's scripts from, as the seed did (`python3 sac_rlhf.py` in framework/), whose
    runs/, models/ and videos/ land in tmp_path: the scripts themselves are linked."""
    folder = tmp_path / "framework"
    folder.mkdir()
    for path in FRAMEWORK.glob("*.py"):
        (folder / path.name).symlink_to(path)
    return folder


# ----------------------------------------------------------------------------------------
# Read as today's flags
# ----------------------------------------------------------------------------------------
def test_the_seeds_flags_parse_as_todays_settings(tmp_path):
    import sac_rlhf

    for flags in SEED_TABLE_FLAGS:
        command_line_args(sac_rlhf.Args, flags)
    assert command_line_args(sac_rlhf.Args, seed_argv("server-url")).feedback_server_url == "http://remoteurl:1234"
    assert command_line_args(sac_rlhf.Args, seed_argv("watch")).render_mode == "human"
    assert command_line_args(sac_rlhf.Args, ["--surf-sampling-strategy", "disagree"]).surf_sampling_strategy == "disagree"
    loaded = command_line_args(sac_rlhf.Args, seed_argv("exploration-load"))
    assert loaded.exploration_from == "models/myrun/10000"  # the folder a run keeps both files in
    tracked = command_line_args(sac_rlhf.Args, ["--track", "--wandb-project-name", "P", "--wandb-entity", "E"])
    assert (tracked.track, tracked.wandb_project_name, tracked.wandb_entity) == (True, "P", "E")


def test_an_incomplete_exploration_load_is_one_line_naming_todays_spelling():
    result = run([sys.executable, "sac_rlhf.py", "--exploration-load", "--path-to-model", "m/1/checkpoint.pth"], FRAMEWORK)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "--exploration-load, --path-to-model and --path-to-replay-buffer come together" in result.stderr
    assert "--exploration-from models/<run>/<step>" in result.stderr
    apart = ["--exploration-load", "--path-to-model", "a/1/checkpoint.pt", "--path-to-replay-buffer", "b/1/replay_buffer.npz"]
    result = run([sys.executable, "sac_rlhf.py", *apart], FRAMEWORK)
    assert result.returncode == 2 and "must be in one folder" in result.stderr
    result = run([sys.executable, "sac_rlhf.py", "--path-to-model", "m/1/checkpoint.pth"], FRAMEWORK)  # not the seed's
    assert result.returncode == 2 and "unknown flag --path-to-model" in result.stderr


def test_watching_without_a_display_is_refused_in_one_line(tmp_path):
    result = run([sys.executable, "sac_rlhf.py", *seed_argv("watch")], framework_copy(tmp_path), DISPLAY=None, WAYLAND_DISPLAY=None)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: --render-mode human opens a window, and there is no display: run under xvfb-run, or use --capture-video"
    ]


def test_help_shows_the_flags_in_titled_groups_the_first_to_set_first():
    result = run([sys.executable, "sac_rlhf.py", *seed_argv("help")], FRAMEWORK)
    assert result.returncode == 0
    titles = [line.split("─")[1].strip() for line in result.stdout.splitlines() if line.startswith("╭─")]
    assert titles[:2] == ["options", "start here options"] and len(titles) >= 6, titles
    first = result.stdout.split("start here options")[1].split("╰")[0]
    for flag in ("--env-id", "--total-timesteps", "--preset", "--teacher-feedback-mode", "--teacher-objective"):
        assert flag in first


# ----------------------------------------------------------------------------------------
# Run: a few hundred steps each
# ----------------------------------------------------------------------------------------
def test_train_explore_load_and_evaluate_as_the_seed_did(tmp_path):
    """The seed's training command (named myrun), its exploration checkpoint loaded with the seed's spelling, and the
    trained model evaluated with the seed's evaluation.py command."""
    folder = framework_copy(tmp_path)
    trained = run([sys.executable, "sac_rlhf.py", *seed_argv("train"), *SHORT, "--run-name", "myrun"], folder)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "run myrun done at step 300" in trained.stdout and "20 labels" in trained.stdout
    saved = folder / "models" / "myrun" / "200"  # the end of its exploration, which the seed loaded from
    (saved.parent / "10000").symlink_to(saved)
    loaded = run([sys.executable, "sac_rlhf.py", *seed_argv("exploration-load"), *SHORT, "--run-name", "loaded"], folder)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert "loaded exploration checkpoint at step 200" in loaded.stdout and "run loaded done at step 300" in loaded.stdout
    placeholders = {"<PATH>": "models/myrun/latest", "<ENV_ID>": "Hopper-v5"}
    argv = filled(seed_argv("evaluation"), placeholders)
    evaluated = run([sys.executable, "evaluation.py", *argv], folder)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert "Hopper-v5" in evaluated.stdout and "10 episodes" in evaluated.stdout


@pytest.mark.parametrize("name", ["server-url", "video", "track"])
def test_a_seed_command_trains(name, tmp_path):
    folder = framework_copy(tmp_path)
    placeholders = {"<PROJECT_NAME>": "seed", "<WANDB_ENTITY>": "someone"}
    argv = filled(seed_argv(name), placeholders)
    result = run([sys.executable, "sac_rlhf.py", *argv, *SHORT, "--run-name", name], folder)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"run {name} done at step 300" in result.stdout
    if name == "video":
        assert list((folder / "videos" / name).rglob("*.mp4"))
    if name == "track":
        assert list((folder / "runs" / name / "wandb").glob("offline-run-*"))


@pytest.mark.skipif(shutil.which("xvfb-run") is None, reason="xvfb-run is not installed (dev/install_test_deps.sh installs it)")
@pytest.mark.parametrize("name", ["headless", "watch"])
def test_a_seed_command_trains_under_xvfb_run(name, tmp_path):
    """The seed's headless line, and --render-mode human drawing every step in a window on Xvfb's display."""
    folder = framework_copy(tmp_path)
    argv = seed_argv(name)
    result = run(["xvfb-run", "-a", "--", sys.executable, "sac_rlhf.py", *argv, *SHORT, "--run-name", name], folder, MUJOCO_GL=None)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"run {name} done at step 300" in result.stdout


def test_human_mode_as_the_seed_ran_it_with_the_server_started_by_hand(tmp_path):
    """`python3 humanFeedback/feedback_server.py` from the repository's top folder, then the trainer in human mode; a
    person's answers come over HTTP with the server's token, as the page sends them."""
    from test_human_feedback import free_port

    folder, port = framework_copy(tmp_path), free_port()
    server = subprocess.Popen(
        [sys.executable, str(REPO / "humanFeedback" / "feedback_server.py"), "--port", str(port)],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    token_file = tmp_path / "feedback_data" / "token"  # a server started by hand keeps its token in its data folder
    base, answered, stop = f"http://localhost:{port}", [], threading.Event()

    def person() -> None:
        while not token_file.is_file() and not stop.is_set():
            time.sleep(0.1)
        http = requests.Session()
        http.headers["X-Feedback-Token"] = token_file.read_text().strip()
        while not stop.is_set():
            try:
                query = http.get(f"{base}/api/next", params={"annotator": "seed"}, timeout=5).json()
            except requests.ConnectionError:
                time.sleep(0.1)
                continue
            if query.get("waiting"):
                time.sleep(0.1)
                continue
            reply = http.post(f"{base}/api/queries/{query['query_id']}/label", json={"choice": "left", "annotator": "seed"}, timeout=5)
            answered.append(reply.status_code)

    labeller = threading.Thread(target=person, daemon=True)
    labeller.start()
    try:
        deadline = time.monotonic() + 60
        while not token_file.is_file() and time.monotonic() < deadline:
            time.sleep(0.2)
        argv = [*seed_argv("human"), *SHORT, "--run-name", "human", "--feedback-server-url", base]
        argv += ["--clip-width", "96", "--clip-height", "72", "--feedback-check-clips", "0"]
        result = run([sys.executable, "sac_rlhf.py", *argv], folder, FEEDBACK_SERVER_TOKEN=token_file.read_text().strip())
    finally:
        stop.set()
        server.terminate()
        server.wait(timeout=30)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "run human done at step 300" in result.stdout and "20 labels" in result.stdout
    assert answered.count(201) == 20


def test_tensorboard_serves_the_runs_folder(tmp_path):
    from test_human_feedback import free_port

    (tmp_path / "runs").mkdir()
    port = free_port()
    argv = [*SEED_COMMANDS["tensorboard"].split(), "--port", str(port), "--host", "127.0.0.1"]
    process = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if requests.get(f"http://127.0.0.1:{port}/", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                time.sleep(0.5)
        else:
            pytest.fail("tensorboard did not answer within 120 s")
    finally:
        process.terminate()
        process.wait(timeout=30)


# ----------------------------------------------------------------------------------------
# Sweeps: W&B's up to W&B, and the same sweep on the local backend
# ----------------------------------------------------------------------------------------
SWEEP_PLACEHOLDERS = {
    "<PROJECT_NAME>": "seed", "<WANDB_ENTITY>": "someone", "<N_RUNS>": "1", "<SWEEP_NAME>": "hopper",
    "<ALGORITHM>": "sac-rlhf", "<SWEEP_ID>": "abc123",
}  # fmt: skip


def sweep_argv(name: str) -> list[str]:
    argv = filled(seed_argv(name), SWEEP_PLACEHOLDERS)
    if name == "sweep-join":  # the seed's line gives --project-name no value: the placeholder it left out
        argv.insert(argv.index("--project-name") + 1, "seed")
    return argv


@pytest.mark.parametrize("name", ["sweep", "sweep-join"])
def test_the_seeds_wandb_sweep_commands_run_up_to_wandb_and_say_what_it_needs(name, tmp_path):
    (tmp_path / "sweep_config").symlink_to(REPO / "sweep_config")
    result = run([sys.executable, str(FRAMEWORK / "sweep.py"), *sweep_argv(name)], tmp_path, WANDB_API_KEY=None)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr[-2000:]
    assert "wandb login" in result.stderr


def test_the_seeds_sweep_runs_a_trial_on_the_local_backend(tmp_path):
    (tmp_path / "sweep_config").symlink_to(REPO / "sweep_config")
    swept = {"--segment-length", "--teacher-feedback-num-queries-per-session"}  # the sweep samples these
    flags = [word for i, word in enumerate(SHORT) if word not in swept and SHORT[i - 1] not in swept]
    argv = [*sweep_argv("sweep"), "--backend", "optuna", "--storage", "sqlite:///sweeps.db", "--", *flags]
    result = run([sys.executable, str(FRAMEWORK / "sweep.py"), *argv], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "sweeps.db").is_file()
