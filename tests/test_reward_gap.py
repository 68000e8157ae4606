"""Why a good ranking can train a weaker agent: SAC on a frozen learned reward (bench/frozen_reward.py, sac.py on another
run's reward model), what the runs measure to tell the gaps apart (per-segment correlation, the reward's scale, SAC's
Q-values and entropy), the agent reset after a session that changes the reward, and bench/reward_gap.py, which runs the
decomposition."""

import json
import os
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from test_bench import bench_module
from test_end_to_end import assert_same_training, final_state, scalars, small_args

import sac_rlhf
import sac_rlhf_agent_reset

REPO = Path(__file__).resolve().parents[1]
OBS_DIM, ACTION_DIM = 3, 1


def model_predictions(model, replay: dict) -> np.ndarray:
    obs_actions = np.concatenate([replay["obs"], replay["actions"]], axis=-1)
    mean, _ = sac_rlhf.predict_rewards(model, torch.as_tensor(obs_actions))
    return mean.numpy()


# ----------------------------------------------------------------------------------------
# SAC on a frozen learned reward
# ----------------------------------------------------------------------------------------
def frozen_args(name: str, **overrides):
    """bench/frozen_reward.py's Args: sac.py's, cut as small_args cuts PEBBLE's."""
    frozen_reward = frozen_bench()
    pebble = small_args(name)
    shared = {key: getattr(pebble, key) for key in ("env_id", "seed", "total_timesteps", "learning_starts", "batch_size")}
    shared |= {key: getattr(pebble, key) for key in ("actor_hidden_dim", "critic_hidden_dim", "evaluation_episodes", "progress_bar")}
    return frozen_reward.Args(**{"run_name": name, "evaluation_frequency": 0} | shared | overrides)


def frozen_bench():
    return bench_module("frozen_reward")


def test_a_frozen_reward_run_is_sac_on_the_loaded_model_which_it_never_changes(chdir_tmp):
    frozen_reward = frozen_bench()
    sac_rlhf.main(small_args("source", total_timesteps=800, learned_reward_std=1.0))
    source = torch.load("models/source/latest/checkpoint.pt", weights_only=False)["reward_model"]
    model = sac_rlhf.RewardEnsemble(source["input_mean"].shape[0], 3, 64, 3)
    model.load_state_dict(source)
    # the source run's SAC learned the reward at std 1 over its buffer: so does the frozen run, at that fixed scale
    scale = 1.0 / float(model_predictions(model, final_state("source")["replay"]).std(dtype=np.float64))

    args = frozen_args("frozen", reward_model_from="models/source/latest", total_timesteps=700, evaluation_frequency=300)
    summary = frozen_reward.main(args)
    state = final_state("frozen")
    assert "reward_model" not in state["checkpoint"] and "labels_obtained" not in summary  # sac.py: no teacher, no labels
    replay = state["replay"]
    assert summary["frozen_reward_scale"] == pytest.approx(scale, rel=1e-5) and abs(scale - 1) > 0.05
    np.testing.assert_allclose(replay["learned_rewards"], scale * model_predictions(model, replay), rtol=1e-5, atol=1e-6)
    unscaled = frozen_reward.main(replace(args, run_name="unscaled", learned_reward_std=0.0, total_timesteps=300))
    assert unscaled["frozen_reward_scale"] == 1.0
    unscaled_replay = final_state("unscaled")["replay"]
    np.testing.assert_allclose(unscaled_replay["learned_rewards"], model_predictions(model, unscaled_replay), atol=1e-6)
    assert np.abs(replay["learned_rewards"]).max() > 0 and np.abs(replay["true_rewards"]).max() > 0  # the env's reward kept apart
    tags = scalars(Path("runs/frozen"))
    assert "exploration/intrinsic_reward" not in tags and not Path("models/frozen/400").exists()  # no exploration
    assert len(tags["losses/qf_loss"]) == (700 - args.learning_starts) // 100  # SAC on it from --learning-starts on
    assert summary["reward_model_from"] == "models/source/latest"
    recorded = json.loads(Path("runs/frozen/summary.json").read_text())
    for name in ("reward_correlation", "segment_correlation", "heldout_accuracy", "learned_reward_std", "true_reward_std"):
        assert recorded[name] is not None and np.isfinite(recorded[name]), name  # the model on this run's own buffer
    assert recorded["true_reward_std"] == pytest.approx(float(replay["true_rewards"].std()), rel=1e-5)  # against the env's
    assert np.isfinite([summary["final_policy_entropy"], summary["final_qf1_values"], summary["final_alpha"]]).all()


