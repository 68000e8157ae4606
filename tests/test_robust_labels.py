"""The published variants for teachers who get labels wrong, each a file beside PEBBLE: the mistake-aware likelihood
(framework/sac_rlhf_mistake_aware.py) and RIME's sample selection with its warm start (framework/sac_rlhf_rime.py),
checked on a synthetic problem whose true reward is known and whose wrong labels are planted, so that which labels are
wrong is known too; and each run end to end through `main`'s seam for reward training."""

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import pref_ppo
import sac_rlhf
import sac_rlhf_mistake_aware
import sac_rlhf_rime
from cleanrlhf_utils.checkpoints import load_training_state, training_state
from cleanrlhf_utils.errors import ConfigError
from sac_rlhf_mistake_aware import mistake_aware_loss
from sac_rlhf_rime import RimeArgs, RimeTraining

CPU = torch.device("cpu")
FRAMEWORK_DIR = Path(__file__).resolve().parents[1] / "framework"
OBS_DIM, ACTION_DIM, SEG_LEN = 3, 1, 5
INPUT_DIM = OBS_DIM + ACTION_DIM
WEIGHTS = np.array([1.0, -0.5, 0.25, 0.0], dtype=np.float32)


def true_step_reward(x: np.ndarray) -> np.ndarray:
    """A known linear reward of (obs, action), scaled into the ensemble's tanh range for these inputs."""
    return 0.3 * (x @ WEIGHTS)


def planted_problem(algo, seed: int, pairs: int = 300, flipped_share: float = 0.25):
    """Random segment pairs labelled by the true (linear) return, a known share of the labels flipped; the flipped
    ones are chosen among pairs whose true returns differ clearly (a near tie is not a clear mistake)."""
    rng = np.random.default_rng(seed)
    segments = rng.standard_normal((pairs, 2, SEG_LEN, INPUT_DIM)).astype(np.float32)
    returns = true_step_reward(segments).sum(-1)
    labels = (returns[:, 1] > returns[:, 0]).astype(np.float32)
    clear = np.flatnonzero(np.abs(returns[:, 1] - returns[:, 0]) > 0.5)
    planted = np.zeros(pairs, dtype=bool)
    planted[rng.choice(clear, int(flipped_share * pairs), replace=False)] = True
    labels[planted] = 1 - labels[planted]
    prefs = algo.PreferenceBuffer(SEG_LEN, INPUT_DIM, 1)
    n = pairs
    prefs.add(
        segments, np.ones((n, 2, SEG_LEN), bool), true_step_reward(segments), np.zeros((n, 2, SEG_LEN, 1)), labels, np.zeros(n, bool), 0
    )
    return prefs, planted, replay_buffer(algo, rng)


