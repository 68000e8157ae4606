"""Bad command-line input fails fast: one `error:` line, exit code 2, nothing written."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import sac_rlhf

REPO_ROOT = Path(__file__).resolve().parents[1]
FRAMEWORK_DIR = REPO_ROOT / "framework"
SCRIPT = FRAMEWORK_DIR / "sac_rlhf.py"
OUTPUT_DIRS = ("runs", "models", "videos")

# (id, command-line arguments, what the error line must name). Each subprocess costs seconds of imports:
# these few go through the real CLI, the full list is checked in-process below.
CLI_CASES = [
    ("unknown-env", ["--env-id", "Nope-v0"], ["--env-id", "Nope-v0"]),
    ("negative-queries", ["--teacher-feedback-total-queries", "-5"], ["--teacher-feedback-total-queries", "-5"]),
    ("offsets", ["--min-augmentation-offset", "8", "--max-augmentation-offset", "3"], ["--min-augmentation-offset (8)", "(3)"]),
    ("discrete-actions", ["--env-id", "CartPole-v1"], ["--env-id CartPole-v1", "Discrete"]),
]
HELP_FLAGS = ["--teacher-feedback-mode", "--no-surf", "--rune", "--no-unsupervised-exploration"]


def _env() -> dict:
    env = dict(os.environ)
    env.setdefault("MUJOCO_GL", "egl")
    env["WANDB_MODE"] = "offline"
    env["COLUMNS"] = "200"  # help text: no wrapping inside flag names
    return env


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory):
    """Starts every CLI run at once (they are import-bound), then collects them."""
    runs = {}
    for case_id, argv, _ in CLI_CASES:
        cwd = tmp_path_factory.mktemp(case_id)
        runs[case_id] = (cwd, [sys.executable, str(SCRIPT), *argv])
    runs["help-from-root"] = (REPO_ROOT, [sys.executable, "framework/sac_rlhf.py", "--help"])
    runs["help-from-framework"] = (FRAMEWORK_DIR, [sys.executable, "sac_rlhf.py", "--help"])
    processes = {
        case_id: (cwd, subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for case_id, (cwd, cmd) in runs.items()
    }
    results = {}
    for case_id, (cwd, process) in processes.items():
        stdout, stderr = process.communicate(timeout=120)
        results[case_id] = (cwd, process.returncode, stdout, stderr)
    return results


@pytest.mark.parametrize(("case_id", "names"), [(case_id, names) for case_id, _, names in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input_exits_2_with_one_error_line(cli_results, case_id, names):
    cwd, returncode, stdout, stderr = cli_results[case_id]
    assert returncode == 2, (stdout, stderr)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines, stderr
    last = lines[-1]
    assert last.startswith("error: "), stderr
    for name in names:
        assert name in last, last
    assert sum(line.startswith("error:") for line in lines) == 1
    assert "Traceback" not in stderr
    for folder in OUTPUT_DIRS:
        assert not (cwd / folder).exists(), folder
    assert list(cwd.iterdir()) == []  # nothing at all was written


@pytest.mark.parametrize("case_id", ["help-from-root", "help-from-framework"])
def test_cli_help(cli_results, case_id):
    _, returncode, stdout, stderr = cli_results[case_id]
    assert returncode == 0, stderr
    for flag in HELP_FLAGS:
        assert flag in stdout, flag


# ----------------------------------------------------------------------------------------
# validate_args / main in-process
# ----------------------------------------------------------------------------------------
def _existing_file(tmp_path, name="replay_buffer.npz"):
    path = tmp_path / name
    path.write_bytes(b"x")
    return str(path)


BAD_ARGS = [
    ("unknown-env", lambda tmp: {"env_id": "Nope-v0"}, "--env-id Nope-v0 is not a registered"),
    ("negative-queries", lambda tmp: {"teacher_feedback_total_queries": -5}, "--teacher-feedback-total-queries must be >= 0, got -5"),
    ("zero-per-session", lambda tmp: {"teacher_feedback_num_queries_per_session": 0}, "--teacher-feedback-num-queries-per-session"),
    (
        "offsets",
        lambda tmp: {"min_augmentation_offset": 8, "max_augmentation_offset": 3},
        "--min-augmentation-offset (8) must be >= 0 and <= --max-augmentation-offset (3)",
    ),
    ("offset-too-long", lambda tmp: {"segment_length": 10, "max_augmentation_offset": 10}, "--max-augmentation-offset (10)"),
    ("missing-resume", lambda tmp: {"resume": str(tmp / "no_such_run")}, "--resume"),
    ("resume-without-checkpoint", lambda tmp: {"resume": str(tmp)}, "no checkpoint.pt"),
    ("exploration-from-nothing", lambda tmp: {"exploration_from": str(tmp / "nope")}, "--exploration-from"),
    ("exploration-from-no-buffer", lambda tmp: {"exploration_from": _existing_file(tmp, "checkpoint.pt")}, "no replay_buffer.npz"),
    ("surf-tau", lambda tmp: {"surf_tau": 1.0}, "--surf-tau"),
    ("eps-mistake", lambda tmp: {"teacher_eps_mistake": 1.5}, "--teacher-eps-mistake must be in [0, 1], got 1.5"),
    ("explore-shorter-than-random", lambda tmp: {"total_explore_steps": 500}, "--total-explore-steps (500)"),
    ("heldout-fraction", lambda tmp: {"reward_net_heldout_fraction": 1.0}, "--reward-net-heldout-fraction must be in [0, 1), got 1.0"),
]


def test_the_agent_reset_variant_refuses_a_correlation_outside_minus_one_to_one():
    import sac_rlhf_agent_reset

    with pytest.raises(sac_rlhf.ConfigError, match=r"--reset-agent-below-correlation must be in \[-1, 1\], got 1.5"):
        sac_rlhf_agent_reset.validate_args(sac_rlhf_agent_reset.Args(reset_agent_below_correlation=1.5))


@pytest.mark.parametrize(("overrides", "message"), [(o, m) for _, o, m in BAD_ARGS], ids=[c[0] for c in BAD_ARGS])
def test_validate_args_rejects(tmp_path, overrides, message):
    args = sac_rlhf.Args(**overrides(tmp_path))
    with pytest.raises(sac_rlhf.ConfigError) as error:
        sac_rlhf.validate_args(args)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_validate_args_accepts_good_configurations(tmp_path):
    sac_rlhf.validate_args(sac_rlhf.Args())
    sac_rlhf.validate_args(sac_rlhf.Args(capture_video=True, unsupervised_exploration=False, total_explore_steps=0))
    (tmp_path / "checkpoint.pt").write_bytes(b"x")
    sac_rlhf.validate_args(sac_rlhf.Args(resume=str(tmp_path)))
    _existing_file(tmp_path, "replay_buffer.npz")
    sac_rlhf.validate_args(sac_rlhf.Args(exploration_from=str(tmp_path)))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"env_id": "CartPole-v1"}, "--env-id CartPole-v1 has a Discrete action space"),
        ({"env_id": "Nope-v0"}, "--env-id Nope-v0"),
        ({"min_augmentation_offset": 8, "max_augmentation_offset": 3}, "--min-augmentation-offset (8)"),
    ],
    ids=["discrete-actions", "unknown-env", "offsets"],
)
def test_main_fails_before_writing_anything(chdir_tmp, overrides, message):
    with pytest.raises(sac_rlhf.ConfigError) as error:
        sac_rlhf.main(sac_rlhf.Args(progress_bar=False, cuda=False, total_timesteps=10, **overrides))
    assert message in str(error.value)
    assert list(chdir_tmp.iterdir()) == []


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"resume": "no_such_run/latest"}, "--resume no_such_run/latest: no checkpoint.pt in that folder"),
        ({"checkpoint_frequency": -1}, "--checkpoint-frequency must be >= 0, got -1"),
    ],
    ids=["missing-resume", "negative-frequency"],
)
def test_sac_baseline_refuses_bad_checkpoint_flags_before_writing(chdir_tmp, overrides, message):
    import sac

    with pytest.raises(sac_rlhf.ConfigError) as error:
        sac.main(sac.Args(progress_bar=False, cuda=False, total_timesteps=10, **overrides))
    assert str(error.value) == message
    assert list(chdir_tmp.iterdir()) == []


# ----------------------------------------------------------------------------------------
# What tyro itself rejects (an unknown flag, an invalid choice, a value of the wrong type, a missing argument): one
# `error:` line naming the bad value and what is allowed, in every script that parses its flags with tyro
# ----------------------------------------------------------------------------------------
NOT_A_MODE = "error: --teacher-feedback-mode 'humna' is not one of: simulated, human, file"
TYRO_CASES = [
    ("sac_rlhf-misspelt-flag", "framework/sac_rlhf.py", ["--surf-tua", "0.9"], "error: unknown flag --surf-tua (did you mean --surf-tau?); see --help"),
    ("sac_rlhf-partial-flag", "framework/sac_rlhf.py", ["--feedback-mode=human"], "error: unknown flag --feedback-mode (did you mean --teacher-feedback-mode?); see --help"),
    ("sac_rlhf-invalid-choice", "framework/sac_rlhf.py", ["--teacher-feedback-mode", "humna"], NOT_A_MODE),
    ("sac_rlhf-not-an-int", "framework/sac_rlhf.py", ["--seed", "abc"], "error: --seed expects INT, got 'abc'"),
    ("pref_ppo-invalid-choice", "framework/pref_ppo.py", ["--teacher-feedback-mode=humna"], NOT_A_MODE),
    ("sac-unknown-flag", "framework/sac.py", ["--foo-bar", "1"], "error: unknown flag --foo-bar; see --help"),
    ("ppo-value-without-flag", "framework/ppo.py", ["--cuda", "yes"], "error: unexpected argument 'yes': every setting is a --flag (an on/off one takes no value: --x / --no-x); see --help"),
    ("evaluation-missing", "framework/evaluation.py", [], "error: give --path-to-model (a run's checkpoint) or --policy (a shipped policy), one of them"),
    ("sweep-misspelt-flag", "framework/sweep.py", ["--sweep-cuont", "3"], "error: unknown flag --sweep-cuont (did you mean --sweep-count?); see --help"),
    ("sweep-script-flag", "framework/sweep.py", ["--config-filename", str(REPO_ROOT / "sweep_config/hopper.yaml"), "--", "--teacher-feedback-mode", "humna"], NOT_A_MODE),
    ("list_envs-misspelt-flag", "framework/list_envs.py", ["--jbos", "2"], "error: unknown flag --jbos (did you mean --jobs?); see --help"),
    ("compare-misspelt-flag", "toolbox/compare.py", ["runs/a", "--group-bye", "surf"], "error: unknown flag --group-bye (did you mean --group-by?); see --help"),
]  # fmt: skip


@pytest.fixture(scope="module")
def tyro_results(tmp_path_factory):
    """Every case at once (they are import-bound), each in an empty folder."""
    processes = {}
    for case_id, script, argv, _ in TYRO_CASES:
        cwd = tmp_path_factory.mktemp(case_id)
        command = [sys.executable, str(REPO_ROOT / script), *argv]
        processes[case_id] = (
            cwd,
            subprocess.Popen(command, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
        )
    results = {}
    for case_id, (cwd, process) in processes.items():
        stdout, stderr = process.communicate(timeout=180)
        results[case_id] = (cwd, process.returncode, stdout, stderr)
    return results


@pytest.mark.parametrize(("case_id", "line"), [(case_id, line) for case_id, _, _, line in TYRO_CASES], ids=[c[0] for c in TYRO_CASES])
def test_what_tyro_rejects_is_one_error_line(tyro_results, case_id, line):
    cwd, returncode, stdout, stderr = tyro_results[case_id]
    assert [text for text in stderr.splitlines() if text.strip()] == [line], stderr
    assert returncode == 2
    assert stdout == ""
    assert list(cwd.iterdir()) == []  # nothing written


@pytest.mark.parametrize("script", ["sac_rlhf", "sac_rlhf_rime", "sac_rlhf_mistake_aware", "pref_ppo", "sac", "ppo"])
def test_a_mistyped_flag_is_refused_before_torch_is_imported(tmp_path, script):
    """A misspelled flag costs a fraction of a second, not the seconds of torch's import: the script reads its flags
    from its own source first (args_source) and refuses in the same one line tyro's parse gives."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", str(FRAMEWORK_DIR / f"{script}.py"), "--seedd", "3", "--total-timesteps", "9000"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    errors = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert done.returncode == 2 and errors == ["error: unknown flag --seedd (did you mean --seed?); see --help"], done.stderr[-2000:]
    assert not {"torch", "gymnasium", "tyro"} & imported
    assert list(tmp_path.iterdir()) == []
