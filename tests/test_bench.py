"""The benchmarks' own machinery: how they schedule runs and what they report from them."""

import argparse
import contextlib
import functools
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import tyro

import sweep

REPO = Path(__file__).resolve().parents[1]


def bench_module(name: str):
    """bench/<name>.py as a module, its own imports (`from common import ...`) resolved from bench/ as when it runs."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(REPO / "bench"))


sys.path.insert(0, str(REPO / "bench"))
try:
    import feedback_efficiency
    import throughput
    from common import RESULTS, read_manifest, results_path, run_pool, spread
finally:
    sys.path.remove(str(REPO / "bench"))


def start_python(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def test_run_pool_starts_the_next_job_as_soon_as_any_finishes(tmp_path):
    """A long run and a short one side by side: the third job must start when the short one ends, not after the long
    one (which here waits for the third's mark, so batches of two would make it fail after 60 s)."""
    mark = tmp_path / "third_started"
    waits_for_third = f"""
import pathlib, sys, time
deadline = time.time() + 60
while not pathlib.Path({str(mark)!r}).exists():
    if time.time() > deadline:
        sys.exit(3)
    time.sleep(0.05)
"""
    jobs = [
        functools.partial(start_python, waits_for_third),
        functools.partial(start_python, "pass"),
        functools.partial(start_python, f"import pathlib; pathlib.Path({str(mark)!r}).touch()"),
    ]
    run_pool(jobs, ["long", "short", "third"], parallel=2, poll_seconds=0.05)
    assert mark.exists()


def test_run_pool_names_the_failed_run_and_stops_the_others(tmp_path):
    pid_file = tmp_path / "sleeper.pid"
    sleeper = f"import os, pathlib, time; pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid())); time.sleep(120)"
    fails = f"""
import pathlib, sys, time
while not pathlib.Path({str(pid_file)!r}).exists():
    time.sleep(0.05)
sys.exit(7)
"""
    never_started = tmp_path / "never"
    jobs = [
        functools.partial(start_python, sleeper),
        functools.partial(start_python, fails),
        functools.partial(start_python, f"import pathlib; pathlib.Path({str(never_started)!r}).touch()"),
    ]
    with pytest.raises(SystemExit, match="run crashing failed with exit code 7"):
        run_pool(jobs, ["sleeper", "crashing", "after"], parallel=2, poll_seconds=0.05)
    pid = int(pid_file.read_text())
    for _ in range(100):  # killed: the process is gone once the pool's parent has reaped it
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            break
        time.sleep(0.05)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not never_started.exists(), "a job queued after the failure must not start"


def test_run_pool_lets_the_others_save_their_checkpoint_when_one_fails_or_on_ctrl_c(tmp_path):
    """A failure stops the other runs as SIGTERM stops a script (it saves its checkpoint, then exits) and waits for
    that, killing only what outlives the grace; Ctrl-C, which the terminal also sends the runs, is not signalled again
    (a second signal would cut a save short): the pool waits for them. Before, every run still going was killed on the
    spot, and --resume-unfinished lost up to a checkpoint interval of each."""
    saves = f"""
import pathlib, signal, sys, time
def save(signum, frame):
    time.sleep(0.5)  # writing a checkpoint takes a while
    pathlib.Path({str(tmp_path)!r}, "saved").write_text("terminated")
    sys.exit(143)
signal.signal(signal.SIGTERM, save)
pathlib.Path({str(tmp_path)!r}, "saver_started").touch()
time.sleep(120)
"""
    ignores = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
    fails = f"""
import pathlib, sys, time
while not pathlib.Path({str(tmp_path)!r}, "saver_started").exists():
    time.sleep(0.05)
sys.exit(7)
"""
    processes = []

    def start(code: str):
        processes.append(start_python(code))
        return processes[-1]

    jobs = [functools.partial(start, code) for code in (saves, ignores, fails)]
    begun = time.monotonic()
    with pytest.raises(SystemExit, match="run crashing failed with exit code 7"):
        run_pool(jobs, ["saver", "stubborn", "crashing"], parallel=3, poll_seconds=0.05, grace_seconds=3)
    assert (tmp_path / "saved").read_text() == "terminated" and processes[0].returncode == 143
    assert processes[1].returncode == -9 and time.monotonic() - begun >= 3  # killed after the grace, not before

    # Ctrl-C: the run got it from the terminal and saves on its own; the pool must wait, not signal it
    finishes = f"""
import pathlib, signal, time
signal.signal(signal.SIGTERM, lambda *_: pathlib.Path({str(tmp_path)!r}, "signalled").touch())
time.sleep(1.0)
pathlib.Path({str(tmp_path)!r}, "finished").touch()
"""

    def ctrl_c():
        time.sleep(0.2)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_pool([functools.partial(start, finishes), ctrl_c], ["saving", "next"], parallel=2, poll_seconds=0.05, grace_seconds=30)
    assert (tmp_path / "finished").exists() and not (tmp_path / "signalled").exists()


def test_a_benchmark_stopped_by_sigterm_lets_its_runs_save_and_leaves_none_running(tmp_path):
    """SIGTERM to the benchmark alone (`kill`, `scancel` of a batch script that ran it) must stop its runs as SIGTERM
    stops a script: each saves its checkpoint and exits, and the benchmark exits 143 once they have. Before, Python's
    default action ended the benchmark on the spot and its runs went on as orphans, writing into the workdir that a
    rerun with --resume-unfinished then resumed a second time beside them."""
    run = f"""
import os, pathlib, signal, sys, time
def save(signum, frame):
    time.sleep(0.5)  # writing a checkpoint takes a while
    pathlib.Path({str(tmp_path)!r}, f"saved_{{sys.argv[1]}}").write_text("terminated")
    sys.exit(143)
signal.signal(signal.SIGTERM, save)
pathlib.Path({str(tmp_path)!r}, f"pid_{{sys.argv[1]}}").write_text(str(os.getpid()))
time.sleep(120)
"""
    bench = f"""
import functools, subprocess, sys
sys.path.insert(0, {str(REPO / "bench")!r})
from common import run_pool
start = lambda name: subprocess.Popen([sys.executable, "-c", {run!r}, name])
run_pool([functools.partial(start, "a"), functools.partial(start, "b")], ["a", "b"], parallel=2, poll_seconds=0.05)
"""
    benchmark = subprocess.Popen([sys.executable, "-c", bench])
    pids = [tmp_path / f"pid_{name}" for name in "ab"]
    try:
        deadline = time.monotonic() + 60
        while not all(pid.exists() for pid in pids):
            assert time.monotonic() < deadline and benchmark.poll() is None, "the runs never started"
            time.sleep(0.05)
        time.sleep(0.2)  # the runs' handlers are set right before their pid files are written
        benchmark.terminate()  # the benchmark only, as `kill PID` does
        assert benchmark.wait(timeout=60) == 143
        for name, pid in zip("ab", pids):
            assert (tmp_path / f"saved_{name}").read_text() == "terminated"
            with pytest.raises(ProcessLookupError):  # reaped by the benchmark, not left running
                os.kill(int(pid.read_text()), 0)
    finally:  # whatever the outcome, no run outlives the test
        benchmark.kill()
        for pid in pids:
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(pid.read_text()), signal.SIGKILL)


