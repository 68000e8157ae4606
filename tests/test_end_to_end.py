"""End-to-end runs of sac_rlhf.main on Hopper-v5: outputs, checkpoints, exact resume."""

import json
import os
import signal
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import sac_rlhf

FRAMEWORK = Path(__file__).resolve().parents[1] / "framework"


def small_args(run_name: str, **overrides) -> sac_rlhf.Args:
    args = sac_rlhf.Args(
        env_id="Hopper-v5",
        run_name=run_name,
        total_timesteps=1200,
        learning_starts=200,
        total_explore_steps=400,
        teacher_feedback_total_queries=30,
        teacher_feedback_num_queries_per_session=10,
        teacher_feedback_frequency=300,
        segment_length=20,
        max_augmentation_offset=5,
        min_augmentation_offset=2,
        batch_size=64,
        actor_hidden_dim=64,
        critic_hidden_dim=64,
        reward_net_hidden_dim=64,
        reward_net_epochs=5,
        explore_knn_sample_size=500,
        evaluation_frequency=0,
        evaluation_episodes=1,
        checkpoint_frequency=0,
        progress_bar=False,
    )
    return replace(args, **overrides)


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir))
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def test_pebble_run_writes_scalars_checkpoint_and_feedback(chdir_tmp):
    args = small_args(
        "e2e",
        total_timesteps=1500,
        evaluation_frequency=1000,
        rune=True,
        track=True,
        capture_video=True,
        checkpoint_frequency=1000,
    )
    summary = sac_rlhf.main(args)

    tags = scalars(Path("runs/e2e"))
    for tag in [
        "charts/episodic_return",
        "charts/SPS",
        "losses/qf_loss",
        "losses/actor_loss",
        "losses/alpha",
        "exploration/intrinsic_reward",
        "feedback/labels_obtained",
        "reward_model/train_accuracy",
        "reward_model/heldout_accuracy",
        "reward_model/reward_correlation",
        "reward_model/pseudo_labels",
        "rune/beta",
        "eval/mean_return",
    ]:
        assert tag in tags, f"missing TensorBoard scalar {tag}"
    # Three sessions (at 400, 700, 1000 steps) with 30 queries in all; the oracle skips none.
    assert [v for _, v in tags["feedback/sessions"]] == [1, 2, 3]
    assert tags["feedback/labels_obtained"][-1][1] == 30 == summary["labels_obtained"]
    assert [s for s, _ in tags["eval/mean_return"]] == [1000, 1500]
    # RUNE's weight decays.
    betas = [v for _, v in tags["rune/beta"]]
    assert betas == sorted(betas, reverse=True) and betas[0] > betas[-1]

    assert Path("models/e2e/400/checkpoint.pt").is_file(), "exploration checkpoint"
    checkpoint = torch.load("models/e2e/latest/checkpoint.pt", weights_only=False)
    assert checkpoint["loop"]["global_step"] == 1500
    assert len(checkpoint["preference_buffer"]["labels"]) == 30
    assert not checkpoint["preference_buffer"]["heldout"].any(), "a synthetic teacher's labels all train the model"
    with np.load("models/e2e/latest/replay_buffer.npz") as buffer:
        assert len(buffer["obs"]) == 1500 - np.unique(buffer["episode_ids"]).size + 1  # one reset step per finished episode
    assert sorted(p.name for p in Path("videos/e2e").glob("*.mp4")) == ["eval_step_1000.mp4", "eval_step_1500.mp4"]
    assert json.loads(Path("runs/e2e/summary.json").read_text())["labels_obtained"] == 30
    assert any(Path("runs/e2e/wandb").glob("offline-run-*")), "W&B offline run"

    # evaluation.py on the saved policy: deterministic, one video per episode, mean of the returns.
    import evaluation

    result = evaluation.main(
        evaluation.Args(path_to_model="models/e2e/latest", episodes=2, capture_video=True, video_dir="videos/evaluated")
    )
    again = evaluation.main(evaluation.Args(path_to_model="models/e2e/latest/checkpoint.pt", episodes=2))
    assert result["returns"] == again["returns"] and len(result["returns"]) == 2
    assert result["mean_return"] == pytest.approx(np.mean(result["returns"]))
    assert sorted(p.name for p in Path("videos/evaluated").glob("*.mp4")) == ["episode_0.mp4", "episode_1.mp4"]
    with pytest.raises(sac_rlhf.ConfigError, match="--path-to-model models/nope/latest: no checkpoint there"):
        evaluation.main(evaluation.Args(path_to_model="models/nope/latest"))


