"""What a newcomer meets first: the outputs README commands make stay out of git, a resumed run's summary counts the
whole run."""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import gymnasium as gym
import pytest

from cleanrlhf_utils.cli import RunInterrupted, command_line_args, resume_command

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "toolbox"))

from test_end_to_end import small_args  # noqa: E402
from test_pref_ppo import hopper_args  # noqa: E402
from test_sweep import config_with, parse  # noqa: E402

import compare  # noqa: E402
import pref_ppo  # noqa: E402
import sac_rlhf  # noqa: E402
import sweep  # noqa: E402


def ignored(path: str) -> bool:
    """Whether git ignores `path` (relative to the repository root) by this checkout's .gitignore."""
    return subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=REPO).returncode == 0


def test_default_outputs_of_the_toolbox_and_the_sweeps_are_ignored():
    report = compare.Args(runs=[]).out
    storage = sweep.Args().storage
    assert storage.startswith("sqlite:///")
    database = storage.removeprefix("sqlite:///")
    for path in (f"{report}/index.html", f"{report}/videos/run/eval.mp4", database, f"{database}-journal"):
        assert ignored(path), f"{path} (made by a README command) is not in .gitignore"
    assert not ignored("framework/sac_rlhf.py")


# ----------------------------------------------------------------------------------------
# A resumed run's summary counts the whole run's wall time, not only the resumed part's
# ----------------------------------------------------------------------------------------
def run_in_two_parts(script, make_args, first_steps: int, total_steps: int) -> tuple[float, float, float]:
    """wall_seconds of the first part's summary, of the resumed run's, and the seconds the resume call took."""
    script.main(make_args("cut", total_timesteps=first_steps, torch_threads=1))
    first = json.loads(Path("runs/cut/summary.json").read_text())["wall_seconds"]
    started = time.time()
    script.main(make_args("cut", total_timesteps=total_steps, torch_threads=1, resume="models/cut/latest"))
    resume_seconds = time.time() - started
    whole = json.loads(Path("runs/cut/summary.json").read_text())["wall_seconds"]
    return first, whole, resume_seconds


def test_pebble_wall_seconds_after_resume_count_the_whole_run(chdir_tmp):
    # The first part (exploration and a feedback session, 700 steps) takes far longer than the resumed 100 steps.
    first, whole, resume_seconds = run_in_two_parts(sac_rlhf, small_args, 700, 800)
    assert first <= whole <= first + resume_seconds, (first, whole, resume_seconds)


def test_pref_ppo_wall_seconds_after_resume_count_the_whole_run(chdir_tmp):
    # Four iterations (two exploring, one feedback session), then one more.
    first, whole, resume_seconds = run_in_two_parts(pref_ppo, hopper_args, 2048, 2560)
    assert first <= whole <= first + resume_seconds, (first, whole, resume_seconds)


# ----------------------------------------------------------------------------------------
# Human mode asks a person for tens of labels a session, not hundreds, unless told otherwise
# ----------------------------------------------------------------------------------------
HUMAN_SESSION_CAP = 25  # pairs a person answers in a few minutes
HUMAN_RUN_CAP = 200


@pytest.mark.parametrize("script", [sac_rlhf, pref_ppo], ids=["sac_rlhf", "pref_ppo"])
def test_human_mode_defaults_ask_a_person_for_tens_of_labels_a_session(script, capsys):
    args = command_line_args(script.Args, ["--teacher-feedback-mode", "human"])
    sessions = feedback_sessions(script, args)
    assert sessions[0] <= HUMAN_SESSION_CAP and max(sessions) == sessions[0], sessions
    assert sum(sessions) <= HUMAN_RUN_CAP
    lines = capsys.readouterr().out.splitlines()
    said = [line for line in lines if line.startswith("human mode:")]
    assert len(said) == 1, lines
    assert f"{sum(sessions)} labels" in said[0] and f"{sessions[0]} in the first" in said[0]
    assert "--teacher-feedback-total-queries" in said[0] and "--teacher-feedback-num-queries-per-session" in said[0]