def test_bad_frozen_reward_sources_are_refused_in_one_line(chdir_tmp):
    import sac

    frozen_reward = frozen_bench()
    with pytest.raises(sac_rlhf.ConfigError, match="no checkpoint there"):
        frozen_reward.main(frozen_args("missing", reward_model_from="models/nope/latest"))
    tiny = {"batch_size": 32, "actor_hidden_dim": 32, "critic_hidden_dim": 32, "evaluation_frequency": 0, "evaluation_episodes": 1}
    sac.main(sac.Args(run_name="base", total_timesteps=300, learning_starts=200, progress_bar=False, **tiny))
    with pytest.raises(sac_rlhf.ConfigError, match="holds no reward model"):
        frozen_reward.main(frozen_args("from_sac", reward_model_from="models/base/latest"))
    sac_rlhf.main(small_args("source", total_timesteps=500, teacher_feedback_total_queries=10))
    with pytest.raises(sac_rlhf.ConfigError, match="learned on Hopper-v5, this run is on Walker2d-v5"):
        frozen_reward.main(frozen_args("other_env", env_id="Walker2d-v5", reward_model_from="models/source/latest"))
    saved = torch.load("models/source/latest/checkpoint.pt", weights_only=False)
    saved["reward_model"]["input_mean"] = torch.zeros(5)  # as if learned on other observation and action sizes
    torch.save(saved, "resized.pt")
    with pytest.raises(sac_rlhf.ConfigError, match="takes 5 inputs, this run's observation and action have 14"):
        frozen_reward.main(frozen_args("resized", reward_model_from="resized.pt"))
    torch.save(torch.load("models/source/latest/checkpoint.pt", weights_only=False), "alone.pt")  # no buffer beside
    with pytest.raises(sac_rlhf.ConfigError, match="no replay_buffer.npz beside its checkpoint"):
        frozen_reward.main(frozen_args("alone", reward_model_from="alone.pt", learned_reward_std=1.0))
    with pytest.raises(sac_rlhf.ConfigError, match="--learned-reward-std -1.0: must be >= 0"):
        frozen_reward.main(frozen_args("negative", reward_model_from="models/source/latest", learned_reward_std=-1.0))
    for refused in ("missing", "resized", "alone", "negative"):
        assert not Path("runs", refused).exists()  # refused before anything is written

    command = [sys.executable, str(REPO / "bench/frozen_reward.py"), "--reward-model-from", "models/nope/latest"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: --reward-model-from models/nope/latest: no checkpoint there (give models/<run>/latest or its checkpoint.pt)"
    ]