def test_sac_baseline_learns_from_the_true_reward(chdir_tmp):
    """sac.py stores the environment's reward and trains on it; its checkpoint works with evaluation.py."""
    import evaluation
    import sac

    summary = sac.main(
        sac.Args(
            run_name="base",
            total_timesteps=600,
            learning_starts=200,
            batch_size=64,
            actor_hidden_dim=64,
            critic_hidden_dim=64,
            evaluation_frequency=0,
            evaluation_episodes=1,
            progress_bar=False,
        )
    )
    tags = scalars(Path("runs/base"))
    assert {"charts/episodic_return", "losses/qf_loss", "eval/mean_return"} <= set(tags)
    with np.load("models/base/latest/replay_buffer.npz") as buffer:
        assert np.abs(buffer["true_rewards"]).sum() > 0 and not buffer["learned_rewards"].any()
    result = evaluation.main(evaluation.Args(path_to_model="models/base/latest", episodes=1, seed=100_000 + 1))
    assert result["mean_return"] == pytest.approx(summary["final_eval_return"])


def final_state(run_name: str) -> dict:
    checkpoint = torch.load(f"models/{run_name}/latest/checkpoint.pt", weights_only=False)
    with np.load(f"models/{run_name}/latest/replay_buffer.npz") as buffer:
        replay = {k: buffer[k].copy() for k in buffer.files}
    return {"checkpoint": checkpoint, "replay": replay}


def assert_same_training(a: dict, b: dict) -> None:
    for part in ("actor", "qf", "qf_target"):
        for name, value in a["checkpoint"]["agent"][part].items():
            assert torch.equal(value, b["checkpoint"]["agent"][part][name]), f"{part}.{name} differs"
    for name, value in a["checkpoint"]["reward_model"].items():
        assert torch.equal(value, b["checkpoint"]["reward_model"][name]), f"reward_model.{name} differs"
    np.testing.assert_array_equal(a["checkpoint"]["preference_buffer"]["labels"], b["checkpoint"]["preference_buffer"]["labels"])
    np.testing.assert_array_equal(a["checkpoint"]["preference_buffer"]["obs_actions"], b["checkpoint"]["preference_buffer"]["obs_actions"])
    for name in ("obs", "actions", "learned_rewards", "physics_states"):
        np.testing.assert_array_equal(a["replay"][name], b["replay"][name])
    loop_a, loop_b = a["checkpoint"]["loop"], b["checkpoint"]["loop"]
    for key in ("global_step", "episode_id", "labels_obtained", "sessions_done", "episode_return"):
        assert loop_a[key] == loop_b[key], key


def test_resume_and_exploration_from_continue_exactly(chdir_tmp):
    sac_rlhf.main(small_args("whole"))
    uninterrupted = final_state("whole")

    # Stop at 700 steps (mid-episode, between feedback sessions), resume to 1200.
    sac_rlhf.main(small_args("part", total_timesteps=700))
    assert final_state("part")["checkpoint"]["loop"]["global_step"] == 700
    sac_rlhf.main(small_args("part", resume="models/part/latest"))
    assert_same_training(uninterrupted, final_state("part"))

    # Start from the exploration checkpoint the uninterrupted run saved at 400 steps.
    sac_rlhf.main(small_args("loaded", exploration_from="models/whole/400"))
    assert_same_training(uninterrupted, final_state("loaded"))


def test_qpa_run_trains_on_recent_episodes_with_cropped_copies(chdir_tmp):
    """Every part of QPA on at once in a real run: queries from the last 3 episodes, half of each SAC batch from
    them while sessions remain, 3 cropped copies of each labelled pair (4x the reward-model batches of plain PEBBLE)."""
    one_epoch = {"surf": False, "reward_net_epochs": 1, "reward_net_batch_size": 4}
    qpa = {"qpa_query_episodes": 3, "qpa_hybrid_ratio": 0.5, "qpa_augmentations": 3}
    summary = sac_rlhf.main(small_args("qpa", total_timesteps=800, **one_epoch, **qpa))
    plain = sac_rlhf.main(small_args("plain", total_timesteps=800, **one_epoch))
    assert summary["labels_obtained"] == plain["labels_obtained"], (summary, plain)
    qpa_steps = [v for _, v in scalars(Path("runs/qpa"))["reward_model/steps"]]
    plain_steps = [v for _, v in scalars(Path("runs/plain"))["reward_model/steps"]]
    assert plain_steps == [3, 6] and qpa_steps == [12, 22]  # 12 then 22 labels in batches of 4, each with 3 copies