@pytest.mark.parametrize("script", [sac_rlhf, pref_ppo], ids=["sac_rlhf", "pref_ppo"])
def test_an_explicit_label_budget_wins_over_human_defaults(script, capsys):
    args = command_line_args(script.Args, ["--teacher-feedback-mode=human", "--teacher-feedback-total-queries", "1000"])
    assert args.teacher_feedback_total_queries == 1000  # the user's
    assert args.teacher_feedback_num_queries_per_session <= HUMAN_SESSION_CAP  # not given: human-sized
    capsys.readouterr()
    both = ["--teacher-feedback-num-queries-per-session=100", "--teacher-feedback-total-queries", "1000"]
    args = command_line_args(script.Args, ["--teacher-feedback-mode", "human", *both])
    assert feedback_sessions(script, args) == feedback_sessions(script, script.Args())  # the defaults' 224 first
    assert "human mode:" not in capsys.readouterr().out  # nothing was changed, nothing to say
    # Other teachers keep the defaults.
    assert command_line_args(script.Args, []) == script.Args()
    assert command_line_args(script.Args, ["--teacher-feedback-mode", "file"]) == script.Args(teacher_feedback_mode="file")


def feedback_sessions(script, args) -> list[int]:
    """The queries of each feedback session a run of `args` asks (its schedule)."""
    return script.feedback_schedule(
        args.teacher_feedback_total_queries, args.teacher_feedback_num_queries_per_session,
        args.teacher_feedback_schedule, args.teacher_feedback_exponential_decay,
    )  # fmt: skip


def test_the_script_applies_human_defaults_from_its_command_line(tmp_path):
    """Through the real CLI: the line is printed before the run starts (here refused for its env id, nothing written)."""
    command = [sys.executable, str(REPO / "framework/pref_ppo.py"), "--teacher-feedback-mode", "human", "--env-id", "Nope-v0"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=os.environ | {"WANDB_MODE": "offline"})
    assert done.returncode == 2
    assert done.stdout.splitlines()[0].startswith("human mode: 100 labels over 10 sessions, 22 in the first"), done.stdout
    assert done.stderr.splitlines()[-1].startswith("error: --env-id Nope-v0"), done.stderr


# ----------------------------------------------------------------------------------------
# A run says its name and where its outputs go; Ctrl-C says the command that resumes it, and that command does
# ----------------------------------------------------------------------------------------
TINY_PEBBLE = [
    "--env-id", "Hopper-v5", "--total-timesteps", "1800", "--learning-starts", "200", "--total-explore-steps", "400",
    "--teacher-feedback-total-queries", "20", "--teacher-feedback-num-queries-per-session", "10",
    "--teacher-feedback-frequency", "600", "--segment-length", "20", "--max-augmentation-offset", "5",
    "--min-augmentation-offset", "2", "--batch-size", "64", "--actor-hidden-dim", "64", "--critic-hidden-dim", "64",
    "--reward-net-hidden-dim", "64", "--reward-net-epochs", "5", "--explore-knn-sample-size", "500",
    "--evaluation-frequency", "0", "--evaluation-episodes", "1", "--checkpoint-frequency", "0", "--no-progress-bar",
    "--torch-threads", "1",
]  # fmt: skip


def startup_line(stdout: str) -> tuple[str, str]:
    """The run name of the start-up line, and the line (the closing line, `run <name> done at ...`, is not it)."""
    lines = [line for line in stdout.splitlines() if line.startswith("run ") and ": logs and summary in " in line]
    assert len(lines) == 1, stdout
    return lines[0].split()[1].rstrip(":"), lines[0]