def replay_buffer(algo, rng: np.random.Generator, n: int = 1000, episode_length: int = 100):
    rb = algo.ReplayBuffer(n, OBS_DIM, ACTION_DIM, 1)
    for i, x in enumerate(rng.standard_normal((n, INPUT_DIM)).astype(np.float32)):
        rb.add(x[:OBS_DIM], x[:OBS_DIM], x[OBS_DIM:], true_step_reward(x), 0.0, i // episode_length, np.zeros(1))
    return rb


def small_args(module=sac_rlhf_rime, **overrides):
    """The variant's settings (RIME's Args carry PEBBLE's) cut to the planted problem."""
    args = module.Args(segment_length=SEG_LEN, reward_net_batch_size=50, reward_net_epochs=40, surf=False)
    return replace(args, **overrides)


def fit(algo, args, prefs, rb, training=None, seed: int = 0):
    """The reward model fitted by `training` (default: the script's train_reward_model), as a session of main does."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = algo.RewardEnsemble(INPUT_DIM, ensemble_size=3, hidden_dim=32, hidden_layers=2)
    stats = (training or algo.train_reward_model)(model, torch.optim.Adam(model.parameters(), lr=3e-3), prefs, rb, args, rng, CPU)
    return model, stats


def mean_preference(model, segments, masks):
    return sac_rlhf.preference_probabilities(model, segments, masks).mean(0)


def fresh_accuracy(model, seed: int = 99, pairs: int = 500) -> float:
    segments = np.random.default_rng(seed).standard_normal((pairs, 2, SEG_LEN, INPUT_DIM)).astype(np.float32)
    returns = true_step_reward(segments).sum(-1)
    probabilities = mean_preference(model, torch.as_tensor(segments), torch.ones(pairs, 2, SEG_LEN)).numpy()
    return float(((probabilities > 0.5) == (returns[:, 1] > returns[:, 0])).mean())


# ----------------------------------------------------------------------------------------
# The mistake-aware likelihood
# ----------------------------------------------------------------------------------------
def test_mistake_aware_loss_is_the_plain_loss_at_epsilon_zero_and_matches_hand_computation():
    torch.manual_seed(0)
    returns = torch.randn(3, 40, 2, dtype=torch.float64) * 2  # (members, pairs, 2)
    labels = torch.tensor(np.random.default_rng(0).choice([0.0, 0.5, 1.0], 40)).expand(3, -1)
    plain = sac_rlhf.PREFERENCE_MODEL.loss(returns, labels)
    assert torch.equal(mistake_aware_loss(returns, labels, 0.0), plain)  # exactly the same number
    # The general formula is continuous at 0: a vanishing epsilon gives the plain loss.
    assert float(mistake_aware_loss(returns, labels, 1e-12)) == pytest.approx(float(plain), rel=1e-9)
    # By hand: P(label) = eps + (1 - 2 eps) sigmoid(+-delta).
    pairs = [(1.0, 2.0, 1.0), (0.5, -0.5, 0.0), (0.0, 0.3, 0.5), (40.0, -40.0, 1.0)]
    eps = 0.2
    by_hand = []
    for r0, r1, y in pairs:
        p1 = eps + (1 - 2 * eps) / (1 + math.exp(-(r1 - r0)))
        by_hand.append(-(y * math.log(p1) + (1 - y) * math.log(1 - p1)))
    got = mistake_aware_loss(torch.tensor([[a, b] for a, b, _ in pairs], dtype=torch.float64), torch.tensor([y for *_, y in pairs]), eps)
    assert float(got) == pytest.approx(sum(by_hand) / len(by_hand), rel=1e-10)
    # A pair the model is sure of costs at most -ln(eps) when its label says otherwise (the plain loss: about 80).
    sure_and_wrong = torch.tensor([[40.0, -40.0]], dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64)
    assert float(mistake_aware_loss(*sure_and_wrong, eps)) == pytest.approx(-math.log(eps), rel=1e-6)
    assert float(sac_rlhf.PREFERENCE_MODEL.loss(*sure_and_wrong)) == pytest.approx(80.0, rel=1e-6)


def mistake_aware_training(epsilon: float):
    """What sac_rlhf_mistake_aware.main passes to sac_rlhf.main."""
    import functools

    loss = functools.partial(mistake_aware_loss, epsilon=epsilon)
    return functools.partial(sac_rlhf.train_reward_model, loss_fn=loss)


def test_the_mistake_aware_loss_at_epsilon_zero_trains_exactly_as_pebble():
    prefs, _, rb = planted_problem(sac_rlhf, seed=1)
    plain, plain_stats = fit(sac_rlhf, small_args(reward_net_epochs=5), prefs, rb)
    aware, aware_stats = fit(sac_rlhf, small_args(reward_net_epochs=5), prefs, rb, mistake_aware_training(0.0))
    assert plain_stats == aware_stats
    for a, b in zip(plain.parameters(), aware.parameters()):
        assert torch.equal(a, b)


def test_the_mistake_aware_loss_learns_the_true_reward_better_from_wrong_labels():
    prefs, _, rb = planted_problem(sac_rlhf, seed=2, flipped_share=0.25)
    plain, _ = fit(sac_rlhf, small_args(), prefs, rb)
    aware, _ = fit(sac_rlhf, small_args(), prefs, rb, mistake_aware_training(0.25))
    assert fresh_accuracy(aware) > fresh_accuracy(plain)


# ----------------------------------------------------------------------------------------
# RIME: the selection rule and the warm start
# ----------------------------------------------------------------------------------------
class TrustEverything(RimeTraining):
    def thresholds(self):
        return math.inf, math.inf


@pytest.mark.parametrize("algo", [sac_rlhf, pref_ppo])
def test_rime_that_trusts_every_label_trains_as_the_plain_loss(algo):
    """RIME's training goes through the script's own reward_epoch: with every label trusted it is PEBBLE's (and
    PrefPPO's) training."""
    prefs, _, rb = planted_problem(algo, seed=3, flipped_share=0.0)  # clean labels
    plain, plain_stats = fit(algo, small_args(reward_net_epochs=8), prefs, rb)
    rime, rime_stats = fit(algo, small_args(reward_net_epochs=8), prefs, rb, TrustEverything(RimeArgs()))
    assert rime_stats["labels_trusted"] == 1.0 and rime_stats["labels_flipped"] == rime_stats["labels_dropped"] == 0.0
    assert rime_stats["labels_wrong"] == rime_stats["labels_trusted_wrong"] == 0.0  # clean labels, all trusted
    assert math.isnan(rime_stats["labels_flipped_wrong"]) and math.isnan(rime_stats["labels_dropped_wrong"])  # none there
    assert rime_stats["epochs"] == plain_stats["epochs"] and rime_stats["train_loss"] == pytest.approx(plain_stats["train_loss"], rel=1e-5)
    for a, b in zip(plain.parameters(), rime.parameters()):
        torch.testing.assert_close(a, b)


def test_rime_on_clean_labels_keeps_almost_all_of_them():
    prefs, _, rb = planted_problem(sac_rlhf, seed=4, flipped_share=0.0)
    model, stats = fit(sac_rlhf, small_args(), prefs, rb, RimeTraining(RimeArgs()))
    assert stats["labels_trusted"] >= 0.9 and stats["labels_flipped"] <= 0.02, stats
    plain, _ = fit(sac_rlhf, small_args(), prefs, rb)
    assert fresh_accuracy(model) >= fresh_accuracy(plain) - 0.03


def test_rime_drops_or_flips_the_planted_wrong_labels_more_often_than_the_clean_ones():
    prefs, planted, rb = planted_problem(sac_rlhf, seed=5, flipped_share=0.25)
    training = RimeTraining(RimeArgs(rime_warm_start_steps=50))
    rime, stats = fit(sac_rlhf, small_args(), prefs, rb, training)
    assert stats["warm_start_loss"] >= 0 and training.warm_started and training.epochs == stats["epochs"]
    segments, masks = torch.as_tensor(prefs.obs_actions), torch.as_tensor(prefs.masks, dtype=torch.float32)
    trusted, flipped = training.select(mean_preference(rime, segments, masks), torch.as_tensor(prefs.labels))
    trusted, flipped = trusted.numpy(), flipped.numpy()
    not_trusted = ~trusted
    # Measured: 79 % of the planted labels dropped or flipped, 9 % of the clean ones.
    assert not_trusted[planted].mean() >= 0.6 > 0.2 >= not_trusted[~planted].mean(), (
        not_trusted[planted].mean(),
        not_trusted[~planted].mean(),
    )
    assert flipped[planted].mean() >= flipped[~planted].mean() == 0.0  # a clean label is never flipped here
    # The model learnt the true reward better than the plain loss on the same wrong labels.
    plain, _ = fit(sac_rlhf, small_args(), prefs, rb)
    assert fresh_accuracy(rime) > fresh_accuracy(plain)


def negated_reward_objective(obs, actions, states):
    """A --teacher-objective (loaded as test_robust_labels:negated_reward_objective): the planted problem's reward reversed."""
    return -true_step_reward(np.concatenate([obs, actions], -1))


class FixedSelection(RimeTraining):
    """Trusts and flips the same given labels every epoch."""

    def __init__(self, trusted: np.ndarray, flipped: np.ndarray):
        super().__init__(RimeArgs())
        self.trusted, self.flipped = torch.as_tensor(trusted), torch.as_tensor(flipped)

    def select(self, probabilities, labels):
        self.epochs += 1
        return self.trusted, self.flipped


def test_rime_reports_how_many_labels_the_teacher_got_wrong_in_what_it_trusted_flipped_and_dropped():
    """What a run needs to tell a selection that fixes mistakes from one that flips correct labels: the share of the
    teacher's mistakes among the labels trusted, flipped and dropped, measured against the reward the teacher judges by
    (the env's, or the objective's)."""
    prefs, planted, rb = planted_problem(sac_rlhf, seed=6, flipped_share=0.2)  # 60 of 300 labels wrong
    index = np.arange(len(planted))
    flipped = planted & (index % 3 != 0)  # two thirds of the mistakes flipped back ...
    flipped[np.flatnonzero(~planted)[:10]] = True  # ... and ten correct labels flipped wrong
    trusted = ~flipped & (index % 2 == 0)
    groups = {"trusted": trusted, "flipped": flipped, "dropped": ~(trusted | flipped)}
    args = small_args(reward_net_epochs=2)
    _, stats = fit(sac_rlhf, args, prefs, rb, FixedSelection(trusted, flipped))
    assert stats["labels_wrong"] == pytest.approx(0.2)
    for name, mask in groups.items():
        assert stats[f"labels_{name}"] == pytest.approx(mask.mean())
        assert stats[f"labels_{name}_wrong"] == pytest.approx(planted[mask].mean()), name
    fixed = int((planted & (index % 3 != 0)).sum())
    assert stats["labels_flipped_wrong"] == pytest.approx(fixed / (fixed + 10))
    # Judged by an objective that reverses the env's reward, the planted labels are the right ones.
    reversed_args = replace(args, teacher_objective="test_robust_labels:negated_reward_objective")
    _, judged = fit(sac_rlhf, reversed_args, prefs, rb, FixedSelection(trusted, flipped))
    assert judged["labels_wrong"] == pytest.approx(0.8)
    for name, mask in groups.items():
        assert judged[f"labels_{name}_wrong"] == pytest.approx(1 - planted[mask].mean()), name


def test_selection_thresholds_follow_rimes_bound():
    settings = RimeArgs(rime_alpha=0.5, rime_beta_max=3.0, rime_beta_min=1.0, rime_beta_decay_epochs=10, rime_flip_tau=0.001)
    training = RimeTraining(settings)
    trust, flip = training.thresholds()
    assert trust == pytest.approx(-math.log(1e-8)) and flip == pytest.approx(3 * math.log(10))  # rho = 0: every label trusted
    training.load_state_dict({"loss_max": 0.8, "loss_std": 0.5, "epochs": 5, "warm_started": True})
    assert training.thresholds()[0] == pytest.approx(-math.log(0.8) + 0.5 * 0.8 + 2.0 * 0.5)  # beta halfway: 2
    training.epochs = 50
    assert training.thresholds()[0] == pytest.approx(-math.log(0.8) + 0.4 + 1.0 * 0.5)  # beta at its minimum
    training.loss_std = 10.0
    assert training.thresholds()[0] == pytest.approx(-math.log(0.8) + 0.4 + 3.0)  # the uncertainty term is capped
    # One selection: below the trust threshold trusted, above -ln(tau) flipped, in between dropped (a tie never flips).
    training = RimeTraining(settings)
    training.load_state_dict({"loss_max": 1.0, "loss_std": 0.0, "epochs": 100, "warm_started": True})  # trust below 0.5
    probabilities = torch.tensor([0.9, 0.5, 0.2, 1e-5, 0.5])
    labels = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.5])
    trusted, flipped = training.select(probabilities, labels)
    assert trusted.tolist() == [True, False, False, False, False] and flipped.tolist() == [False, False, False, True, False]
    assert training.loss_max == pytest.approx(1.0 + 0.1 * (-math.log(0.9) - 1.0)) and training.epochs == 101