# ----------------------------------------------------------------------------------------
# What the runs measure
# ----------------------------------------------------------------------------------------
def buffer_with(algo, true: np.ndarray, learned: np.ndarray, episode_length: int = 100):
    rb = algo.ReplayBuffer(len(true), OBS_DIM, ACTION_DIM, 1)
    for i, reward in enumerate(true):
        rb.add(np.zeros(OBS_DIM), np.zeros(OBS_DIM), np.zeros(ACTION_DIM), reward, 0.0, i // episode_length, np.zeros(1))
    rb.learned_rewards[:] = learned
    return rb


def test_segment_correlation_sees_the_returns_where_the_step_correlation_sees_the_steps():
    from cleanrlhf_utils.diagnostics import reward_correlation, reward_scale, segment_correlation

    rng = np.random.default_rng(0)
    true = np.repeat(rng.standard_normal(100), 20).astype(np.float32)  # slow: each value holds 20 steps
    affine = buffer_with(sac_rlhf, true, 0.5 * true - 3.0)
    assert segment_correlation(affine, affine.true_rewards, 200, 20, np.random.default_rng(1)) == pytest.approx(1.0, abs=1e-6)
    assert reward_correlation(affine, affine.true_rewards) == pytest.approx(1.0, abs=1e-6)
    # Fast noise of +-3 that cancels over every even-length segment: each step is mostly noise, each return exact.
    jitter = true + np.where(np.arange(len(true)) % 2 == 0, 3.0, -3.0).astype(np.float32)
    noisy = buffer_with(sac_rlhf, true, jitter)
    assert reward_correlation(noisy, noisy.true_rewards) < 0.5
    segments = segment_correlation(noisy, noisy.true_rewards, 200, 20, np.random.default_rng(1))
    assert segments > 0.95  # whole segments of 20 steps; those cut short by an episode's end keep a little noise
    scale = reward_scale(affine, affine.true_rewards)
    assert scale["learned_reward_mean"] == pytest.approx(0.5 * true.mean() - 3.0, abs=1e-5)
    assert scale["learned_reward_std"] == pytest.approx(0.5 * true.std(), rel=1e-5)
    assert scale["true_reward_std"] == pytest.approx(true.std(), rel=1e-5)


def test_a_preference_run_logs_the_measurements_at_sessions_and_sac_its_entropy(chdir_tmp):
    summary = sac_rlhf.main(small_args("measured", total_timesteps=800))
    tags = scalars(Path("runs/measured"))
    for name in ("segment_correlation", "learned_reward_std", "learned_reward_mean", "true_reward_std"):
        assert len(tags[f"reward_model/{name}"]) == summary["feedback_sessions"] == 2, name
        assert name in summary
    entropy = [value for _, value in tags["losses/policy_entropy"]]
    assert len(entropy) > 3 and summary["final_policy_entropy"] == pytest.approx(np.mean(entropy[-10:]), rel=1e-5)
    q_values = [value for _, value in tags["losses/qf1_values"]]
    assert summary["final_qf1_values"] == pytest.approx(np.mean(q_values[-10:]), rel=1e-5)


# ----------------------------------------------------------------------------------------
# sac_rlhf_agent_reset.py: --reset-agent-below-correlation
# ----------------------------------------------------------------------------------------
def test_reward_change_correlation_ignores_scale_and_offset_and_sees_a_new_ranking():
    rng = np.random.default_rng(0)
    before = rng.normal(size=500).astype(np.float32)
    assert sac_rlhf.reward_change_correlation(before, 3.0 * before - 2.0) == pytest.approx(1.0, abs=1e-6)
    assert sac_rlhf.reward_change_correlation(before, -before) == pytest.approx(-1.0, abs=1e-6)
    unrelated = sac_rlhf.reward_change_correlation(before, rng.normal(size=500).astype(np.float32))
    assert abs(unrelated) < 0.15
    assert np.isnan(sac_rlhf.reward_change_correlation(np.zeros(500, np.float32), before))  # no learned reward yet


def test_a_relabels_change_is_measured_on_the_rows_that_had_a_learned_reward():
    """relabel: the rows still waiting for a batch (PendingRewards) had no learned reward to compare with."""
    from cleanrlhf_utils.buffers import PendingRewards, ReplayBuffer

    torch.manual_seed(0)
    rb, pending = ReplayBuffer(8, OBS_DIM, ACTION_DIM, 2), PendingRewards()
    for step in range(8):
        rb.add(np.full(OBS_DIM, step, np.float32), np.zeros(OBS_DIM), np.zeros(ACTION_DIM), 0.0, False, 0, np.zeros(2))
        if step >= 4:
            pending.add(rb)
    model = sac_rlhf.RewardEnsemble(OBS_DIM + ACTION_DIM, 2, 16, 1)
    sac_rlhf.relabel_replay_buffer(model, rb, torch.device("cpu"))
    rb.learned_rewards[4:] = 99.0  # the waiting rows' values: left out, or the correlation would not be 1
    pending = PendingRewards()
    for _ in range(4):
        pending.add(rb)
    assert sac_rlhf.relabel(model, rb, pending, torch.device("cpu")) == pytest.approx(1.0, abs=1e-6)
    assert pending.count == 0 and (rb.learned_rewards[4:] != 99.0).all()  # every row relabelled


def test_starting_sac_afresh_gives_fresh_networks_the_initial_temperature_and_fresh_optimisers():
    import gymnasium as gym

    torch.manual_seed(0)
    args = sac_rlhf.Args(actor_hidden_dim=32, critic_hidden_dim=32, alpha=0.2)
    agent = sac_rlhf.SACAgent(OBS_DIM, gym.spaces.Box(-1.0, 1.0, (ACTION_DIM,), np.float32), args, torch.device("cpu"))
    batch = [torch.randn(64, OBS_DIM), torch.rand(64, ACTION_DIM) * 2 - 1, torch.randn(64), torch.randn(64, OBS_DIM), torch.zeros(64)]
    for step in range(50):
        agent.update(*batch, global_step=step)
    actor, trained_actor = agent.actor, {k: v.clone() for k, v in agent.actor.state_dict().items()}
    trained_qf = {k: v.clone() for k, v in agent.qf.state_dict().items()}
    assert abs(agent.log_alpha.item() - np.log(0.2)) > 0.01 and agent.actor_optimizer.state

    sac_rlhf.start_afresh(agent)
    assert agent.actor is actor  # in place: a policy compiled from it acts with the new weights
    for name in ("trunk.0.weight", "fc_mean.weight", "fc_logstd.bias"):
        assert not torch.equal(agent.actor.state_dict()[name], trained_actor[name]), name
    assert all(not torch.equal(value, trained_qf[name]) for name, value in agent.qf.state_dict().items())
    for name, value in agent.qf_target.state_dict().items():
        assert torch.equal(value, agent.qf.state_dict()[name]), name
    assert agent.log_alpha.item() == pytest.approx(np.log(0.2), abs=1e-7)
    assert not agent.actor_optimizer.state and not agent.q_optimizer.state and not agent.alpha_optimizer.state
    # nn.Linear's initialisation, as a new agent's: weights within 1/sqrt(fan_in)
    assert agent.actor.trunk[0].weight.abs().max().item() <= 1 / np.sqrt(OBS_DIM)
    fresh_actor, fresh_qf = agent.actor.trunk[0].weight.detach().clone(), agent.qf.state_dict()["net.0.weight"].clone()
    agent.update(*batch, global_step=0)  # and it trains: the new optimisers hold the actor's and the critics' parameters
    assert not torch.equal(agent.actor.trunk[0].weight, fresh_actor)
    assert not torch.equal(agent.qf.state_dict()["net.0.weight"], fresh_qf)


def reset_args(name: str, reset_agent_below_correlation: float = -1.0, **overrides) -> sac_rlhf_agent_reset.Args:
    """small_args for the variant that starts SAC afresh (sac_rlhf_agent_reset.py)."""
    settings = vars(small_args(name, **overrides))
    return sac_rlhf_agent_reset.Args(**settings, reset_agent_below_correlation=reset_agent_below_correlation)


def test_a_run_starts_sac_afresh_after_sessions_that_change_the_reward_and_resumes_exactly(chdir_tmp):
    never = sac_rlhf_agent_reset.main(reset_args("never"))  # 1200 steps: sessions at 400, 700 and 1000
    tags = scalars(Path("runs/never"))
    changes = [value for _, value in tags["feedback/reward_change_correlation"]]
    assert len(changes) == 3 and np.isnan(changes[0])  # the first session has no earlier learned reward
    assert all(-1 < change < 1 for change in changes[1:])
    assert [value for _, value in tags["feedback/agent_resets"]] == [0, 0, 0] and never["agent_resets"] == 0

    always = {"reset_agent_below_correlation": 1.0}  # every later session changes the reward somewhat
    summary = sac_rlhf_agent_reset.main(reset_args("always", **always))
    assert [value for _, value in scalars(Path("runs/always"))["feedback/agent_resets"]] == [0, 1, 2]
    assert summary["agent_resets"] == 2
    # Stopped right after the second session: the temperature is back at its start, one update away from it.
    sac_rlhf_agent_reset.main(reset_args("cut", total_timesteps=701, **always))
    sac_rlhf_agent_reset.main(reset_args("cut_never", total_timesteps=701))
    log_alpha = {name: float(final_state(name)["checkpoint"]["agent"]["log_alpha"]) for name in ("cut", "cut_never")}
    assert abs(log_alpha["cut"] - np.log(0.2)) < 3e-3 < abs(log_alpha["cut_never"] - np.log(0.2))

    sac_rlhf_agent_reset.main(reset_args("part", total_timesteps=800, **always))  # stopped between sessions 2 and 3
    sac_rlhf_agent_reset.main(reset_args("part", resume="models/part/latest", **always))
    resumed = final_state("part")
    assert_same_training(final_state("always"), resumed)
    assert resumed["checkpoint"]["after_session"]["resets"] == 2


# ----------------------------------------------------------------------------------------
# bench/reward_gap.py
# ----------------------------------------------------------------------------------------
def test_the_reward_gap_bench_runs_its_kinds_on_one_seed_and_reads_them_back_when_reused(tmp_path):
    run_flags = "--learning-starts 100 --batch-size 32 --actor-hidden-dim 32 --critic-hidden-dim 32"
    preference_flags = (
        "--reward-net-hidden-dim 32 --reward-net-epochs 3 --segment-length 20 --max-augmentation-offset 5 "
        "--min-augmentation-offset 2 --explore-knn-sample-size 200"
    )
    command = [
        sys.executable, str(REPO / "bench/reward_gap.py"), "--tasks", "Hopper-v5", "--seeds", "1", "--steps", "500",
        "--explore-steps", "200", "--labels", "10", "--sessions", "2", "--evaluation-frequency", "250",
        "--evaluation-episodes", "1", f"--run-flags={run_flags}", f"--preference-flags={preference_flags}",
        "--workdir", str(tmp_path / "work"), "--output", str(tmp_path / "gap.json"), "--parallel", "2",
        "--kinds", "sac", "online", "frozen", "oracle",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads((tmp_path / "gap.json").read_text())
    rows = {row["kind"]: row for row in report["rows"]}
    assert sorted(rows) == ["frozen", "online", "oracle", "sac"] and all(row["seed"] == 1 for row in report["rows"])
    assert rows["frozen"]["reward_model_from"] == f"models/{rows['online']['run_name']}/latest"  # from the workdir
    online = json.loads((tmp_path / "work" / "runs" / rows["online"]["run_name"] / "args.json").read_text())
    assert online["teacher_feedback_total_queries"] == 10 and online["teacher_feedback_schedule"] == "linear"  # tuned
    frozen = json.loads((tmp_path / "work" / "runs" / rows["frozen"]["run_name"] / "args.json").read_text())
    assert frozen["exp_name"] == "frozen" and "teacher_feedback_mode" not in frozen  # sac.py's settings: no teacher
    assert frozen["learned_reward_std"] == online["learned_reward_std"]  # the scale the online run's SAC learned at
    oracle = json.loads((tmp_path / "work" / "runs" / rows["oracle"]["run_name"] / "args.json").read_text())
    assert oracle["exp_name"] == "oracle_loop" and oracle["reward_scale"] == 1.0  # the online run's loop, the env's reward
    assert {k: v for k, v in oracle.items() if k not in ("exp_name", "run_name", "reward_scale")} == {
        k: v for k, v in online.items() if k not in ("exp_name", "run_name")
    }
    for row in rows.values():
        assert [step for step, _ in row["eval_curve"]] == [250, 500]
        assert row["final_eval_return"] == pytest.approx(row["eval_curve"][-1][1], rel=1e-5)
        assert row["final_policy_entropy"] is not None and row["final_alpha"] is not None
    assert rows["online"]["segment_correlation"] is not None and rows["sac"]["segment_correlation"] is None
    assert rows["sac"]["learned_reward_std"] == rows["sac"]["true_reward_std"]  # SAC's reward is the true one
    kinds = {entry["kind"]: entry for entry in report["decomposition"]}
    assert kinds["sac"]["final_eval_return_ratio"]["median"] == 1.0
    assert report["settings"]["tasks_resolved"]["Hopper-v5"] == {"variant": "tuned", "labels": 10, "feedback_frequency": 225}
    assert "median [interquartile range]" in result.stdout

    # --reuse-finished: every run finished in the workdir with these flags is read, none started
    runs_before = sorted((tmp_path / "work" / "runs").iterdir())
    again = [str(tmp_path / "again.json") if arg == str(tmp_path / "gap.json") else arg for arg in command]
    again.append("--reuse-finished")
    result = subprocess.run(again, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert sorted((tmp_path / "work" / "runs").iterdir()) == runs_before
    reread = {row["kind"]: row for row in json.loads((tmp_path / "again.json").read_text())["rows"]}
    for kind, row in rows.items():
        assert reread[kind]["from"] == "--reuse-finished" and reread[kind]["run_name"] == row["run_name"]
        assert reread[kind]["eval_curve"] == row["eval_curve"]


def test_reward_gap_names_its_runs_as_folders_whatever_the_env_id():
    from cleanrlhf_utils.run import check_run_name

    reward_gap = bench_module("reward_gap")
    for task in ("Hopper-v5", "dm_control/cheetah-run-v0", "ant_without_contact_forces:AntWithoutContactForces-v5"):
        name = reward_gap.gap_run_name("oracle", task, 2, "17_4")
        check_run_name(name)  # raises on a name that is not one folder
        assert name.startswith("gap_oracle_") and name.endswith("_2_17_4")


def test_reward_gap_refuses_frozen_without_online(tmp_path):
    command = [
        sys.executable, str(REPO / "bench/reward_gap.py"), "--tasks", "Hopper-v5", "--workdir", str(tmp_path / "work"),
        "--output", str(tmp_path / "gap.json"), "--kinds", "sac", "frozen",
    ]  # fmt: skip
    refused = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--kinds sac frozen: frozen freezes the online run's" in refused.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "work").exists()


def gap_result(path: Path, returns: dict, steps: int = 100_000) -> Path:
    """A bench/reward_gap.py result with runs of final return returns[(kind, seed)] (and no other measurement)."""
    rows = [
        {"task": "dm_control/cheetah-run-v0", "kind": kind, "seed": seed, "final_eval_return": value, "last_return": value}
        | dict.fromkeys(("run_name", "eval_curve", "segment_correlation", "reward_correlation", "heldout_accuracy"))
        | dict.fromkeys(("learned_reward_mean", "learned_reward_std", "true_reward_std", "final_alpha", "final_q_value"))
        | {"final_policy_entropy": None}
        for (kind, seed), value in returns.items()
    ]
    settings = {"steps": steps, "sessions": 10, "explore_steps": 10_000, "evaluation_frequency": 10_000, "evaluation_episodes": 10}
    settings |= {
        "run_flags": "",
        "preference_flags": "",
        "tasks_resolved": {"dm_control/cheetah-run-v0": {"variant": "qpa", "labels": 100}},
    }
    path.write_text(json.dumps({"benchmark": "reward_gap", "machine": {}, "settings": settings, "rows": rows}))
    return path


def test_combine_reports_the_runs_of_several_invocations_as_one_table_and_refuses_unlike_ones(tmp_path):
    """Seeds run by separate invocations make one decomposition: ratios to SAC seed by seed, medians over all."""
    seed1 = gap_result(tmp_path / "a.json", {("sac", 1): 100, ("frozen", 1): 80, ("online", 1): 50})
    seeds23 = gap_result(
        tmp_path / "b.json",
        {("sac", 2): 200, ("frozen", 2): 100, ("online", 2): 200, ("sac", 3): 100, ("frozen", 3): 100, ("online", 3): 50},
    )
    bench = [sys.executable, str(REPO / "bench/reward_gap.py"), "--combine"]
    result = subprocess.run([*bench, str(seed1), str(seeds23), "--output", str(tmp_path / "all.json")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "all.json").read_text())
    kinds = {entry["kind"]: entry for entry in report["decomposition"]}
    assert kinds["frozen"]["seeds"] == 3 and kinds["frozen"]["final_eval_return_ratio"]["median"] == pytest.approx(0.8)  # 0.8, 0.5, 1
    assert kinds["online"]["final_eval_return_ratio"]["median"] == pytest.approx(0.5)  # 0.5, 1, 0.5
    assert report["settings"]["combined_from"] == [str(seed1), str(seeds23)] and report["machine"] == report["machines"][0]

    # two invocations that reused the same earlier SAC run (--baseline-from) hold one run, not two
    with_reused = [json.loads(path.read_text()) for path in (seed1, seeds23)]
    for result in with_reused:
        result["rows"] = [row | {"from": "fe.json"} if (row["kind"], row["seed"]) == ("sac", 1) else row for row in result["rows"]]
    with_reused[1]["rows"].append(with_reused[0]["rows"][0])
    assert with_reused[0]["rows"][0]["kind"] == "sac"
    for path, result in zip((tmp_path / "r1.json", tmp_path / "r2.json"), with_reused):
        path.write_text(json.dumps(result))
    combined = subprocess.run(
        [*bench, str(tmp_path / "r1.json"), str(tmp_path / "r2.json"), "--output", str(tmp_path / "r.json")], capture_output=True, text=True
    )
    assert combined.returncode == 0, combined.stderr
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert [(row["kind"], row["seed"]) for row in rows].count(("sac", 1)) == 1 and len(rows) == 9

    other_steps = gap_result(tmp_path / "c.json", {("sac", 4): 1, ("frozen", 4): 1, ("online", 4): 1}, steps=50_000)
    no_fall_end = gap_result(tmp_path / "d.json", {("sac", 5): 1, ("frozen", 5): 1, ("online", 5): 1})
    recorded = json.loads(no_fall_end.read_text())
    no_fall_end.write_text(json.dumps(recorded | {"settings": recorded["settings"] | {"terminate_when_unhealthy": False}}))
    for extra, message in [
        (other_steps, "ran with steps=50000"),
        (no_fall_end, "ran with terminate_when_unhealthy=False"),  # a result that predates the setting ended on falls
        (seed1, "more than one run of (task, kind, seed)"),
    ]:
        refused = subprocess.run([*bench, str(seed1), str(extra), "--output", str(tmp_path / "x.json")], capture_output=True, text=True)
        assert refused.returncode != 0 and message in refused.stderr and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
        assert not (tmp_path / "x.json").exists()


# --learned-reward-std and --reset-actor-after-exploration (the Gymnasium MuJoCo findings)


def test_learned_reward_std_gives_sac_the_learned_reward_at_that_std_without_moving_its_zero():
    from cleanrlhf_utils.buffers import ReplayBuffer

    rb = ReplayBuffer(1000, OBS_DIM, ACTION_DIM, 1)
    rb.pos = 800  # 800 filled rows; the rest stay out of the statistics
    rb.learned_rewards[:800] = np.random.default_rng(0).normal(0.1, 0.3, 800)
    rb.learned_rewards[800:] = 50.0
    idx, cpu = np.arange(800), torch.device("cpu")

    args = sac_rlhf.Args(learned_reward_std=1.0)
    loop = sac_rlhf.LoopState(reward_scale=sac_rlhf.sac_reward_scale(rb, args))
    scaled = sac_rlhf.learned_rewards(rb, idx, args, 0, cpu, loop)
    assert scaled.std(unbiased=False).item() == pytest.approx(1.0, rel=1e-5)
    assert torch.allclose(scaled / torch.as_tensor(rb.learned_rewards[:800]), scaled[0] / rb.learned_rewards[0])  # uncentred

    default = sac_rlhf.Args()
    assert sac_rlhf.sac_reward_scale(rb, default) == 1.0
    plain = sac_rlhf.learned_rewards(rb, idx, default, 0, cpu, sac_rlhf.LoopState())
    assert torch.equal(plain, torch.as_tensor(rb.learned_rewards[:800]))
    rb.learned_rewards[:800] = 0.2  # a constant reward has no scale to set: left as it is
    assert sac_rlhf.sac_reward_scale(rb, args) == 1.0
    with pytest.raises(sac_rlhf.ConfigError, match="--learned-reward-std"):
        sac_rlhf.validate_args(sac_rlhf.Args(learned_reward_std=-1.0))


def test_the_nonnegative_reward_experiment_shifts_the_lowest_learned_reward_to_zero_before_the_scale(monkeypatch):
    """bench/nonnegative_reward.py: where episodes end on a fall, a learned reward below zero everywhere makes falling at
    once the best return. Its relabel shifts the buffer's lowest learned reward to exactly nothing, keeps every
    difference, puts the shift in the loop's checkpointed counters, and sac_rlhf.py itself is left as it was."""
    import gymnasium as gym

    from cleanrlhf_utils.buffers import ReplayBuffer

    nonnegative_reward = bench_module("nonnegative_reward")
    for name in ("LoopState", "sac_reward_scale", "reset_after_session", "learned_rewards"):
        monkeypatch.setattr(sac_rlhf, name, getattr(sac_rlhf, name))  # restored after the test
    plain_rewards = sac_rlhf.learned_rewards
    nonnegative_reward.shift_learned_rewards()

    rb = ReplayBuffer(1000, OBS_DIM, ACTION_DIM, 1)
    rb.pos = 800
    rb.learned_rewards[:800] = np.random.default_rng(0).normal(-0.6, 0.2, 800)
    rb.learned_rewards[800:] = -50.0  # not filled: not counted
    idx, cpu = np.arange(800), torch.device("cpu")
    args = nonnegative_reward.Args(learned_reward_std=1.0, actor_hidden_dim=32, critic_hidden_dim=32)
    agent = sac_rlhf.SACAgent(OBS_DIM, gym.spaces.Box(-1.0, 1.0, (ACTION_DIM,), np.float32), args, cpu)
    loop = sac_rlhf.LoopState()
    loop.reward_scale = sac_rlhf.sac_reward_scale(rb, args)  # the relabel's order: the scale, then the critic reset
    sac_rlhf.reset_after_session(agent, loop, 10, args)
    assert loop.reward_shift == pytest.approx(-float(rb.learned_rewards[:800].min())) and "reward_shift" in asdict(loop)
    shifted = sac_rlhf.learned_rewards(rb, idx, args, 0, cpu, loop)
    assert shifted.min().item() == pytest.approx(0.0, abs=1e-6) and shifted.std(unbiased=False).item() == pytest.approx(1.0, rel=1e-5)
    original = torch.as_tensor(rb.learned_rewards[:800])
    assert torch.allclose(shifted - shifted[0], (original - original[0]) * loop.reward_scale, atol=1e-5)
    assert torch.allclose(plain_rewards(rb, idx, args, 0, cpu, loop), original * loop.reward_scale)  # sac_rlhf: no shift
    assert "learned_reward_nonnegative" not in sac_rlhf.Args.__dataclass_fields__


def test_the_known_control_cost_experiment_takes_the_squared_action_off_the_scaled_learned_reward(monkeypatch):
    """bench/known_control_cost.py: SAC's batch reward is the learned reward at --learned-reward-std's scale less the
    weight x the action's squared components, summed: a still action costs nothing, a full one its weight per
    component; sac_rlhf.py itself is left as it was, and a negative weight is refused in one line."""
    from cleanrlhf_utils.buffers import ReplayBuffer

    known_control_cost = bench_module("known_control_cost")
    monkeypatch.setattr(sac_rlhf, "learned_rewards", sac_rlhf.learned_rewards)  # restored after the test
    plain_rewards = sac_rlhf.learned_rewards
    known_control_cost.add_known_control_cost()

    action_dim = 2
    rb = ReplayBuffer(100, OBS_DIM, action_dim, 1)
    rb.pos = 4
    rb.learned_rewards[:4] = [1.0, -1.0, 2.0, 0.5]
    rb.actions[:4] = [[0.0, 0.0], [1.0, -1.0], [0.5, 0.0], [-0.2, 0.4]]
    idx, cpu = np.arange(4), torch.device("cpu")
    args = known_control_cost.Args(learned_reward_std=1.0, known_control_cost_weight=0.5)
    loop = sac_rlhf.LoopState()
    loop.reward_scale = 2.0
    rewards = sac_rlhf.learned_rewards(rb, idx, args, 0, cpu, loop)
    assert rewards.tolist() == pytest.approx([2.0, -2.0 - 1.0, 4.0 - 0.125, 1.0 - 0.1])
    assert torch.equal(plain_rewards(rb, idx, args, 0, cpu, loop), torch.tensor([2.0, -2.0, 4.0, 1.0]))
    assert "known_control_cost_weight" not in sac_rlhf.Args.__dataclass_fields__
    with pytest.raises(sac_rlhf.ConfigError, match="--known-control-cost-weight must be >= 0, got -1.0"):
        known_control_cost.main(known_control_cost.Args(known_control_cost_weight=-1.0))


def test_the_reward_input_noise_experiment_moves_the_training_inputs_by_their_own_spread(monkeypatch):
    """bench/reward_input_noise.py: in training mode the ensemble reads each input moved by --reward-input-noise times
    that input's std over the buffer (so by that many standard deviations once standardised, whatever the column's
    units); in eval mode (relabels, queries, accuracies) it reads the inputs as they are; sac_rlhf.py keeps its own
    model, and a negative noise is refused in one line."""
    reward_input_noise = bench_module("reward_input_noise")
    monkeypatch.setattr(sac_rlhf.RewardEnsemble, "_forward", sac_rlhf.RewardEnsemble._forward)  # restored after
    plain_forward = sac_rlhf.RewardEnsemble._forward
    seen = []

    class Reads(torch.nn.Module):  # stands in for the members' network: records what it is given
        def forward(self, x):
            seen.append(x.clone())
            return torch.zeros(*x.shape[:-1], 1)

    torch.manual_seed(0)
    rows = np.random.default_rng(0).normal([0.0, 5.0, -3.0], [1.0, 10.0, 0.1], size=(4000, 3)).astype(np.float32)
    model = sac_rlhf.RewardEnsemble(3, ensemble_size=2)
    model.set_input_statistics(rows)
    model.net = Reads()
    sac_rlhf.RewardEnsemble._forward = reward_input_noise.noisy_while_training(plain_forward, 0.5)
    x = torch.as_tensor(rows)
    clean = (x - model.input_mean) / model.input_std
    model.eval()
    model(x)
    assert torch.equal(seen[-1][0], clean)
    model.train()
    model(x)
    moved = seen[-1] - clean  # (members, rows, columns), standardised units
    assert moved.std(dim=(0, 1)).tolist() == pytest.approx([0.5, 0.5, 0.5], rel=0.05)
    assert not torch.equal(seen[-1][0], seen[-1][1])  # each member's rows drawn afresh
    with pytest.raises(sac_rlhf.ConfigError, match="--reward-input-noise must be >= 0, got -1.0"):
        reward_input_noise.main(reward_input_noise.Args(reward_input_noise=-1.0))
    assert sac_rlhf.RewardEnsemble._forward is not plain_forward and "reward_input_noise" not in sac_rlhf.Args.__dataclass_fields__


def exploration_split(monkeypatch):
    """bench/exploration_for_queries.py, with the sac_rlhf names it replaces restored after the test."""
    for name in ("LoopState", "sac_reward_scale", "reset_after_session", "sample_batch"):
        monkeypatch.setattr(sac_rlhf, name, getattr(sac_rlhf, name))
    return bench_module("exploration_for_queries")


def test_the_exploration_for_queries_experiment_keeps_sacs_batches_after_the_exploring_steps(monkeypatch):
    """bench/exploration_for_queries.py: the relabel that ends exploration marks the buffer's size, later relabels
    leave the mark, and from --learning-starts steps past it SAC's batches (QPA's recent share too) come only from
    the slots after it, spread over all of them; until then they are PEBBLE's own. sac_rlhf.py is left as it was."""
    import gymnasium as gym

    from cleanrlhf_utils.buffers import ReplayBuffer

    plain_sample_batch = sac_rlhf.sample_batch
    exploration_for_queries = exploration_split(monkeypatch)
    exploration_for_queries.keep_exploration_out_of_sac()

    rb = ReplayBuffer(3000, OBS_DIM, ACTION_DIM, 1)
    rb.episode_ids[:] = np.arange(3000) // 100  # 100-step episodes
    rb.pos, cpu = 1200, torch.device("cpu")
    args = exploration_for_queries.Args(learning_starts=100, batch_size=256, actor_hidden_dim=32, critic_hidden_dim=32)
    agent = sac_rlhf.SACAgent(OBS_DIM, gym.spaces.Box(-1.0, 1.0, (ACTION_DIM,), np.float32), args, cpu)
    loop = sac_rlhf.LoopState()
    loop.reward_scale = sac_rlhf.sac_reward_scale(rb, args)  # the relabel's order: the scale, then the critic reset
    sac_rlhf.reset_after_session(agent, loop, 10, args)
    assert loop.learning_from_preferences and loop.first_learning_slot == 1200 and "first_learning_slot" in asdict(loop)

    def both_batches(hybrid: bool) -> tuple[np.ndarray, np.ndarray]:
        split, _, _ = sac_rlhf.sample_batch(rb, np.random.default_rng(1), args, loop, hybrid, None, cpu)
        plain, _, _ = plain_sample_batch(rb, np.random.default_rng(1), args, loop, hybrid, None, cpu)
        return split, plain

    rb.pos = 1299  # 99 steps past exploration: fewer than --learning-starts, PEBBLE's batches
    split, plain = both_batches(hybrid=False)
    assert np.array_equal(split, plain) and plain.min() < 1200
    rb.pos = 3000
    split, plain = both_batches(hybrid=False)
    assert split.min() >= 1200 and split.min() < 1300 and split.max() > 2900 and plain.min() < 1200
    args.qpa_query_episodes, args.qpa_hybrid_ratio = 25, 0.5  # the last 25 episodes reach back into exploration
    split, plain = both_batches(hybrid=True)
    assert split.min() >= 1200 and (split[:128] >= 500).all() and plain.min() < 1200

    loop.reward_scale = sac_rlhf.sac_reward_scale(rb, args)  # a later session: the mark stays
    sac_rlhf.reset_after_session(agent, loop, 20, args)
    assert loop.first_learning_slot == 1200
    monkeypatch.undo()
    assert "first_learning_slot" not in asdict(sac_rlhf.LoopState())


def test_the_exploration_for_queries_experiment_marks_where_a_real_runs_exploration_ended(tmp_path, monkeypatch):
    """A short real run of bench/exploration_for_queries.py: the mark it keeps is the buffer's size at the end of
    exploration (the exploration checkpoint's), and it reaches its end with the queries all asked."""
    monkeypatch.chdir(tmp_path)
    exploration_for_queries = exploration_split(monkeypatch)
    args = exploration_for_queries.Args(**asdict(small_args("split")) | {"exp_name": "exploration_for_queries"})
    summary = exploration_for_queries.main(args)
    loop = final_state("split")["checkpoint"]["loop"]
    with np.load("models/split/400/replay_buffer.npz") as explored:
        assert 0 < loop["first_learning_slot"] == len(explored["obs"]) < 400  # Hopper's falls: reset steps not kept
    assert loop["labels_obtained"] == 30 and summary["global_step"] == 1200


@pytest.mark.parametrize("reset_actor", [False, True])
def test_the_first_labels_reset_the_critic_and_only_when_asked_the_actor_and_temperature(reset_actor):
    import gymnasium as gym

    torch.manual_seed(0)
    args = sac_rlhf.Args(actor_hidden_dim=32, critic_hidden_dim=32, alpha=0.2, reset_actor_after_exploration=reset_actor)
    agent = sac_rlhf.SACAgent(OBS_DIM, gym.spaces.Box(-1.0, 1.0, (ACTION_DIM,), np.float32), args, torch.device("cpu"))
    batch = [torch.randn(64, OBS_DIM), torch.rand(64, ACTION_DIM) * 2 - 1, torch.randn(64), torch.randn(64, OBS_DIM), torch.zeros(64)]
    for step in range(50):
        agent.update(*batch, global_step=step)
    trained_actor = {k: v.clone() for k, v in agent.actor.state_dict().items()}
    trained_qf, trained_alpha = {k: v.clone() for k, v in agent.qf.state_dict().items()}, agent.log_alpha.item()
    loop = sac_rlhf.LoopState()

    sac_rlhf.reset_after_session(agent, loop, 0, args)  # no labels yet: nothing changes
    assert not loop.learning_from_preferences
    assert all(torch.equal(value, trained_qf[name]) for name, value in agent.qf.state_dict().items())
    sac_rlhf.reset_after_session(agent, loop, 10, args)
    assert loop.learning_from_preferences
    assert all(not torch.equal(value, trained_qf[name]) for name, value in agent.qf.state_dict().items())
    actor_kept = all(torch.equal(value, trained_actor[name]) for name, value in agent.actor.state_dict().items())
    assert actor_kept != reset_actor
    assert agent.log_alpha.item() == (pytest.approx(np.log(0.2), abs=1e-7) if reset_actor else trained_alpha)


def test_the_oracle_loop_gives_sac_the_envs_reward_times_its_scale_where_pebble_gives_the_models(chdir_tmp):
    """bench/oracle_loop.py: PEBBLE's loop as it is (sessions, labels, fits), the learned rewards replaced by the env's
    reward times --reward-scale in every relabel and pending row."""
    command = [sys.executable, str(REPO / "bench" / "oracle_loop.py"), "--env-id", "Hopper-v5", "--run-name", "oracle"]
    command += ["--total-timesteps", "800", "--total-explore-steps", "300", "--learning-starts", "200"]
    command += ["--teacher-feedback-total-queries", "20", "--teacher-feedback-num-queries-per-session", "10"]
    command += ["--teacher-feedback-frequency", "300", "--evaluation-frequency", "0", "--reward-scale", "0.5"]
    command += ["--actor-hidden-dim", "32", "--critic-hidden-dim", "32", "--reward-net-hidden-dim", "32", "--no-progress-bar"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ, "MUJOCO_GL": "egl"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "2 sessions, 20 labels" in result.stdout  # the teacher's sessions happened as in PEBBLE
    with np.load("models/oracle/latest/replay_buffer.npz") as replay:
        learned, true = replay["learned_rewards"][:800], replay["true_rewards"][:800]
    after_exploration = slice(300, 800)
    np.testing.assert_allclose(learned[after_exploration], 0.5 * true[after_exploration], rtol=1e-6)
    assert true[after_exploration].std() > 0  # a real reward, not zeros equal to zeros