@pytest.mark.parametrize(("stop", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_prints_the_command_that_resumes_the_run(tmp_path, stop, code):
    """Ctrl-C, and SIGTERM as SLURM sends it at a job's time limit or a preemption, both save the run and say how to
    resume it (killed on the spot, it would keep only its last periodic checkpoint and orphan an autostarted server)."""
    script = REPO / "framework/sac_rlhf.py"
    env = os.environ | {"WANDB_MODE": "offline"}
    # A terminal delivers Ctrl-C to a run whose SIGINT is at its default. A suite started in the background by a
    # non-interactive shell passes SIGINT on ignored, and the run may keep it so: a CI started with
    # `(nohup bash .ci/run &)` lost the signal once. Start the run as a terminal would.
    process = subprocess.Popen(
        [sys.executable, str(script), *TINY_PEBBLE], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    deadline = time.time() + 300
    while not list(tmp_path.glob("models/*/400/checkpoint.pt")) and process.poll() is None and time.time() < deadline:
        time.sleep(0.05)  # exploration is over (its checkpoint is written): Ctrl-C in the middle of learning
    process.send_signal(stop)
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == code, (stdout, stderr)
    run_name, line = startup_line(stdout)
    assert line == f"run {run_name}: logs and summary in runs/{run_name}, checkpoints in models/{run_name}"
    assert (tmp_path / "runs" / run_name / "summary.json").is_file() and (tmp_path / "models" / run_name / "latest").is_dir()
    interrupted_at = json.loads((tmp_path / "runs" / run_name / "summary.json").read_text())["global_step"]
    assert 400 <= interrupted_at < 1800
    said = [line for line in stdout.splitlines() if line.startswith("to resume: ")]
    assert len(said) == 1, stdout
    command = shlex.split(said[0].removeprefix("to resume: "))
    assert Path(shutil.which(command[0])).resolve() == Path(sys.executable).resolve()
    assert command[1:] == [str(script), *TINY_PEBBLE, "--resume", f"models/{run_name}/latest"]

    resumed = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed {run_name} at step {interrupted_at} with" in resumed.stdout
    assert startup_line(resumed.stdout)[0] == run_name
    summary = json.loads((tmp_path / "runs" / run_name / "summary.json").read_text())
    assert summary["global_step"] == 1800 and not summary["interrupted"]


def test_pref_ppo_says_its_outputs_and_stops_at_ctrl_c_with_its_checkpoint(chdir_tmp, monkeypatch, capsys):
    """PrefPPO's end of the same path (in-process): the start-up line, and Ctrl-C raises the checkpoint to resume from,
    which the command line turns into the resume command."""
    calls, real_step = [0], gym.vector.SyncVectorEnv.step

    def step(self, actions):
        calls[0] += 1
        if calls[0] == 900:  # in the 4th rollout, after the first feedback session
            raise KeyboardInterrupt
        return real_step(self, actions)

    monkeypatch.setattr(gym.vector.SyncVectorEnv, "step", step)
    with pytest.raises(RunInterrupted) as interrupt:
        pref_ppo.main(hopper_args("part", capture_video=True, torch_threads=1))
    assert interrupt.value.checkpoint == Path("models/part/latest")
    assert (interrupt.value.checkpoint / "checkpoint.pt").is_file()
    out = capsys.readouterr().out
    assert "run part: logs and summary in runs/part, checkpoints in models/part, videos in videos/part" in out.splitlines()
    command = resume_command(
        ["framework/pref_ppo.py", "--run-name", "part", "--resume=models/old", "--seed", "2"], interrupt.value.checkpoint
    )
    assert shlex.split(command)[1:] == ["framework/pref_ppo.py", "--run-name", "part", "--seed", "2", "--resume", "models/part/latest"]


@pytest.mark.parametrize("baseline", ["sac", "ppo"])
def test_baselines_say_their_name_and_outputs(chdir_tmp, capsys, baseline):
    import ppo
    import sac

    if baseline == "sac":
        args = sac.Args(env_id="Hopper-v5", run_name="b", total_timesteps=200, learning_starts=100, batch_size=32, evaluation_episodes=1)
        sac.main(replace(args, progress_bar=False, torch_threads=1, actor_hidden_dim=32, critic_hidden_dim=32))
    else:
        ppo.main(ppo.Args(env_id="Hopper-v5", run_name="b", total_timesteps=128, num_steps=128, num_minibatches=2, update_epochs=1,
                          evaluation_episodes=1, progress_bar=False, torch_threads=1))  # fmt: skip
    assert "run b: logs and summary in runs/b, checkpoints in models/b" in capsys.readouterr().out.splitlines()


# ----------------------------------------------------------------------------------------
# dev/install_test_deps.sh: what the suite needs beyond pip, installed once, saying what it did
# ----------------------------------------------------------------------------------------
FAKE_APT_GET = """#!/bin/sh
echo "apt-get $*" >> "$FAKE_LOG"
for package in "$@"; do
  case "$package" in
    chromium) tools="chromium" ;;
    xvfb) tools="xvfb-run" ;;
    slurmctld) tools="slurmctld slurmd sbatch munged" ;;
    *) tools="" ;;
  esac
  for tool in $tools; do printf '#!/bin/sh\\n' > "$FAKE_BIN/$tool"; chmod +x "$FAKE_BIN/$tool"; done
done
"""
# `python -m venv DIR` makes DIR/bin/python (this fake); `DIR/bin/python -m pip install poetry` makes DIR/bin/poetry.
FAKE_PYTHON = """#!/bin/sh
echo "python $*" >> "$FAKE_LOG"
if [ "$2" = venv ]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python"; exit 0; fi
if [ "$2" = pip ]; then printf '#!/bin/sh\\necho Poetry\\n' > "$(dirname "$0")/poetry"; chmod +x "$(dirname "$0")/poetry"; exit 0; fi
exit 1
"""


def fake_machine(tmp_path: Path) -> tuple[dict, Path, Path]:
    """A PATH with fake apt-get, python and sudo and a few system tools (not the machine's chromium, poetry, SLURM);
    the environment, the fakes' folder and the home folder."""
    fake_bin, system, home = tmp_path / "fake", tmp_path / "system", tmp_path / "home"
    for folder in (fake_bin, system, home):
        folder.mkdir()
    for name, text in (("apt-get", FAKE_APT_GET), ("python", FAKE_PYTHON), ("python3", FAKE_PYTHON), ("sudo", '#!/bin/sh\nexec "$@"\n')):
        (fake_bin / name).write_text(text)
        (fake_bin / name).chmod(0o755)
    for tool in ("bash", "sh", "env", "id", "dirname", "mkdir", "ln", "cp", "chmod", "cat", "printf", "readlink"):
        (system / tool).symlink_to(shutil.which(tool))
    log = tmp_path / "calls.log"
    env = {"PATH": f"{fake_bin}:{system}:{home / '.local/bin'}", "HOME": str(home), "FAKE_LOG": str(log), "FAKE_BIN": str(fake_bin)}
    return env, fake_bin, home


def run_install_test_deps(env: dict, *flags: str, returncode: int = 0) -> subprocess.CompletedProcess:
    done = subprocess.run(["bash", str(REPO / "dev/install_test_deps.sh"), *flags], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == returncode, (done.stdout, done.stderr)
    return done


def test_install_test_deps_installs_what_is_missing_once_and_says_so(tmp_path):
    """On a machine with none of them (fake apt-get and python that log their calls and make the commands they
    install), the first run installs Chromium, Xvfb, SLURM through .ci/install_slurm.sh and Poetry in its own venv; the
    second finds them all and installs nothing."""
    env, fake_bin, home = fake_machine(tmp_path)
    log = Path(env["FAKE_LOG"])

    def install() -> list[str]:
        return run_install_test_deps(env).stdout.splitlines()

    first = install()
    poetry_venv = home / ".local/share/cleanrlhf/poetry"
    assert "chromium: installed (apt-get install chromium)" in first
    assert "xvfb: installed (apt-get install xvfb)" in first
    assert "slurm: installed (.ci/install_slurm.sh: slurmctld slurmd slurm-client munge)" in first
    assert f"poetry: installed in a venv of its own, {poetry_venv}; linked as {home}/.local/bin/poetry" in first
    assert first[-1] == "all test dependencies are in place: python -m pytest -q runs every test"
    calls = log.read_text().splitlines()
    assert any("install" in call and "chromium" in call for call in calls)
    assert any("install" in call and "slurmctld" in call for call in calls)
    assert f"python -m venv {poetry_venv}" in calls and any("-m pip install" in call and "poetry" in call for call in calls)
    assert (home / ".local/bin/poetry").resolve() == poetry_venv / "bin/poetry"

    second = install()
    assert log.read_text().splitlines() == calls, "the second run installed something again"
    assert f"chromium: already installed ({fake_bin}/chromium)" in second
    assert f"xvfb: already installed ({fake_bin}/xvfb-run)" in second
    assert "slurm: already installed" in second
    assert f"poetry: already installed ({home}/.local/bin/poetry)" in second
    assert second[-1] == first[-1]


def test_install_test_deps_warns_about_what_it_cannot_install(tmp_path):
    env, fake_bin, home = fake_machine(tmp_path)
    for name in ("apt-get", "python"):  # no package mirror, no PyPI
        (fake_bin / name).write_text("#!/bin/sh\nexit 1\n")
    lines = run_install_test_deps(env).stdout.splitlines()
    assert "warning: chromium: could not install it (apt-get install chromium); tests/test_feedback_page.py will skip" in lines
    assert "warning: slurm: could not install it (.ci/install_slurm.sh); tests/test_slurm.py will skip" in lines
    assert "warning: xvfb: could not install it (apt-get install xvfb); tests/test_seed_commands.py's Xvfb runs will skip" in lines
    assert lines[-1] == "missing: chromium xvfb slurm poetry (their tests skip, saying why)"
    assert not (home / ".local/bin/poetry").exists()
    run_install_test_deps(env, "--strict", returncode=1)


@pytest.mark.parametrize("algorithm", ["sac-rlhf", "pref-ppo"])
def test_a_human_sweep_gets_human_defaults_unless_its_config_or_flags_set_the_budget(algorithm):
    script = sweep.load_script(algorithm)
    human = {"teacher_feedback_mode": {"value": "human"}, "surf": {"values": [True, False]}}
    base = sweep.base_args(script, parse(config_with(human), algorithm), [])
    assert (base.teacher_feedback_total_queries, base.teacher_feedback_num_queries_per_session) == (100, 10)
    budget = {"teacher_feedback_total_queries": {"value": 300}, "teacher_feedback_num_queries_per_session": {"values": [20, 50]}}
    base = sweep.base_args(script, parse(config_with(human | budget), algorithm), [])
    assert base.teacher_feedback_total_queries == 300  # the config's; the swept one takes its values per trial
    base = sweep.base_args(script, parse(config_with(human), algorithm), ["--teacher-feedback-num-queries-per-session", "25"])
    assert (base.teacher_feedback_total_queries, base.teacher_feedback_num_queries_per_session) == (100, 25)
    assert sweep.base_args(script, parse(config_with({}), algorithm), []).teacher_feedback_total_queries == 1000


def test_the_resume_command_leaves_the_feedback_token_out(tmp_path):
    """The printed line may be logged: the token stays out of it (the resumed run reads FEEDBACK_SERVER_TOKEN)."""
    for given in (["--feedback-server-token", "s3cret"], ["--feedback-server-token=s3cret"]):
        command = resume_command(["framework/sac_rlhf.py", "--seed", "3", *given, "--teacher-feedback-mode", "human"], Path("models/r"))
        assert "s3cret" not in command
        assert shlex.split(command)[1:] == [
            "framework/sac_rlhf.py",
            "--seed",
            "3",
            "--teacher-feedback-mode",
            "human",
            "--resume",
            "models/r",
        ]


def test_the_trainer_takes_the_feedback_token_from_its_environment_variable(tmp_path, monkeypatch):
    """No --feedback-server-token: the server the trainer starts and the trainer's own requests use FEEDBACK_SERVER_TOKEN,
    so the token never has to be on a command line."""
    import socket
    import urllib.error
    import urllib.request

    from cleanrlhf_utils import feedback, protocol

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv(protocol.TOKEN_ENV, "from-env")
    args = sac_rlhf.Args(
        env_id="Hopper-v5", teacher_feedback_mode="human", feedback_server_autostart=True, feedback_server_url=f"http://127.0.0.1:{port}"
    )
    teacher = feedback.connect_human_teacher(args, "r", tmp_path / "run", tmp_path / "clips")  # registers the run: needs the token
    try:
        assert teacher.run_id == 1
        with pytest.raises(urllib.error.HTTPError) as refused:  # the server it started holds the same token
            urllib.request.urlopen(f"http://127.0.0.1:{port}{protocol.CONFIG}", timeout=5)
        assert refused.value.code == 401
    finally:
        teacher.close()
    assert "from-env" not in (tmp_path / "run" / "feedback_server.log").read_text()