def test_warm_start_fits_the_state_entropy_of_the_buffer():
    rng = np.random.default_rng(6)
    rb = sac_rlhf.ReplayBuffer(2000, OBS_DIM, ACTION_DIM, 1)
    # Half the states crowd near the origin, half spread out: the spread ones have the larger k-NN distances.
    for i in range(2000):
        obs = rng.standard_normal(OBS_DIM).astype(np.float32) * (0.1 if i % 2 else 3.0)
        rb.add(obs, obs, np.zeros(ACTION_DIM, np.float32), 0.0, 0.0, i // 100, np.zeros(1))
    torch.manual_seed(6)
    model = sac_rlhf.RewardEnsemble(INPUT_DIM, ensemble_size=3, hidden_dim=32, hidden_layers=2)
    args = sac_rlhf.Args(explore_knn_sample_size=500)
    training = RimeTraining(RimeArgs(rime_warm_start_steps=300))
    loss = training.warm_start(model, torch.optim.Adam(model.parameters(), lr=3e-3), rb, args, rng, CPU)
    mean, _ = sac_rlhf.predict_rewards(model, torch.as_tensor(rb.obs_actions(np.arange(2000))))
    assert loss < 0.1
    assert mean[0::2].mean() > mean[1::2].mean() + 0.3  # spread-out states are rewarded as novel
    assert math.isnan(RimeTraining(RimeArgs(rime_warm_start_steps=0)).warm_start(model, None, rb, args, rng, CPU))


def test_rimes_state_is_checkpointed():
    training = RimeTraining(RimeArgs())
    training.load_state_dict({"loss_max": 0.7, "loss_std": 0.2, "epochs": 12, "warm_started": True})
    rng = np.random.default_rng(0)
    state = training_state({"reward_training": training}, rng)
    restored = RimeTraining(RimeArgs())
    load_training_state({"reward_training": restored}, rng, state)
    assert restored.state_dict() == training.state_dict()


# ----------------------------------------------------------------------------------------
# Flags
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("module", "overrides", "message"),
    [
        (sac_rlhf_mistake_aware, {"label_mistake_rate": 0.5}, "--label-mistake-rate must be in [0, 0.5), got 0.5"),
        (sac_rlhf_rime, {"rime_flip_tau": 0.0}, "--rime-flip-tau must be in (0, 0.5), got 0.0"),
        (sac_rlhf_rime, {"rime_beta_decay_epochs": 0}, "--rime-beta-decay-epochs must be >= 1, got 0"),
        (sac_rlhf_rime, {"rime_beta_min": 4.0}, "--rime-beta-min (4.0) must be <= --rime-beta-max (3.0)"),
        (sac_rlhf_rime, {"rime_warm_start_steps": -1}, "--rime-warm-start-steps must be >= 0, got -1"),
    ],
)
def test_bad_variant_settings_are_refused_in_one_line_before_anything_is_written(chdir_tmp, module, overrides, message):
    with pytest.raises(ConfigError) as error:
        module.main(module.Args(**overrides))
    assert str(error.value) == message
    assert list(chdir_tmp.iterdir()) == []


