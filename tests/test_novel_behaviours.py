"""bench/novel_behaviours.py: each preference run on a behaviour's objective is set against SAC
trained on that objective as its reward, same seed and steps, and the ratio is read from the two runs' summaries."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


BENCH = [
    sys.executable, str(REPO / "bench/novel_behaviours.py"), "--behaviour", "hopper-backflip", "--seeds", "2",
    "--labels", "4", "--explore-steps", "200", "--feedback-frequency", "100", "--queries-per-session", "2",
    "--evaluation-frequency", "200", "--evaluation-episodes", "1",
]  # fmt: skip


def test_the_backflip_bench_runs_sac_on_the_objective_beside_each_preference_run(tmp_path):
    from test_end_to_end import scalars

    command = [*BENCH, "--steps", "400", "--workdir", str(tmp_path / "work"), "--output", str(tmp_path / "backflip.json")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads((tmp_path / "backflip.json").read_text())
    [row] = report["rows"]
    runs = tmp_path / "work" / "runs"
    [preference_run] = [path for path in runs.iterdir() if not path.name.endswith("__sac")]
    ceiling_run = runs / f"{preference_run.name}__sac"
    ceiling_args = json.loads((ceiling_run / "args.json").read_text())
    assert ceiling_args["reward_objective"] == "hopper-backflip" and ceiling_args["seed"] == 2
    assert ceiling_args["total_timesteps"] == 400 and ceiling_args["terminate_when_unhealthy"] is False  # set by the objective
    # Neither fall nor tilt ends an episode: no episode of either run ends in 400 steps (Hopper's time limit is 1000).
    for run in (preference_run, ceiling_run):
        recorded = json.loads((run / "args.json").read_text())
        assert recorded["terminate_when_unhealthy"] is False and recorded["terminate_when_tilted"] is False
        assert "charts/episodic_length" not in scalars(run)
    ceiling = json.loads((ceiling_run / "summary.json").read_text())
    preference = json.loads((preference_run / "summary.json").read_text())
    assert row["ceiling_objective_return"] == ceiling["final_objective_return"]
    assert row["ceiling_objective_success"] == ceiling["final_objective_success"]
    assert row["objective_return"] == preference["final_objective_return"] and row["labels"] == 4
    # beside the torso-height counter's flips, the landed ones, for both runs and over their evaluations
    assert row["objective_landed_backflips"] == preference["final_objective_landed_backflips"]
    assert row["ceiling_objective_landed_backflips"] == ceiling["final_objective_landed_backflips"]
    assert [step for step, _ in row["ceiling_objective_landed_backflips_curve"]] == [200, 400]
    assert row["return_ratio"] == pytest.approx(preference["final_objective_return"] / ceiling["final_objective_return"])
    assert "--explore-steps 200" in report["command"] and "--queries-per-session 2" in report["command"]
    # The evaluations over the run, from TensorBoard: the last is the summary's final one; two are too few for a last-3 mean.
    assert [step for step, _ in row["objective_curve"]] == [200, 400]
    assert row["objective_curve"][-1][1] == pytest.approx(preference["final_objective_return"], rel=1e-5)
    assert row["ceiling_objective_success_curve"][-1][1] == pytest.approx(ceiling["final_objective_success"], rel=1e-5)
    assert row["objective_return_last3"] is None and "return_ratio_last3" not in row

    # --reuse-finished in the same workdir reads both finished runs and starts nothing.
    reuse = [*BENCH, "--steps", "400", "--workdir", str(tmp_path / "work"), "--output", str(tmp_path / "reuse.json")]
    result = subprocess.run([*reuse, "--reuse-finished"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert sorted(path.name for path in runs.iterdir()) == sorted([preference_run.name, ceiling_run.name])
    reused = json.loads((tmp_path / "reuse.json").read_text())
    assert reused["rows"][0] | {"wall_seconds": None} == row | {"wall_seconds": None}
    assert "--reuse-finished" in reused["command"]

    # Another invocation reads that ceiling instead of running SAC again, with its own preference flags.
    again = [*BENCH, "--steps", "400", "--workdir", str(tmp_path / "again"), "--output", str(tmp_path / "again.json")]
    again += ["--ceiling-from", str(tmp_path / "work"), "--preference-flags=--no-surf --reward-ensemble-size 2"]
    result = subprocess.run(again, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    [row] = json.loads((tmp_path / "again.json").read_text())["rows"]
    assert row["ceiling_run"] == ceiling_run.name and row["ceiling_objective_return"] == ceiling["final_objective_return"]
    [run] = (tmp_path / "again" / "runs").iterdir()  # no SAC run of its own
    run_args = json.loads((run / "args.json").read_text())
    assert run_args["surf"] is False and run_args["reward_ensemble_size"] == 2

    # Ceilings of other settings are refused before anything runs: the same seed and objective, but 400 steps, not 900.
    other = [*BENCH, "--steps", "900", "--workdir", str(tmp_path / "other"), "--output", str(tmp_path / "other.json")]
    result = subprocess.run([*other, "--ceiling-from", str(tmp_path / "work")], capture_output=True, text=True, timeout=600)
    assert result.returncode != 0 and "no SAC run there started with" in result.stderr and "--total-timesteps 900" in result.stderr
    assert not (tmp_path / "other").exists()

    # A shorter invocation reads the 400-step ceiling at its evaluation at 200 steps: its first 200 steps are that run.
    shorter = [*BENCH, "--steps", "200", "--workdir", str(tmp_path / "shorter"), "--output", str(tmp_path / "shorter.json")]
    result = subprocess.run([*shorter, "--ceiling-from", str(tmp_path / "work")], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    [row] = json.loads((tmp_path / "shorter.json").read_text())["rows"]
    at_200 = {tag: dict(values)[200] for tag, values in scalars(ceiling_run).items() if tag.startswith("eval/")}
    assert row["ceiling_run"] == ceiling_run.name and row["steps"] == 200
    assert row["ceiling_objective_return"] == at_200["eval/objective_return"] != ceiling["final_objective_return"]
    assert row["ceiling_objective_success"] == at_200["eval/objective_success"]
    assert row["ceiling_env_return"] == at_200["eval/mean_return"]
    assert row["ceiling_objective_landed_backflips"] == at_200["eval/objective_landed_backflips"]
    assert [step for step, _ in row["ceiling_objective_curve"]] == [200]
    assert row["return_ratio"] == pytest.approx(row["objective_return"] / at_200["eval/objective_return"])
    assert [run.name.endswith("__sac") for run in (tmp_path / "shorter" / "runs").iterdir()] == [False]

    # On a machine where that workdir is gone, the results file it wrote stands in: its ceiling figures are copied.
    recorded = [*BENCH, "--steps", "400", "--workdir", str(tmp_path / "recorded"), "--output", str(tmp_path / "recorded.json")]
    result = subprocess.run([*recorded, "--ceiling-results", str(tmp_path / "backflip.json")], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads((tmp_path / "recorded.json").read_text())
    [copied] = report["rows"]
    original = json.loads((tmp_path / "backflip.json").read_text())["rows"][0]
    assert {key: value for key, value in copied.items() if key.startswith("ceiling_") and key != "ceiling_results"} == {
        key: value for key, value in original.items() if key.startswith("ceiling_")
    }
    assert copied["ceiling_results"] == str(tmp_path / "backflip.json") and copied["run"] != original["run"]
    assert copied["return_ratio"] == pytest.approx(copied["objective_return"] / original["ceiling_objective_return"])
    assert f"--ceiling-results {tmp_path / 'backflip.json'}" in report["command"]
    assert [run.name.endswith("__sac") for run in (tmp_path / "recorded" / "runs").iterdir()] == [False]
    # Ceilings of other steps, or of a seed the file lacks, are refused in one line before anything runs.
    for wrong, named in ((["--steps", "900"], "steps 400"), (["--steps", "400", "--seeds", "3"], "seed 3")):
        wrong_args = [*BENCH, *wrong, "--workdir", str(tmp_path / "wrong"), "--ceiling-results", str(tmp_path / "backflip.json")]
        result = subprocess.run(wrong_args, capture_output=True, text=True, timeout=600)
        assert result.returncode != 0 and named in result.stderr and len(result.stderr.strip().splitlines()) == 1
        assert not (tmp_path / "wrong").exists()
    # A results file whose command this bench cannot parse is refused in one line too (no usage text before it).
    tampered = json.loads((tmp_path / "backflip.json").read_text())
    tampered["command"] += " --no-such-flag"
    (tmp_path / "tampered.json").write_text(json.dumps(tampered))
    wrong_args = [*BENCH, "--steps", "400", "--workdir", str(tmp_path / "wrong"), "--ceiling-results", str(tmp_path / "tampered.json")]
    result = subprocess.run(wrong_args, capture_output=True, text=True, timeout=600)
    assert result.returncode != 0 and "--no-such-flag" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "wrong").exists()


def test_env_flags_shape_the_environment_of_the_preference_run_and_its_ceiling_alike(tmp_path):
    """--env-flags=--terminate-when-unhealthy: both runs end episodes when the Hopper falls, while the backflip still
    keeps the angle termination off (without it, no episode ends: the test above)."""
    from test_end_to_end import scalars

    env_flags = "--env-flags=--terminate-when-unhealthy"
    command = [*BENCH, "--steps", "400", "--workdir", str(tmp_path / "work"), "--output", str(tmp_path / "falls_end.json"), env_flags]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert env_flags in json.loads((tmp_path / "falls_end.json").read_text())["command"]
    runs = sorted((tmp_path / "work" / "runs").iterdir())
    assert [run.name.endswith("__sac") for run in runs] == [False, True]
    for run in runs:  # random actions topple it: episodes end, each within the 400 steps
        recorded = json.loads((run / "args.json").read_text())
        assert recorded["terminate_when_unhealthy"] is True and recorded["terminate_when_tilted"] is False
        lengths = [length for _, length in scalars(run).get("charts/episodic_length", [])]
        assert lengths and all(length < 400 for length in lengths)


def test_a_run_is_reused_only_where_every_flag_it_would_be_started_with_agrees():
    sys.path.insert(0, str(REPO / "bench"))
    from common import started_with

    recorded = {"exp_name": "sac_rlhf", "seed": 2, "surf": False, "cuda": False, "reward_net_lr": 0.0003, "env_id": "Hopper-v5"}
    flags = ["--env-id", "Hopper-v5", "--seed", "2", "--run-name", "anything", "--no-surf", "--reward-net-lr", "3e-4", "--no-cuda"]
    assert started_with("sac_rlhf.py", flags, recorded)
    assert not started_with("sac.py", flags, recorded)  # another script's run
    assert not started_with("sac_rlhf.py", [*flags[:3], "3", *flags[4:]], recorded)  # another seed
    assert not started_with("sac_rlhf.py", flags[:-1], recorded)  # --cuda's default (on) is not what it ran with
    assert not started_with("sac_rlhf.py", [*flags, "--total-timesteps", "600"], recorded)  # a setting it does not record
    # A setting the flags leave at its default must be the default there too: a noisy teacher's run is not the
    # oracle's (the reused run feedback_efficiency.py --reuse-finished once picked for the oracle).
    assert not started_with("sac_rlhf.py", flags, recorded | {"teacher_eps_mistake": 0.2})
    assert started_with("sac_rlhf.py", flags, recorded | {"teacher_eps_mistake": 0.0})
    assert started_with("sac_rlhf.py", [*flags, "--teacher-eps-mistake", "0.2"], recorded | {"teacher_eps_mistake": 0.2})


def test_a_setting_that_acts_only_with_another_defence_does_not_keep_a_run_from_being_reused():
    """A defence's settings compute nothing in a run without it: an oracle run that recorded --rime-warm-start-steps
    1000 (every defence's settings were once recorded by every run) is the run the same flags start today, and resumes as
    it; a RIME run (sac_rlhf_rime.py) with another warm start is not."""
    sys.path.insert(0, str(REPO / "bench"))
    from common import started_with

    recorded = {"exp_name": "sac_rlhf", "seed": 2, "env_id": "Hopper-v5", "robust_labels": "none", "rime_warm_start_steps": 1000}
    recorded |= {"robust_label_epsilon": 0.3}
    flags = ["--env-id", "Hopper-v5", "--seed", "2"]
    assert started_with("sac_rlhf.py", flags, recorded)
    rime = {"exp_name": "sac_rlhf_rime", "seed": 2, "env_id": "Hopper-v5", "rime_warm_start_steps": 1000}
    assert not started_with("sac_rlhf_rime.py", flags, rime)  # the warm start acts there
    assert started_with("sac_rlhf_rime.py", [*flags, "--rime-warm-start-steps", "1000"], rime)
    mistake_aware = {"exp_name": "sac_rlhf_mistake_aware", "seed": 2, "env_id": "Hopper-v5", "label_mistake_rate": 0.3}
    assert not started_with("sac_rlhf_mistake_aware.py", flags, mistake_aware)  # 0.3, not the default 0.1
    assert started_with("sac_rlhf_mistake_aware.py", [*flags, "--label-mistake-rate", "0.3"], mistake_aware)


def test_only_a_run_that_ran_to_its_end_is_reused(tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    from novel_behaviours import earlier_run

    flags = ["--seed", "2", "--run-name", "anything"]
    for name, summary in (("a_running", None), ("b_interrupted", {"interrupted": True}), ("c_finished", {"interrupted": False})):
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "args.json").write_text(json.dumps({"exp_name": "sac", "seed": 2}))
        if summary is not None:
            (tmp_path / "runs" / name / "summary.json").write_text(json.dumps(summary))
    assert earlier_run(tmp_path, "sac.py", flags, finished=True).name == "c_finished"
    assert earlier_run(tmp_path, "sac.py", flags, finished=False).name == "a_running"  # --ceiling-from: running is enough
    (tmp_path / "runs" / "c_finished" / "summary.json").write_text(json.dumps({"interrupted": True}))
    assert earlier_run(tmp_path, "sac.py", flags, finished=True) is None


def test_an_unfinished_run_is_resumed_from_its_furthest_checkpoint(tmp_path):
    """--resume-unfinished: a run with the same flags that stopped before its end (the session went away) continues
    from its last checkpoint under its own name; the furthest of two such runs is taken, a finished one is not, and a
    run without a checkpoint, or of other flags, is not resumed."""
    import argparse

    import torch

    sys.path.insert(0, str(REPO / "bench"))
    from novel_behaviours import start_unless_finished

    def make_run(name: str, seed: int, summary: dict | None, checkpoint_step: int | None) -> None:
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "args.json").write_text(json.dumps({"exp_name": "sac", "seed": seed, "checkpoint_frequency": 100}))
        if summary is not None:
            (tmp_path / "runs" / name / "summary.json").write_text(json.dumps(summary))
        if checkpoint_step is not None:
            (tmp_path / "models" / name / "latest").mkdir(parents=True)
            torch.save({"loop": {"global_step": checkpoint_step}}, tmp_path / "models" / name / "latest" / "checkpoint.pt")

    make_run("a_killed_early", 2, None, 10_000)
    make_run("b_killed_later", 2, None, 40_000)
    make_run("c_interrupted", 2, {"interrupted": True}, 30_000)
    make_run("d_no_checkpoint", 2, None, None)
    make_run("e_other_seed", 3, None, 90_000)
    make_run("f_finished", 2, {"interrupted": False}, 300_000)
    flags = ["--seed", "2", "--run-name", "new", "--checkpoint-frequency", "10000"]
    settings = argparse.Namespace(workdir=tmp_path, reuse_finished=False, resume_unfinished=True)
    jobs = []
    assert start_unless_finished(settings, jobs, "sac.py", flags, "new") == tmp_path / "runs" / "b_killed_later"
    assert jobs == [("sac.py", ["--seed", "2", "--run-name", "b_killed_later", "--checkpoint-frequency", "10000",
                                "--resume", "models/b_killed_later/latest"], "b_killed_later")]  # fmt: skip
    jobs = []  # --reuse-finished first: a finished run is read, nothing starts
    assert (
        start_unless_finished(argparse.Namespace(**vars(settings) | {"reuse_finished": True}), jobs, "sac.py", flags, "new").name
        == "f_finished"
    )
    assert jobs == []
    jobs = []  # without the flag, or for a seed none stopped at: a new run
    assert (
        start_unless_finished(argparse.Namespace(**vars(settings) | {"resume_unfinished": False}), jobs, "sac.py", flags, "new").name
        == "new"
    )
    assert start_unless_finished(settings, jobs, "sac.py", ["--seed", "4", *flags[2:]], "new4").name == "new4"
    assert [name for *_, name in jobs] == ["new", "new4"]