def sac_baseline_args(run_name: str, **overrides):
    import sac

    args = sac.Args(
        run_name=run_name, total_timesteps=600, learning_starts=100, batch_size=64, actor_hidden_dim=64,
        critic_hidden_dim=64, evaluation_frequency=0, evaluation_episodes=1, checkpoint_frequency=0, progress_bar=False,
    )  # fmt: skip
    return replace(args, **overrides)


def assert_same_sac_training(a: dict, b: dict) -> None:
    for part in ("actor", "qf", "qf_target"):
        for name, value in a["checkpoint"]["agent"][part].items():
            assert torch.equal(value, b["checkpoint"]["agent"][part][name]), f"{part}.{name} differs"
    assert torch.equal(a["checkpoint"]["agent"]["log_alpha"], b["checkpoint"]["agent"]["log_alpha"])
    for name in ("obs", "actions", "true_rewards", "terminated", "episode_ids", "physics_states"):
        np.testing.assert_array_equal(a["replay"][name], b["replay"][name], err_msg=name)
    for key in ("global_step", "episode_id", "episode_return", "episode_length"):
        assert a["checkpoint"]["loop"][key] == b["checkpoint"]["loop"][key], key


def test_sac_baseline_resumes_exactly(chdir_tmp):
    """sac.py stopped at 350 steps (mid-episode) and resumed to 600 is the run that never stopped: networks,
    temperature, buffer and counters. The ceiling of a 300k-step backflip (sac.py --reward-objective) takes longer
    than one sitting, so it must continue where it stopped, its objective's reward included."""
    import sac

    # what the objective needs and defaults to, as a command line with --reward-objective hopper-backflip gets them
    objective = {"reward_objective": "hopper-backflip", "terminate_when_tilted": False, "terminate_when_unhealthy": False}
    sac.main(sac_baseline_args("whole", **objective))
    first = sac.main(sac_baseline_args("part", **objective, total_timesteps=350))
    assert first["global_step"] == 350 and not first["interrupted"]
    summary = sac.main(sac_baseline_args("part", **objective, resume="models/part/latest"))
    assert summary["global_step"] == 600 and summary["wall_seconds"] > first["wall_seconds"]
    assert_same_sac_training(final_state("whole"), final_state("part"))


def test_sac_baseline_saves_at_ctrl_c_and_resumes(chdir_tmp, monkeypatch):
    """Ctrl-C (or SLURM's SIGTERM, which the command line turns into it) in the middle of sac.py's training saves the
    run and raises the checkpoint to resume from; resumed, it runs to its end, and periodic checkpoints are written."""
    import gymnasium as gym

    import sac
    from cleanrlhf_utils.cli import RunInterrupted

    calls, periodic, real_step = [0], [], gym.vector.SyncVectorEnv.step

    def step(self, actions):
        calls[0] += 1
        if calls[0] == 300:  # the periodic checkpoint of step 200 is there before any Ctrl-C
            periodic.append(torch.load("models/cut/latest/checkpoint.pt", weights_only=False)["loop"]["global_step"])
        if calls[0] == 450:
            raise KeyboardInterrupt
        return real_step(self, actions)

    monkeypatch.setattr(gym.vector.SyncVectorEnv, "step", step)
    with pytest.raises(RunInterrupted) as stopped:
        sac.main(sac_baseline_args("cut", checkpoint_frequency=200))
    assert periodic == [200]
    assert stopped.value.checkpoint == Path("models/cut/latest")
    cut = json.loads(Path("runs/cut/summary.json").read_text())
    assert cut["interrupted"] and cut["global_step"] == 449
    assert torch.load("models/cut/latest/checkpoint.pt", weights_only=False)["loop"]["global_step"] == 449
    monkeypatch.setattr(gym.vector.SyncVectorEnv, "step", real_step)
    summary = sac.main(sac_baseline_args("cut", checkpoint_frequency=200, resume="models/cut/latest"))
    assert summary["global_step"] == 600 and not summary["interrupted"]