def test_a_variants_flag_is_unknown_to_pebble_itself(tmp_path):
    """PEBBLE has no noisy-label flags: a variant is its own file."""
    process = subprocess.run(
        [sys.executable, str(FRAMEWORK_DIR / "sac_rlhf.py"), "--rime-flip-tau", "0.01"], cwd=tmp_path, capture_output=True, text=True
    )
    assert process.returncode == 2
    assert process.stderr.strip().splitlines() == ["error: unknown flag --rime-flip-tau; see --help"], process.stderr


# ----------------------------------------------------------------------------------------
# The variant files, run: a short run with a teacher that is wrong one time in five
# ----------------------------------------------------------------------------------------
def test_a_rime_run_logs_its_selection_and_checkpoints_its_state(chdir_tmp):
    from test_end_to_end import scalars
    from test_end_to_end import small_args as sac_args

    args = sac_rlhf_rime.Args(**vars(sac_args("rime", teacher_eps_mistake=0.2, checkpoint_frequency=0)), rime_warm_start_steps=50)
    summary = sac_rlhf_rime.main(args)
    assert summary["labels_obtained"] == 30
    tags = scalars(Path("runs/rime"))
    shares = [tags[f"reward_model/labels_{name}"] for name in ("trusted", "dropped", "flipped")]
    assert len(shares[0]) == summary["feedback_sessions"] == 3  # one value per session
    for values in zip(*shares):
        assert sum(value for _, value in values) == pytest.approx(1.0)
    # The teacher's mistakes, in all and within each share, add up: sum of share x its error rate = the error rate.
    within = [tags[f"reward_model/labels_{name}_wrong"] for name in ("trusted", "dropped", "flipped")]
    overall = [value for _, value in tags["reward_model/labels_wrong"]]
    assert len(overall) == 3 and max(overall) > 0  # a teacher wrong one time in five
    for share_values, wrong_values, error_rate in zip(zip(*shares), zip(*within), overall):
        parts = [share * wrong for (_, share), (_, wrong) in zip(share_values, wrong_values) if share > 0]
        assert sum(parts) == pytest.approx(error_rate, abs=1e-6)
    assert len(tags["reward_model/warm_start_loss"]) == 1  # the first session only
    checkpoint = torch.load("models/rime/latest/checkpoint.pt", weights_only=False)
    assert checkpoint["reward_training"]["warm_started"] and checkpoint["reward_training"]["epochs"] >= 3