def test_last_evaluations_mean_is_the_mean_of_the_last_three_or_nothing():
    curve = [[10_000, 300.0], [20_000, 2900.0], [30_000, 500.0], [40_000, 1400.0], [50_000, 1800.0]]
    assert feedback_efficiency.last_evaluations_mean(curve) == pytest.approx((500 + 1400 + 1800) / 3)
    assert feedback_efficiency.last_evaluations_mean(curve[:2]) is None  # too few evaluations to average three
    assert feedback_efficiency.last_evaluations_mean(None) is None  # a reused baseline from before curves were kept
    assert feedback_efficiency.first_step_reaching(curve, 1000) == 20_000
    assert feedback_efficiency.first_step_reaching(curve, 5000) is None


def test_a_spread_is_the_median_and_interquartile_range_of_the_seeds_that_have_the_value():
    """What feedback_efficiency.py and reward_gap.py write beside their medians: a seed without the value (a reused
    baseline recorded without its curve) drops out instead of counting as zero."""
    assert spread([5.0, 1.0, None, 3.0, 2.0, 4.0]) == {"median": 3.0, "q25": 2.0, "q75": 4.0}
    assert spread([None, None]) == {"median": None, "q25": None, "q75": None}


def bench_settings(**changes):
    settings = dict(
        algorithm="sac", env_id="CartPole-v1", steps=100_000, labels=200, sessions=10, feedback_frequency=5000,
        explore_steps=10_000, evaluation_frequency=10_000, evaluation_episodes=10, variant="pebble",
        checkpoint_frequency=10_000, terminate_when_unhealthy=True, teacher_objective="",
    )  # fmt: skip
    return argparse.Namespace(**(settings | changes))


def test_a_baseline_is_reused_exactly_when_its_run_would_be_the_same():
    """--baseline-from checks BASELINE_SETTINGS: every one of them must change the baseline's command line (else a
    different baseline could be reused), and nothing else may (else a valid one would be refused, as the exploration
    length once was)."""
    flags = feedback_efficiency.baseline_flags(bench_settings(), 1, "run")
    other_values = {"algorithm": "ppo", "env_id": "Hopper-v5", "steps": 50_000, "evaluation_frequency": 5000, "evaluation_episodes": 5}
    other_values["terminate_when_unhealthy"] = False
    assert set(other_values) == set(feedback_efficiency.BASELINE_SETTINGS)
    for key, value in other_values.items():
        assert feedback_efficiency.baseline_flags(bench_settings(**{key: value}), 1, "run") != flags, key
    preference_only = {"labels": 100, "sessions": 5, "feedback_frequency": 9000, "explore_steps": 5000, "variant": "qpa"}
    for key, value in preference_only.items():
        assert feedback_efficiency.baseline_flags(bench_settings(**{key: value}), 1, "run") == flags, key


@pytest.mark.parametrize("algorithm", ["sac", "ppo"])
def test_feedback_efficiency_starts_each_script_with_flags_it_accepts(algorithm):
    """The preference run's and the baseline's command lines parse as their scripts' own (ppo.py has no checkpoints:
    a --checkpoint-frequency there would stop the benchmark at its first baseline)."""
    from cleanrlhf_utils.cli import command_line_args

    sys.path.insert(0, str(REPO / "bench"))
    try:
        from common import script_module
    finally:
        sys.path.remove(str(REPO / "bench"))
    rlhf_script, _, base_script, _ = feedback_efficiency.ALGORITHMS[algorithm]
    settings = bench_settings(algorithm=algorithm, checkpoint_frequency=5000)
    preference = command_line_args(script_module(rlhf_script).Args, feedback_efficiency.pebble_flags(settings, 1, "a"))
    assert preference.checkpoint_frequency == 5000 and preference.seed == 1
    baseline = command_line_args(script_module(base_script).Args, feedback_efficiency.baseline_flags(settings, 1, "b"))
    assert baseline.seed == 1 and baseline.run_name == "b"
    if algorithm == "sac":  # the baseline resumes too
        assert baseline.checkpoint_frequency == 5000