def test_a_runs_first_steps_do_not_depend_on_how_many_follow(chdir_tmp):
    """bench/feedback_efficiency.py reads a longer run at a shorter invocation's last evaluation (--baseline-from,
    --oracle-from): that is only sound if a run of N steps and the first N steps of a longer one are the same run
    (the buffer's capacity, min(buffer size, total steps), and the final evaluation must change nothing). PEBBLE with
    its feedback sessions (at 400 and 700, both before 900) and the SAC baseline, 900 against 1500 steps."""
    import sac

    for steps in (900, 1500):
        sac_rlhf.main(small_args(f"pebble_{steps}", total_timesteps=steps, evaluation_frequency=300))
        sac.main(
            sac.Args(
                run_name=f"sac_{steps}", total_timesteps=steps, learning_starts=200, batch_size=64, actor_hidden_dim=64,
                critic_hidden_dim=64, evaluation_frequency=300, evaluation_episodes=1, progress_bar=False,
            )
        )  # fmt: skip
    for kind in ("pebble", "sac"):
        short, long = (scalars(Path(f"runs/{kind}_{steps}"))["eval/mean_return"] for steps in (900, 1500))
        assert [step for step, _ in short] == [300, 600, 900] and [step for step, _ in long][:3] == [300, 600, 900]
        assert short == long[:3], kind


# A run that dies without saving (the machine or the session went away), run as its own process: every scalar reaches
# the disk as it is logged, as a long run's older events have when it dies, and the process kills itself in the middle
# of environment step `kill_at`.
KILLED_RUN = """
import os, signal, sys
import gymnasium as gym
from torch.utils.tensorboard import SummaryWriter
import {module}

add_scalar, env_step, calls = SummaryWriter.add_scalar, gym.vector.SyncVectorEnv.step, [0]

def add_and_flush(self, *args, **kwargs):
    add_scalar(self, *args, **kwargs)
    self.flush()

def step_until_killed(self, actions):
    calls[0] += 1
    if calls[0] == {kill_at}:
        os.kill(os.getpid(), signal.SIGKILL)
    return env_step(self, actions)

SummaryWriter.add_scalar, gym.vector.SyncVectorEnv.step = add_and_flush, step_until_killed
{module}.main({module}.{args!r})
"""


@pytest.mark.parametrize(
    "module, settings, kill_at, checkpoint_step",
    [
        ("sac", {"total_timesteps": 600, "evaluation_frequency": 100, "checkpoint_frequency": 200}, 550, 400),
        ("sac_rlhf", {"evaluation_frequency": 200, "checkpoint_frequency": 400}, 1100, 800),
    ],
)
def test_a_killed_run_resumed_from_its_checkpoint_logs_each_step_once(chdir_tmp, module, settings, kill_at, checkpoint_step):
    """A run killed after its last checkpoint had logged further (an evaluation included); resumed from the checkpoint,
    it logs those steps again. Its TensorBoard curves must read as the uninterrupted run's: each evaluation once, with
    the same returns, and no tag with a step the uninterrupted run lacks or one after the checkpoint twice."""
    import subprocess
    import sys

    import sac

    make_args = sac_baseline_args if module == "sac" else small_args
    main = sac.main if module == "sac" else sac_rlhf.main
    main(make_args("whole", **settings))
    code = KILLED_RUN.format(module=module, kill_at=kill_at, args=make_args("part", **settings))
    died = subprocess.run([sys.executable, "-c", code], env=os.environ | {"PYTHONPATH": str(FRAMEWORK)}, capture_output=True)
    assert died.returncode == -9, died.stderr.decode()[-2000:]
    assert torch.load("models/part/latest/checkpoint.pt", weights_only=False)["loop"]["global_step"] == checkpoint_step
    killed = scalars(Path("runs/part"))
    assert max(step for step, _ in killed["eval/mean_return"]) > checkpoint_step  # it had logged past the checkpoint

    main(make_args("part", **settings, resume="models/part/latest"))
    whole, part = scalars(Path("runs/whole")), scalars(Path("runs/part"))
    assert part["eval/mean_return"] == whole["eval/mean_return"]
    assert set(part) == set(whole)
    for tag, events in part.items():
        steps = [step for step, _ in events]
        assert set(steps) == {step for step, _ in whole[tag]}, tag
        after = [step for step in steps if step > checkpoint_step]
        assert len(after) == len(set(after)), tag