def test_a_rime_run_interrupted_in_its_second_reward_update_resumes_exactly(chdir_tmp, monkeypatch):
    """RIME's running thresholds are part of the state a checkpoint taken inside a reward update rolls back."""
    from test_end_to_end import assert_same_training, final_state, small_args

    def rime_args(name, **overrides):
        noisy = {"teacher_eps_mistake": 0.2, "total_timesteps": 1000} | overrides
        return sac_rlhf_rime.Args(**vars(small_args(name, **noisy)), rime_warm_start_steps=50)

    sac_rlhf_rime.main(rime_args("whole"))
    uninterrupted = final_state("whole")
    real_call, calls = RimeTraining.__call__, []

    def train(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_call(self, *args, **kwargs)

    monkeypatch.setattr(RimeTraining, "__call__", train)
    with pytest.raises(KeyboardInterrupt):
        sac_rlhf_rime.main(rime_args("cut"))
    monkeypatch.setattr(RimeTraining, "__call__", real_call)
    assert final_state("cut")["checkpoint"]["reward_training"]["warm_started"]  # the first update's state, kept
    sac_rlhf_rime.main(rime_args("cut", resume="models/cut/latest"))
    resumed = final_state("cut")
    assert_same_training(uninterrupted, resumed)
    assert resumed["checkpoint"]["reward_training"] == uninterrupted["checkpoint"]["reward_training"]


def test_prefppo_takes_rimes_training_through_its_seam(chdir_tmp):
    """PrefPPO's main takes the same reward training (its preference block is PEBBLE's copy)."""
    from test_pref_ppo import hopper_args

    training = RimeTraining(RimeArgs())
    summary = pref_ppo.main(hopper_args("rime_ppo", teacher_eps_mistake=0.2, checkpoint_frequency=0), reward_training=training)
    assert summary["labels_obtained"] > 0 and training.epochs > 0
    assert torch.load("models/rime_ppo/latest/checkpoint.pt", weights_only=False)["reward_training"]["epochs"] == training.epochs


def test_the_variant_files_run_from_the_command_line_with_pebbles_flags(tmp_path):
    """Each variant is one command: `python framework/<variant>.py` with PEBBLE's flags and its own."""
    tiny = [
        "--env-id", "Pendulum-v1", "--total-timesteps", "300", "--learning-starts", "50", "--total-explore-steps", "100",
        "--teacher-feedback-frequency", "100", "--teacher-feedback-total-queries", "10", "--teacher-feedback-num-queries-per-session", "5",
        "--segment-length", "10", "--max-augmentation-offset", "3", "--min-augmentation-offset", "1", "--evaluation-episodes", "1",
        "--explore-knn-sample-size", "64", "--reward-net-epochs", "3", "--teacher-eps-mistake", "0.2", "--no-progress-bar",
    ]  # fmt: skip
    own = {"sac_rlhf_rime.py": ["--rime-flip-tau", "0.01"], "sac_rlhf_mistake_aware.py": ["--label-mistake-rate", "0.2"]}
    for script, flags in own.items():
        name = script.removesuffix(".py")
        process = subprocess.run(
            [sys.executable, str(FRAMEWORK_DIR / script), *tiny, *flags, "--run-name", name], cwd=tmp_path, capture_output=True, text=True
        )
        assert process.returncode == 0, process.stderr[-2000:]
        assert (tmp_path / "runs" / name / "summary.json").is_file()
        recorded = __import__("json").loads((tmp_path / "runs" / name / "args.json").read_text())
        assert recorded[flags[0][2:].replace("-", "_")] == float(flags[1])


# ----------------------------------------------------------------------------------------
# bench/reward_learning.py: the teacher's noise as an axis
# ----------------------------------------------------------------------------------------
def reward_learning_bench():
    bench = str(Path(__file__).resolve().parents[1] / "bench")
    sys.path.insert(0, bench)
    try:
        import reward_learning
    finally:
        sys.path.remove(bench)
    return reward_learning


def test_the_reward_learning_bench_labels_with_a_noisy_teacher_and_reports_the_selection():
    bench = reward_learning_bench()
    assert bench.teacher_settings("oracle") == {}
    assert bench.teacher_settings("mistake0.3") == {"teacher_eps_mistake": 0.3}
    assert bench.teacher_settings("beta10") == {"teacher_beta": 10.0}
    with pytest.raises(SystemExit, match="unknown teacher 'noisy'"):
        bench.teacher_settings("noisy")
    rng = np.random.default_rng(0)
    rb = sac_rlhf.ReplayBuffer(2000, OBS_DIM, ACTION_DIM, 1)
    for i, x in enumerate(rng.standard_normal((2000, INPUT_DIM)).astype(np.float32)):
        rb.add(x[:OBS_DIM], x[:OBS_DIM], x[OBS_DIM:], true_step_reward(x), 0.0, i // 100, np.zeros(1))
    evals = {name: bench.EvalSet.from_buffer(rb, 100, 20, seed) for name, seed in (("same", 1), ("latest", 2))}
    opts = type("Opts", (), {"budgets": [40], "session_size": 20})()
    variant = bench.Variant("small", {"segment_length": 20, "reward_net_hidden_dim": 32, "reward_net_epochs": 10, "robust_labels": "rime"})
    rows = bench.run_trial(rb, evals, "uniform", variant, 1, opts, "mistake0.3")
    assert [row["labels"] for row in rows] == [40]
    assert 0.1 <= rows[0]["label_error"] <= 0.5  # about 30 % of the labels are wrong
    assert rows[0]["labels_trusted"] + rows[0]["labels_dropped"] + rows[0]["labels_flipped"] == pytest.approx(1.0)
    assert rows[0]["labels_wrong"] == pytest.approx(rows[0]["label_error"], abs=0.05)  # the same mistakes, all labels there
    # Medians per teacher, with acc's range over seeds and d_acc against default under the same teacher.
    trials = [
        {"env": "E", "stage": 1, "session_size": 20, "strategy": "uniform", "teacher": teacher, "variant": variant, "seed": seed,
         "rows": [{"labels": 40, "acc": acc, "acc_latest": acc}]}
        for teacher, variant, seed, acc in [
            ("oracle", "default", 1, 0.9), ("mistake0.2", "default", 1, 0.7), ("mistake0.2", "default", 2, 0.6),
            ("mistake0.2", "rime", 1, 0.8), ("mistake0.2", "rime", 2, 0.9),
        ]
    ]  # fmt: skip
    table = {(r["teacher"], r["variant"]): r for r in bench.summarise(trials)}
    rime = table[("mistake0.2", "rime")]
    assert (rime["acc"], rime["acc_min"], rime["acc_max"], rime["d_acc"]) == pytest.approx((0.85, 0.8, 0.9, 0.2))
    assert table[("oracle", "default")]["d_acc"] == 0.0


def test_the_replay_fits_a_finished_runs_own_labels_session_by_session_with_the_variants_defence(chdir_tmp):
    """bench/reward_learning.py replay: a run's labels, in the sessions they came, fitted again with the run's settings
    and the variant's defence; labels all inverted teach the reverse preference, as given ones teach the true one."""
    import copy

    from test_end_to_end import small_args

    bench = reward_learning_bench()
    args = sac_rlhf_rime.Args(**vars(small_args("replayed", reward_net_epochs=50)), rime_warm_start_steps=50)
    sac_rlhf_rime.main(args)
    checkpoint, full = bench.load_run(Path("models/replayed/latest"))
    data = bench.EvalSet.from_buffer(full, 300, args.segment_length, 0)
    stored = checkpoint["preference_buffer"]
    sessions = np.unique(stored["global_steps"])
    given = bench.replay_trial(checkpoint, full, data, bench.VARIANTS["default"], 1)
    per_session = [int((stored["global_steps"] == step).sum()) for step in sessions]
    assert len(sessions) == 3 and [row["step"] for row in given] == list(sessions)
    assert [row["labels"] for row in given] == list(np.cumsum(per_session)) and given[-1]["labels"] == 30
    assert all(row["label_error"] == 0.0 for row in given)  # the oracle's labels
    assert "labels_trusted" not in given[-1]  # the run's rime is replaced by the variant's defence: none
    assert "labels_trusted" in bench.replay_trial(checkpoint, full, data, bench.VARIANTS["rime"], 1)[-1]
    inverted = copy.deepcopy(checkpoint)
    inverted["preference_buffer"]["labels"] = 1 - stored["labels"]
    reverse = bench.replay_trial(inverted, full, data, bench.VARIANTS["default"], 1)
    assert reverse[-1]["label_error"] == 1.0
    assert reverse[-1]["acc"] < 0.4 and given[-1]["acc"] > 0.6
    # the table names whose labels they are with the run's defence, its non-default warm start included
    opts = bench.argparse.Namespace(
        runs=[Path("models/replayed/latest")], variants=["default"], seeds=[1], eval_pairs=300,
        eval_segment_length=args.segment_length, threads=1, output="replay.json",
    )  # fmt: skip
    bench.replay_runs(opts)
    table = json.loads(Path("replay.json").read_text())["medians"]
    assert [row["labels_of"] for row in table] == [f"rime (warm start 50 steps), seed {args.seed}"]
    with pytest.raises(SystemExit, match="no checkpoint.pt and replay_buffer.npz there"):
        bench.load_run(Path("models/no_such_run/latest"))