def test_feedback_efficiency_runs_swimmer_with_its_run_scripts_discount_on_both_sides():
    """Swimmer's SAC baseline and its PEBBLE run both take scripts/Swimmer-v5.sh's --gamma: a comparison at another
    discount than the recommended setting would measure the discount."""
    script = (REPO / "scripts" / "Swimmer-v5.sh").read_text()
    gamma = script.split("--gamma ")[1].split()[0]
    settings = bench_settings(env_id="Swimmer-v5")
    for flags in (feedback_efficiency.pebble_flags(settings, 1, "a"), feedback_efficiency.baseline_flags(settings, 1, "b")):
        assert flags[flags.index("--gamma") + 1] == gamma == "0.9999"
    assert "--gamma" not in feedback_efficiency.baseline_flags(bench_settings(env_id="Ant-v5"), 1, "b")


def test_feedback_efficiency_names_runs_by_the_env_id_without_its_module_or_slashes():
    """Run names are folder names: an env of one's own (module:Id) is named by its id, a dm_control one without '/'."""
    assert feedback_efficiency.run_tag("ant_without_contact_forces:AntWithoutContactForces-v5", 1, "7") == "AntWithoutContactForces-v5_1_7"
    assert feedback_efficiency.run_tag("dm_control/walker-walk-v0", 2, "7") == "dm_control_walker-walk-v0_2_7"


def test_a_benchmarks_runs_can_build_an_env_a_bench_module_registers(tmp_path):
    """--env-id ant_without_contact_forces:AntWithoutContactForces-v5: the runs start in the bench's workdir, and import
    the module that registers the env from bench/ as the benchmark itself does."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from common import start_script
    finally:
        sys.path.remove(str(REPO / "bench"))
    script = tmp_path / "observe.py"
    script.write_text(
        "import gymnasium as gym\nfrom cleanrlhf_utils.envs import registered_id\n"
        "print(gym.make(registered_id('ant_without_contact_forces:AntWithoutContactForces-v5')).observation_space.shape)\n"
    )
    log = tmp_path / "run.log"
    assert start_script(str(script), [], tmp_path / "workdir", log=log).wait(timeout=120) == 0, log.read_text()
    assert log.read_text().strip() == "(27,)"


def test_feedback_efficiency_ends_no_episode_on_a_fall_on_both_sides_when_asked():
    """--no-terminate-when-unhealthy reaches SAC's run and PEBBLE's alike, and both scripts read it as the task without
    the fall's end: a comparison with one side ending on a fall would measure the termination, not the labels."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from common import script_module
    finally:
        sys.path.remove(str(REPO / "bench"))
    from cleanrlhf_utils.cli import command_line_args

    rlhf_script, _, base_script, _ = feedback_efficiency.ALGORITHMS["sac"]
    for ends, expected in ((True, True), (False, False)):
        settings = bench_settings(env_id="Ant-v5", terminate_when_unhealthy=ends)
        preference = command_line_args(script_module(rlhf_script).Args, feedback_efficiency.pebble_flags(settings, 1, "a"))
        baseline = command_line_args(script_module(base_script).Args, feedback_efficiency.baseline_flags(settings, 1, "b"))
        assert preference.terminate_when_unhealthy is baseline.terminate_when_unhealthy is expected
    assert (
        feedback_efficiency.default_output(bench_settings(env_id="Ant-v5", terminate_when_unhealthy=False)).parent.name == "ant-no-fall-end"
    )


def test_feedback_efficiency_lets_a_teacher_label_by_an_objective_and_measures_both_runs_on_the_envs_reward(capsys):
    """--teacher-objective reaches the preference run alone (SAC's run learns the env's reward, which both are measured
    on), names the default output by the objective, and an objective that does not load is refused in one line."""
    from cleanrlhf_utils.cli import command_line_args

    walking = "ant_without_contact_forces:walking"
    env = "ant_without_contact_forces:AntWithoutContactForces-v5"
    settings = bench_settings(env_id=env, terminate_when_unhealthy=False, variant="norm-reset-std1-linear", teacher_objective=walking)
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from common import script_module

        preference = command_line_args(script_module("sac_rlhf.py").Args, feedback_efficiency.pebble_flags(settings, 1, "a"))
    finally:
        sys.path.remove(str(REPO / "bench"))
    assert preference.teacher_objective == walking
    assert "--teacher-objective" not in feedback_efficiency.baseline_flags(settings, 1, "b")
    output = feedback_efficiency.default_output(settings)
    assert (output.parent.name, output.name) == ("antwithoutcontactforces-no-fall-end", "norm-reset-std1-linear-teacher-walking.json")
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "feedback_efficiency.py"), "--teacher-objective", "ant_without_contact_forces:walkng"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .endswith("--teacher-objective ant_without_contact_forces:walkng: module ant_without_contact_forces has no function walkng")
    )