@pytest.mark.parametrize(
    "module, stopped_in, signum",
    [
        ("sac", "evaluation", signal.SIGTERM),
        ("sac", "update", signal.SIGINT),
        ("sac_rlhf", "evaluation", signal.SIGINT),
        ("sac_rlhf", "reward update", signal.SIGTERM),
    ],
)
def test_a_run_stopped_by_a_signal_resumes_as_the_run_that_never_stopped(chdir_tmp, module, stopped_in, signum):
    """Ctrl-C or SIGTERM (SLURM's time limit, bench's stop) lands wherever the run is; stopping there would checkpoint
    a step whose work is half done (a run stopped in its 400-step evaluation would resume at 400 without it, one
    stopped in an update past it). The run stops at the next step boundary (the evaluation logged, the update
    finished), or, inside a feedback session's reward update (minutes long), at once with the state from before the
    update, which the resumed run redoes. Resumed, the run's curves and final networks, buffers and counters are the
    uninterrupted run's."""
    import sac
    from cleanrlhf_utils import run as run_module
    from cleanrlhf_utils.cli import RunInterrupted

    make_args = sac_baseline_args if module == "sac" else small_args
    script = sac if module == "sac" else sac_rlhf
    settings = {"evaluation_frequency": 200} | ({"total_timesteps": 800} if module == "sac" else {})
    script.main(make_args("whole", **settings))

    # The signal as the terminal or `kill` sends it, in the middle of the chosen work (a CI job started in the
    # background has SIGINT ignored; a terminal's Ctrl-C reaches a process whose SIGINT is at Python's default).
    previous_sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
    calls, stop_at = [0], {"evaluation": 2, "update": 250, "reward update": 2}[stopped_in]

    def signalled(real):
        def work(*args, **kwargs):
            calls[0] += 1
            if calls[0] == stop_at:
                os.kill(os.getpid(), signum)
            return real(*args, **kwargs)

        return work

    with pytest.MonkeyPatch.context() as patch:  # its own: the test's monkeypatch also holds the working directory
        if stopped_in == "evaluation":
            patch.setattr(run_module, "evaluate_and_log", signalled(run_module.evaluate_and_log))
        elif stopped_in == "update":
            patch.setattr(sac.SACAgent, "update", signalled(sac.SACAgent.update))
        else:
            patch.setattr(sac_rlhf, "train_reward_model", signalled(sac_rlhf.train_reward_model))
        try:
            with pytest.raises(RunInterrupted):
                script.main(make_args("part", **settings))
        finally:
            signal.signal(signal.SIGINT, previous_sigint)

    saved = torch.load("models/part/latest/checkpoint.pt", weights_only=False)["loop"]
    if stopped_in == "evaluation":  # the second evaluation (step 400) finished and was logged, then the run stopped
        assert saved["global_step"] == 400
        assert [step for step, _ in scalars(Path("runs/part"))["eval/mean_return"]] == [200, 400]
    elif stopped_in == "update":  # the 250th update (step 349, learning starts at 100) finished
        assert saved["global_step"] == 350
    else:  # the second session's update was set aside: the run resumes by redoing it
        assert saved["sessions_done"] == 1 and saved["global_step"] == 700

    script.main(make_args("part", **settings, resume="models/part/latest"))
    whole, part = scalars(Path("runs/whole")), scalars(Path("runs/part"))
    assert part["eval/mean_return"] == whole["eval/mean_return"]
    if module == "sac_rlhf":
        assert part["reward_model/train_accuracy"] == whole["reward_model/train_accuracy"]
    (assert_same_sac_training if module == "sac" else assert_same_training)(final_state("whole"), final_state("part"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none; run on a GPU machine)")
def test_on_a_gpu_a_seed_gives_one_run_and_a_resumed_run_is_that_run(chdir_tmp):
    """On a GPU the policy's action noise comes from the GPU's RNG, which checkpoints did not keep: a resumed GPU run
    drew other actions than the run that never stopped (found on an H100). Two runs of one seed are the same run, and
    one stopped at 700 steps and resumed is that run too."""
    sac_rlhf.main(small_args("whole", cuda=True))
    sac_rlhf.main(small_args("again", cuda=True))
    whole = final_state("whole")
    assert whole["checkpoint"]["agent"]["actor"]["fc_mean.weight"].is_cuda  # the run trained on the GPU
    assert_same_training(whole, final_state("again"))
    sac_rlhf.main(small_args("part", cuda=True, total_timesteps=700))
    sac_rlhf.main(small_args("part", cuda=True, resume="models/part/latest"))
    assert_same_training(whole, final_state("part"))