def test_the_walking_objective_is_the_ants_reward_without_its_control_and_contact_costs():
    """On a real Ant-v5 episode of random actions, with no end on a fall: each step's `walking` is the env's reward
    plus the control and contact costs it subtracts, up to the difference between the torso's speed at the step's
    start and its mean speed over the step; over 50-step clips, which the teacher compares, the two agree closely."""
    import mujoco

    ant = bench_module("ant_without_contact_forces")
    env = gym.make("Ant-v5", terminate_when_unhealthy=False)
    env.reset(seed=0)
    model, data = env.unwrapped.model, env.unwrapped.data
    rng = np.random.default_rng(0)
    states, seen = [], []
    for _ in range(300):
        state = np.zeros(mujoco.mj_stateSize(model, mujoco.mjtState.mjSTATE_FULLPHYSICS))
        mujoco.mj_getState(model, data, state, mujoco.mjtState.mjSTATE_FULLPHYSICS)
        states.append(state)
        _, reward, _, _, info = env.step(rng.uniform(-1, 1, 8))
        seen.append(reward - info["reward_ctrl"] - info["reward_contact"])
    env.close()
    walking, seen = ant.walking(None, None, np.array(states)[None])[0], np.array(seen)
    assert np.corrcoef(walking, seen)[0, 1] > 0.9
    clips = walking.reshape(6, 50).sum(1), seen.reshape(6, 50).sum(1)
    assert np.corrcoef(*clips)[0, 1] > 0.99 and np.abs(clips[0] - clips[1]).max() < 0.05 * np.abs(clips[1]).max() + 1


@pytest.mark.parametrize("variant", sorted(feedback_efficiency.VARIANT_SCRIPTS))
def test_a_variant_that_changes_the_algorithm_runs_its_own_script_with_the_variants_flags(variant):
    """--variant norm-reset-std1-nonneg runs bench/nonnegative_reward.py (sac_rlhf.py with the shifted reward) and
    norm-reset-std1-linear-ctrl bench/known_control_cost.py (with the action's control cost added),
    norm-reset-std1-linear-recent-explorequeries bench/exploration_for_queries.py (the exploring steps out of SAC's
    batches): each script's Args take the preference run's flags as sac_rlhf.py's do, and its runs are named by it."""
    from cleanrlhf_utils.cli import command_line_args

    script = Path(feedback_efficiency.VARIANT_SCRIPTS[variant])
    assert script.parent == REPO / "bench" and variant in feedback_efficiency.VARIANTS
    flags = feedback_efficiency.pebble_flags(bench_settings(env_id="Ant-v5", variant=variant), 1, "a")
    sys.path.insert(0, str(REPO / "bench"))  # as when the benchmark runs: bench/ is its script's folder
    try:
        from common import script_module

        run = command_line_args(script_module(str(script)).Args, flags)
    finally:
        sys.path.remove(str(REPO / "bench"))
    assert run.exp_name == script.stem and run.learned_reward_std == 1.0 and run.reset_actor_after_exploration
    assert run.teacher_feedback_schedule == ("linear" if "-linear-" in variant else "exponential")
    assert run.qpa_query_episodes == (10 if "-recent-" in variant else 0)
    assert getattr(run, "known_control_cost_weight", None) == {"-ctrl": 0.5, "ctrl1": 1.0}.get(variant[-5:])


def test_feedback_efficiency_variants_are_valid_runs_that_differ_only_as_named():
    """bench/feedback_efficiency.py --variant: each variant's flags parse (by its own script's Args where it has one)
    and validate as sac_rlhf.py's own, and each QPA ablation is QPA with exactly its one part switched off (else the
    ablation would measure something else too); the recent-queries, RUNE, near-tie, short-clip, fit-every-label and
    small-network variants are the even schedule's with only their own settings changed, the no-exploration one the
    recent-queries one with exploration off, the input-noise ones it with only their noise (in its own script), and
    the exploration-for-queries one its settings, in its own script."""
    script = sweep.load_script("sac-rlhf")
    for env_id in ["Hopper-v5", "dm_control/walker-walk-v0"]:
        runs = {}
        for variant in feedback_efficiency.VARIANTS:
            own = feedback_efficiency.VARIANT_SCRIPTS.get(variant)
            args_class = bench_module(Path(own).stem).Args if own else script.Args
            flags = ["--env-id", env_id, *feedback_efficiency.variant_flags(variant, env_id)]
            runs[variant] = tyro.cli(args_class, args=flags)
            script.validate(runs[variant])
        qpa = asdict(runs["qpa"])
        assert (qpa["qpa_query_episodes"], qpa["qpa_hybrid_ratio"], qpa["qpa_augmentations"]) == (10, 0.5, 20)
        assert asdict(runs["qpa-no-hybrid"]) == {**qpa, "qpa_hybrid_ratio": 0.0}
        assert asdict(runs["qpa-no-crops"]) == {**qpa, "qpa_augmentations": 0}
        linear = asdict(runs["norm-reset-std1-linear"])
        recent = asdict(runs["norm-reset-std1-linear-recent"])
        assert recent == {**linear, "qpa_query_episodes": 10}
        assert asdict(runs["norm-reset-std1-linear-recent-noexplore"]) == {**recent, "unsupervised_exploration": False}
        for_queries = asdict(runs["norm-reset-std1-linear-recent-explorequeries"])  # its script keeps exploration apart
        assert for_queries == {**recent, "exp_name": "exploration_for_queries"}
        for suffix, noise in [("", 0.5), ("1", 1.0)]:
            noisy = {"exp_name": "reward_input_noise", "reward_input_noise": noise}
            assert asdict(runs[f"norm-reset-std1-linear-recent-noise{suffix}"]) == {**recent, **noisy}
        rune = {"rune": True, "rune_beta": 5.0, "rune_beta_decay": 1e-5}
        assert asdict(runs["norm-reset-std1-linear-rune"]) == {**linear, **rune}
        near_ties = {"preference_sampling": "entropy", "preference_sampling_pool_factor": 50}
        assert asdict(runs["norm-reset-std1-linear-entropy"]) == {**linear, **near_ties}
        assert asdict(runs["norm-reset-std1-linear-short"]) == {**linear, "segment_length": 25}
        assert asdict(runs["norm-reset-std1-linear-fit"]) == {**linear, "reward_net_target_accuracy": 1.0}
        small = {"reward_net_hidden_layers": 1, "reward_net_hidden_dim": 64}
        assert asdict(runs["norm-reset-std1-linear-small"]) == {**linear, **small}
        assert runs["pebble"] == script.Args(env_id=env_id)
        standardised = env_id.startswith("dm_control/")  # the suite's tuned inputs (README)
        assert runs["tuned"].reward_net_normalize_inputs == qpa["reward_net_normalize_inputs"] == standardised
        assert runs["tuned"].teacher_feedback_schedule == qpa["teacher_feedback_schedule"] == "linear"


def test_feedback_efficiency_passes_the_teachers_noise_and_the_defence_to_the_preference_run_only():
    """--teacher-eps-mistake / --teacher-beta reach the preference run's Args as given (the oracle's values add no
    flag), a defence is the variant script the run runs with its own settings, and the baseline's command line never
    changes (a noisy-teacher run reuses the oracle's SAC baseline)."""
    import sac_rlhf_rime

    oracle = feedback_efficiency.pebble_flags(bench_settings(), 1, "run")
    assert oracle == feedback_efficiency.pebble_flags(
        bench_settings(teacher_eps_mistake=0.0, teacher_beta=-1.0, robust_labels="none"), 1, "run"
    )
    noisy = bench_settings(teacher_eps_mistake=0.2, teacher_beta=10.0, robust_labels="rime", rime_flip_tau=1e-40)
    parsed = tyro.cli(sac_rlhf_rime.Args, args=feedback_efficiency.pebble_flags(noisy, 1, "run"))
    assert (parsed.teacher_eps_mistake, parsed.teacher_beta, parsed.rime_flip_tau) == (0.2, 10.0, 1e-40)
    assert asdict(parsed) == asdict(tyro.cli(sac_rlhf_rime.Args, args=oracle)) | {
        "teacher_eps_mistake": 0.2,
        "teacher_beta": 10.0,
        "rime_flip_tau": 1e-40,
    }
    assert feedback_efficiency.DEFENCE_SCRIPTS == {"none": "sac_rlhf.py", "rime": "sac_rlhf_rime.py", "smooth": "sac_rlhf_mistake_aware.py"}
    assert feedback_efficiency.baseline_flags(noisy, 1, "run") == feedback_efficiency.baseline_flags(bench_settings(), 1, "run")
    # The bench's oracle values are the scripts' defaults: a run with them is the oracle setting, and adds no flag.
    defaults = {**vars(sweep.load_script("sac-rlhf").Args()), **vars(sac_rlhf_rime.Args()), "robust_labels": "none"}
    assert {key: defaults[key] for key in feedback_efficiency.TEACHER_FLAGS} == feedback_efficiency.TEACHER_FLAGS


@pytest.mark.parametrize(("flag", "value"), [("--rime-flip-tau", "1e-40"), ("--rime-warm-start-steps", "1000")])
def test_feedback_efficiency_refuses_a_rime_setting_without_rime(flag, value):
    """--rime-flip-tau or --rime-warm-start-steps without --robust-labels rime would be passed on and never act: one
    line naming both, exit 2."""
    bench = [sys.executable, str(REPO / "bench/feedback_efficiency.py"), flag, value, "--robust-labels", "smooth"]
    refused = subprocess.run(bench, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2
    assert f"{flag} {value} only acts with --robust-labels rime, got smooth" in refused.stderr.splitlines()[-1]


@pytest.mark.parametrize("script", ["feedback_efficiency.py", "novel_behaviours.py"])
@pytest.mark.parametrize("value", ["-5", "1e4"])
def test_a_bench_refuses_a_checkpoint_frequency_that_is_not_a_step_count(script, value):
    """Passed on, the runs would each refuse it after the benchmark had started them: one line naming it, exit 2."""
    bench = [sys.executable, str(REPO / "bench" / script), f"--checkpoint-frequency={value}"]
    refused = subprocess.run(bench, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2
    assert f"'{value}' is not a whole number of steps (0 or more)" in refused.stderr.splitlines()[-1]


def test_throughput_runs_versions_side_by_side_on_one_thread_and_alone_on_more():
    assert throughput.run_groups(1, 0) == throughput.run_groups(1, 1) == [["this", "against"]]
    # With 2 threads each, two runs side by side would oversubscribe 2 cores: one at a time, who goes first alternating.
    assert throughput.run_groups(2, 0) == [["this"], ["against"]]
    assert throughput.run_groups(2, 1) == [["against"], ["this"]]


def test_knn_bench_times_another_commit_in_its_own_worktree_and_checks_the_distances_agree(tmp_path):
    """bench/knn.py compares this checkout's k-NN with another commit's, each imported from its own checkout in a
    worker process (no module of this one patched), and refuses a commit that does not exist."""
    output = tmp_path / "knn.json"
    worktrees_before = subprocess.run(["git", "worktree", "list"], cwd=REPO, capture_output=True, text=True).stdout
    command = [sys.executable, str(REPO / "bench/knn.py"), "--against", "HEAD", "--obs-dims", "5", "--rounds", "1", "--steps", "2"]
    subprocess.run([*command, "--output", str(output)], cwd=tmp_path, check=True, capture_output=True, timeout=300)
    result = json.loads(output.read_text())
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert result["settings"]["against_commit"] == head
    rows = {row["implementation"]: row for row in result["rows"]}
    assert set(rows) == {"this", "HEAD", "full_topk"}
    assert rows["HEAD"]["speedup_vs_against"] == 1.0 and all(row["knn_ms_per_call"] > 0 for row in rows.values())
    assert rows["this"]["exploration_ms_per_step"] > 0
    worktrees_after = subprocess.run(["git", "worktree", "list"], cwd=REPO, capture_output=True, text=True).stdout
    assert worktrees_after == worktrees_before, "the bench removes the worktree it made"
    refused = subprocess.run([*command[:2], "--against", "no-such-commit"], capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and refused.stderr.strip().splitlines()[-1] == (
        "bench/knn.py: error: --against 'no-such-commit' is not a commit of this repository"
    )


def write_results(path: Path, settings: dict, rows: list[dict]) -> Path:
    path.write_text(json.dumps({"benchmark": "feedback_efficiency", "settings": settings, "rows": rows}))
    return path


def test_a_longer_baseline_is_read_at_this_invocations_last_step_and_a_seed_without_its_curve_is_run(tmp_path):
    """--baseline-from a 100k-step run for a 60k-step invocation: the baseline's figure is its evaluation at 60k (not its
    final one), its curve ends there; a seed recorded without a curve cannot be read at 60k and is left to run; a
    shorter baseline, or one evaluated differently, is one error naming the setting."""
    curve = [[step, step / 100] for step in range(10_000, 100_001, 10_000)]
    longer = vars(bench_settings(steps=100_000))
    rows = [
        {"seed": 1, "sac_return": 999.0, "sac_sps": 30.0},  # from before curves were kept
        {"seed": 2, "sac_return": 1000.0, "sac_sps": 31.0, "sac_eval_curve": curve},
    ]
    path = write_results(tmp_path / "longer.json", longer, rows)
    found = feedback_efficiency.earlier_baselines([path], bench_settings(steps=60_000), "sac")
    assert sorted(found) == [2]
    assert found[2]["final_eval_return"] == 600.0 and found[2]["eval_curve"][-1] == [60_000, 600.0]
    assert len(found[2]["eval_curve"]) == 6
    same = feedback_efficiency.earlier_baselines([path], bench_settings(steps=100_000), "sac")
    assert found[2]["sps"] == same[2]["sps"] and same[1]["final_eval_return"] == 999.0  # same steps: the final figures
    assert feedback_efficiency.earlier_baselines([path], bench_settings(steps=55_000), "sac") == {}  # no evaluation at 55k
    with pytest.raises(SystemExit, match="steps 100000"):
        feedback_efficiency.earlier_baselines([path], bench_settings(steps=200_000), "sac")
    with pytest.raises(SystemExit, match="evaluation_episodes 10 .this invocation: 5."):
        feedback_efficiency.earlier_baselines([path], bench_settings(steps=60_000, evaluation_episodes=5), "sac")


def test_the_oracle_setting_is_read_at_the_same_step_and_only_from_an_oracle_teacher(tmp_path):
    """--oracle-from: the same preference setting with the oracle teacher, read at this invocation's last step (final
    evaluation and last-3 mean); results of a noisy teacher, another label budget, or without an evaluation at the step
    are refused in one line."""
    curve = [[step, float(step)] for step in range(10_000, 100_001, 10_000)]
    oracle = vars(bench_settings(steps=100_000))  # written before the teacher's flags were recorded: the oracle's
    path = write_results(tmp_path / "oracle.json", oracle, [{"seed": 3, "pebble_eval_curve": curve}])
    noisy = bench_settings(steps=60_000, teacher_eps_mistake=0.2, teacher_beta=-1.0, robust_labels="rime")
    found = feedback_efficiency.earlier_oracle_runs([path], noisy, "pebble")
    assert found[3]["return"] == 60_000.0 and found[3]["last_return"] == 50_000.0  # mean of 40k, 50k, 60k
    with pytest.raises(SystemExit, match="labels 200 .this invocation: 100."):
        feedback_efficiency.earlier_oracle_runs([path], bench_settings(steps=60_000, labels=100), "pebble")
    with pytest.raises(SystemExit, match="no evaluation at step 55000"):
        feedback_efficiency.earlier_oracle_runs([path], bench_settings(steps=55_000), "pebble")
    noisy_results = write_results(tmp_path / "noisy.json", oracle | {"teacher_eps_mistake": 0.2}, [{"seed": 3, "pebble_eval_curve": curve}])
    with pytest.raises(SystemExit, match="not the oracle"):
        feedback_efficiency.earlier_oracle_runs([noisy_results], noisy, "pebble")
    # rime's own flags act only with rime: an oracle recorded while the warm start's default was 1000 is the oracle still
    warm_then = write_results(tmp_path / "then.json", oracle | {"rime_warm_start_steps": 1000}, [{"seed": 3, "pebble_eval_curve": curve}])
    assert feedback_efficiency.earlier_oracle_runs([warm_then], noisy, "pebble")[3]["return"] == 60_000.0
    rime_oracle = write_results(tmp_path / "rime.json", oracle | {"robust_labels": "rime"}, [{"seed": 3, "pebble_eval_curve": curve}])
    with pytest.raises(SystemExit, match="not the oracle"):
        feedback_efficiency.earlier_oracle_runs([rime_oracle], noisy, "pebble")


def test_a_longer_run_with_the_same_flags_is_read_at_this_invocations_last_evaluation(tmp_path):
    """--reuse-finished also reads a run started with the same flags but more steps, finished or not, once it has
    evaluated at this invocation's last step: the evaluation there, the curve up to it, and the last feedback session
    before it (the one logged at that step came after the evaluation). A run with another setting, or one that has
    not evaluated there yet, is not read."""
    from torch.utils.tensorboard import SummaryWriter

    import sac_rlhf
    from cleanrlhf_utils.cli import command_line_args
    from cleanrlhf_utils.tracking import public_settings

    flags = feedback_efficiency.pebble_flags(bench_settings(env_id="Hopper-v5", steps=200, teacher_eps_mistake=0.2), 1, "wanted")

    def write_run(name: str, total: int, eps: float, evaluated: list[int]) -> None:
        run_flags = [*flags, "--total-timesteps", str(total), "--teacher-eps-mistake", str(eps)]
        (tmp_path / "runs" / name).mkdir(parents=True)
        recorded = json.dumps(public_settings(command_line_args(sac_rlhf.Args, run_flags)), default=str)
        (tmp_path / "runs" / name / "args.json").write_text(recorded)
        writer = SummaryWriter(str(tmp_path / "runs" / name))
        for step in evaluated:
            writer.add_scalar("eval/mean_return", step / 10, step)
            writer.add_scalar("feedback/labels_obtained", step // 20, step)
            writer.add_scalar("reward_model/heldout_accuracy", step / 1000, step)
            writer.add_scalar("charts/SPS", 30.0, step)
        writer.close()

    write_run("a_other_teacher", 400, 0.1, [100, 200, 300])
    write_run("b_not_there_yet", 400, 0.2, [100])
    assert feedback_efficiency.reused_run(tmp_path, "sac_rlhf.py", flags, 200) is None
    write_run("c_longer", 400, 0.2, [100, 200, 300])
    name, figures = feedback_efficiency.reused_run(tmp_path, "sac_rlhf.py", flags, 200)
    assert name == "c_longer" and figures["final_eval_return"] == 20.0 and figures["eval_curve"] == [[100, 10.0], [200, 20.0]]
    assert figures["labels_obtained"] == 5 and figures["heldout_accuracy"] == pytest.approx(0.1)  # the session at 100
    assert figures["sps"] == 30.0 and figures["reward_correlation"] is None  # not logged there
    shorter = feedback_efficiency.pebble_flags(bench_settings(env_id="Hopper-v5", steps=500, teacher_eps_mistake=0.2), 1, "wanted")
    assert feedback_efficiency.reused_run(tmp_path, "sac_rlhf.py", shorter, 500) is None  # no run as long


def test_a_stopped_run_is_resumed_from_its_furthest_checkpoint_and_a_finished_one_is_read(tmp_path):
    """bench/feedback_efficiency.py --resume-unfinished: a run with this invocation's flags that stopped before its end
    (the sitting ended) continues from its last checkpoint under its own name; of two such runs the furthest, never one
    of another teacher; --reuse-finished reads a finished run first; without either flag the run starts afresh. Both
    runs checkpoint every --checkpoint-frequency steps, or there would be nothing to resume from."""
    import torch

    import sac_rlhf
    from cleanrlhf_utils.cli import command_line_args
    from cleanrlhf_utils.tracking import public_settings

    settings = bench_settings(env_id="Hopper-v5", steps=200, teacher_eps_mistake=0.2, checkpoint_frequency=50)
    flags = feedback_efficiency.pebble_flags(settings, 1, "wanted")
    assert flags[flags.index("--checkpoint-frequency") + 1] == "50"
    baseline = feedback_efficiency.baseline_flags(settings, 1, "sac")
    assert baseline[baseline.index("--checkpoint-frequency") + 1] == "50"

    def write_run(name: str, eps: float, checkpoint_step: int | None, finished: bool = False) -> None:
        run_flags = [*flags, "--teacher-eps-mistake", str(eps), "--run-name", name]
        (tmp_path / "runs" / name).mkdir(parents=True)
        recorded = json.dumps(public_settings(command_line_args(sac_rlhf.Args, run_flags)), default=str)
        (tmp_path / "runs" / name / "args.json").write_text(recorded)
        if finished:
            (tmp_path / "runs" / name / "summary.json").write_text(json.dumps({"interrupted": False}))
        if checkpoint_step is not None:
            (tmp_path / "models" / name / "latest").mkdir(parents=True)
            torch.save({"loop": {"global_step": checkpoint_step}}, tmp_path / "models" / name / "latest" / "checkpoint.pt")

    def plan(**changes):
        options = dict(workdir=tmp_path, steps=200, reuse_finished=True, resume_unfinished=True) | changes
        return feedback_efficiency.planned_run(argparse.Namespace(**options), "sac_rlhf.py", flags)

    write_run("a_stopped_early", 0.2, 50)
    write_run("b_stopped_later", 0.2, 150)
    write_run("c_other_teacher", 0.1, 190)
    write_run("d_no_checkpoint", 0.2, None)
    name, longer, start = plan()
    assert (name, longer) == ("b_stopped_later", None)
    assert start == [*flags[: flags.index("--run-name") + 1], "b_stopped_later", *flags[flags.index("--run-name") + 2 :],
                     "--resume", "models/b_stopped_later/latest"]  # fmt: skip
    assert plan(resume_unfinished=False) == ("wanted", None, flags)
    write_run("e_finished", 0.2, 150, finished=True)
    assert plan() == ("e_finished", None, None)  # read, not run
    assert plan(reuse_finished=False)[0] == "b_stopped_later"


# ------------------------------------------------------------------------------------------------------------------
# Where results live
# ------------------------------------------------------------------------------------------------------------------
def test_every_results_file_is_in_the_layout_and_listed_once_in_the_manifest():
    """bench/results/<benchmark>/<question>/<result>.json, each file a manifest entry named <question>/<result>, whose
    question has a page, and no file left out."""
    questions, results, _ = read_manifest()
    files = sorted(str(path.relative_to(RESULTS)) for path in RESULTS.rglob("*.json"))
    assert files and sorted(entry.file for entry in results.values()) == files
    for name, entry in results.items():
        assert results_path(entry.benchmark, entry.question, name.split("/")[1]) == RESULTS / entry.file
        assert (REPO / "bench" / f"{entry.benchmark}.py").is_file(), f"{name}: no benchmark {entry.benchmark}"
        assert (REPO / questions[entry.question].partition("#")[0]).is_file(), entry.question


@pytest.mark.parametrize(
    "file, name",
    [
        ("knn/knn.json", "speed/knn"),
        ("knn/speed/knn.json", "speed/other"),
        ("knn/speed/extra/knn.json", "speed/knn"),
        ("knn/nowhere/knn.json", "nowhere/knn"),
    ],
)
def test_the_manifest_refuses_an_entry_out_of_the_layout(tmp_path, file, name):
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(
        f"questions:\n  speed: docs/benchmarks/index.md\nresults:\n  {name}:\n    file: {file}\n    task: t\n    setting: s\n"
    )
    with pytest.raises(ValueError, match=name):
        read_manifest(manifest)


def test_the_manifest_refuses_a_summary_row_that_does_not_fit_its_table(tmp_path):
    results = "results:\n  speed/knn:\n    file: knn/speed/knn.json\n    task: t\n    setting: s\n"
    table = "tables:\n  t:\n    columns: [a, b]\n    rows:\n      - groups: {g: [GROUP]}\n        cells: CELLS\n"
    manifest = tmp_path / "manifest.yaml"
    for group, cells, error in (
        ("speed/knn", "[one]", "a row of 1 cells under 2 columns"),
        ("speed/other", "[one, two]", "it pools speed/other, which is not among its results"),
        ("speed/knn", "[one, b: two]", "a cell that is not text"),
    ):
        manifest.write_text("questions:\n  speed: x.md\n" + results + table.replace("GROUP", group).replace("CELLS", cells))
        with pytest.raises(ValueError, match=error):
            read_manifest(manifest)
    manifest.write_text("questions:\n  speed: x.md\n" + results + table.replace("GROUP", "speed/knn").replace("CELLS", "[one, two]"))
    assert read_manifest(manifest).tables["t"]["rows"][0]["cells"] == ["one", "two"]


def test_every_benchmark_writes_into_the_layout_by_default():
    """Each benchmark's default --output comes from bench/common.py's results_path under its own name, never a path
    spelled out; feedback_efficiency.py's depends on what ran."""
    writers = [path for path in sorted((REPO / "bench").glob("*.py")) if '"--output"' in path.read_text()]
    assert len(writers) >= 10
    for path in writers:
        source = path.read_text()
        assert f'results_path("{path.stem}"' in source and '"bench" / "results"' not in source, path.name
    options = {"env_id": "dm_control/walker-walk-v0", "algorithm": "sac", "variant": "qpa", "labels": 100, "terminate_when_unhealthy": True}
    options |= dict(feedback_efficiency.TEACHER_FLAGS)
    default = feedback_efficiency.default_output
    assert default(argparse.Namespace(**options)) == RESULTS / "feedback_efficiency" / "walker-walk" / "qpa.json"
    noisy = argparse.Namespace(**options | {"teacher_eps_mistake": 0.2, "robust_labels": "rime"})
    assert default(noisy) == RESULTS / "feedback_efficiency" / "noisy-teachers" / "walker-walk-qpa-100-rime.json"
    ppo = argparse.Namespace(**options | {"algorithm": "ppo", "env_id": "CartPole-v1"})
    assert default(ppo) == RESULTS / "feedback_efficiency" / "pref-ppo" / "cartpole.json"
