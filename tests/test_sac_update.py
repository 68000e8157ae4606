"""SAC's update and the options that make it faster keep its results: --torch-threads, the arithmetic savings of the
update, --compile, --cudagraphs, the learned rewards of new transitions predicted in batches. How much faster they make
it is measured in bench/throughput.py, not here."""

import copy
import functools
from types import SimpleNamespace

import gymnasium as gym
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import sac
from cleanrlhf_utils.buffers import PendingRewards, ReplayBuffer
from cleanrlhf_utils.errors import ConfigError
from cleanrlhf_utils.training import seed_everything
from sac_rlhf import RewardEnsemble, SACAgent, predict_reward_arrays, predict_rewards, relabel_replay_buffer, validate_sac_args


@pytest.mark.parametrize(("threads", "expected"), [(1, 1), (2, 2), (0, "unchanged")])
def test_torch_threads_are_set_before_training(threads, expected):
    default = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        seed_everything(SimpleNamespace(seed=1, torch_threads=threads, cuda=False))
        assert torch.get_num_threads() == (3 if expected == "unchanged" else expected)
    finally:
        torch.set_num_threads(default)


# ----------------------------------------------------------------------------------------
# The SAC update: Adam's fused kernel, no critic weight-gradients in the actor step and the actor step's log π
# reused for the entropy coefficient, against the update written plainly.
# ----------------------------------------------------------------------------------------
OBS_DIM, ACTION_DIM, BATCH = 11, 3, 64


def small_agent(**overrides) -> SACAgent:
    args = sac.Args(actor_hidden_dim=32, critic_hidden_dim=32, batch_size=BATCH, **overrides)
    torch.manual_seed(0)
    return SACAgent(OBS_DIM, gym.spaces.Box(-1.0, 1.0, (ACTION_DIM,), np.float32), args, torch.device("cpu"))


def batches(count: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(BATCH, OBS_DIM, generator=g),
            torch.rand(BATCH, ACTION_DIM, generator=g) * 2 - 1,
            torch.randn(BATCH, generator=g),
            torch.randn(BATCH, OBS_DIM, generator=g),
            (torch.rand(BATCH, generator=g) < 0.1).float(),
        )
        for _ in range(count)
    ]


class PlainSAC:
    """SAC's update as the textbook writes it, on copies of an agent's networks: single-tensor Adam, one backward
    pass computing every gradient it can. Only the entropy coefficient's loss is the agent's choice: it uses the
    log-probabilities of the actor step's own actions."""

    def __init__(self, agent: SACAgent):
        self.args, self.target_entropy = agent.args, agent.target_entropy
        self.actor, self.qf, self.qf_target = (copy.deepcopy(m) for m in (agent.actor, agent.qf, agent.qf_target))
        self.log_alpha = agent.log_alpha.detach().clone().requires_grad_(True)
        self.optimizers = {
            "actor": torch.optim.Adam(self.actor.parameters(), lr=self.args.policy_lr, foreach=False),
            "qf": torch.optim.Adam(self.qf.parameters(), lr=self.args.q_lr, foreach=False),
            "alpha": torch.optim.Adam([self.log_alpha], lr=self.args.q_lr, foreach=False),
        }

    def minimise(self, name: str, loss: torch.Tensor) -> None:
        self.optimizers[name].zero_grad()
        loss.backward()
        self.optimizers[name].step()

    def update(self, obs, actions, rewards, next_obs, terminated, global_step: int) -> dict:
        alpha = self.log_alpha.exp().item()
        with torch.no_grad():
            next_actions, next_log_pi, _ = self.actor.get_action(next_obs)
            soft_value = torch.minimum(*self.qf_target(next_obs, next_actions)) - alpha * next_log_pi[:, 0]
            target = rewards + self.args.gamma * (1 - terminated) * soft_value
        q1, q2 = self.qf(obs, actions)
        losses = [F.mse_loss(q1, target), F.mse_loss(q2, target)]
        self.minimise("qf", losses[0] + losses[1])
        stats = {"qf1_values": q1.mean(), "qf2_values": q2.mean(), "qf1_loss": losses[0], "qf2_loss": losses[1]}
        if global_step % self.args.policy_frequency == 0:
            for _ in range(self.args.policy_frequency):
                alpha = self.log_alpha.exp().item()
                pi, log_pi, _ = self.actor.get_action(obs)
                stats["actor_loss"] = (alpha * log_pi[:, 0] - torch.minimum(*self.qf(obs, pi))).mean()
                self.minimise("actor", stats["actor_loss"])
                stats["alpha_loss"] = -(self.log_alpha.exp() * (log_pi[:, 0].detach() + self.target_entropy)).mean()
                self.minimise("alpha", stats["alpha_loss"])
        with torch.no_grad():
            for target_param, param in zip(self.qf_target.parameters(), self.qf.parameters()):
                target_param.mul_(1 - self.args.tau).add_(self.args.tau * param)
        return {name: value.detach() for name, value in stats.items()}


def assert_same_networks(agent: SACAgent, other, **tolerance) -> None:
    for part in ("actor", "qf", "qf_target"):
        for (name, value), expected in zip(getattr(agent, part).state_dict().items(), getattr(other, part).state_dict().values()):
            torch.testing.assert_close(value, expected, msg=f"{part}.{name}", **tolerance)
    torch.testing.assert_close(agent.log_alpha.detach(), other.log_alpha.detach(), **tolerance)


def assert_same_updates(agent: SACAgent, other, steps: int, **tolerance) -> dict:
    """Updates both on the same batches with the same exploration noise: the losses and networks agree at every step
    (even steps update the actor too). Returns the agent's last losses."""
    for step, batch in enumerate(batches(steps)):
        torch.manual_seed(100 + step)
        expected = other.update(*batch, step)
        torch.manual_seed(100 + step)
        stats = agent.update(*batch, step)
        for name, value in expected.items():
            torch.testing.assert_close(stats[name], value, msg=f"step {step}: {name}", **tolerance)
        assert_same_networks(agent, other, **tolerance)
    return stats


def test_update_keeps_the_plain_updates_losses_and_parameters():
    agent = small_agent()
    stats = assert_same_updates(agent, PlainSAC(agent), steps=6, rtol=1e-5, atol=1e-6)
    assert torch.isclose(stats["qf_loss"], (stats["qf1_loss"] + stats["qf2_loss"]) / 2)


def test_actor_step_leaves_the_critics_gradients_alone():
    agent = small_agent()
    agent.update(*batches(1)[0], global_step=0)
    assert all(p.grad is not None for p in agent.qf.parameters()), "the critic step's gradients"
    critic_grads = [p.grad.clone() for p in agent.qf.parameters()]
    agent.actor_step(batches(1)[0][0])
    assert all(torch.equal(p.grad, g) for p, g in zip(agent.qf.parameters(), critic_grads)), "the actor step wrote critic gradients"
    assert all(p.requires_grad for p in agent.qf.parameters()), "the critics stay trainable"


def test_checkpoint_of_another_optimizer_kernel_loads_into_this_runs_kernel():
    """Older checkpoints (plain Adam) and --compile ones (foreach) load into a run on the fused kernel, exactly."""
    agent, other = small_agent(), small_agent(compile=True)  # built, not run: the optimizers use the foreach kernel
    batch = batches(1)[0]
    agent.update(*batch, global_step=0)
    state = copy.deepcopy(agent.state_dict())  # as from disk: sharing no tensor with the agent
    other.load_state_dict(state)
    assert [g["foreach"] for g in other.q_optimizer.param_groups] == [True]
    assert not other.q_optimizer.param_groups[0]["fused"]
    for group in state["q_optimizer"]["param_groups"]:  # as a checkpoint from before the fused kernel
        group["fused"] = None
    restored = small_agent()
    restored.load_state_dict(state)
    assert restored.q_optimizer.param_groups[0]["fused"] is True
    torch.manual_seed(5)
    expected = agent.update(*batch, global_step=1)
    torch.manual_seed(5)
    stats = restored.update(*batch, global_step=1)
    # Tensors compared as tensors: pytest 9's approx refuses a dict of tensors ("does not support nested dictionaries").
    assert stats.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(stats[name], value, rtol=0, atol=0, msg=name)
    assert_same_networks(restored, agent, rtol=0, atol=0)


def test_compiled_update_and_acting_equal_eager():
    eager, compiled = small_agent(), small_agent(compile=True)
    assert_same_updates(compiled, eager, steps=4, rtol=1e-4, atol=1e-5)
    obs = np.random.default_rng(0).normal(size=(1, OBS_DIM)).astype(np.float32)
    torch.manual_seed(7)
    expected_action = eager.act(obs)
    torch.manual_seed(7)
    np.testing.assert_allclose(compiled.act(obs), expected_action, rtol=1e-4, atol=1e-5)


def replaying_into_static_memory(function, mode=None):
    """What --cudagraphs' torch.compile does to a function's outputs: every replay writes them into the same memory
    (the graph's), so a tensor kept from one call holds the next call's values."""
    memory = {}

    def replay(*args):
        for name, value in function(*args).items():
            memory.setdefault(name, torch.empty_like(value)).copy_(value.detach())
        return dict(memory)

    return replay


@pytest.mark.parametrize("agent_class", [SACAgent, sac.SACAgent], ids=["sac_rlhf", "sac"])
def test_cudagraphs_update_returns_stats_that_later_replays_leave_alone(monkeypatch, agent_class):
    """Found on an H100: with --cudagraphs the logged losses were the graphs' outputs, which the actor step's replay
    overwrote before logging (torch raised "accessing tensor output of CUDAGraphs that has been overwritten")."""
    monkeypatch.setattr(torch, "compile", replaying_into_static_memory)
    args = sac.Args(actor_hidden_dim=32, critic_hidden_dim=32, batch_size=BATCH, cudagraphs=True)
    torch.manual_seed(0)
    agent = agent_class(OBS_DIM, gym.spaces.Box(-1.0, 1.0, (ACTION_DIM,), np.float32), args, torch.device("cpu"))
    for optimizer in (agent.actor_optimizer, agent.q_optimizer, agent.alpha_optimizer):
        for group in optimizer.param_groups:
            group["capturable"] = False  # Adam's graph-capturable kernel runs on a GPU only
    first_batch, second_batch = batches(2)
    first = agent.update(*first_batch, global_step=0)
    kept = {name: value.item() for name, value in first.items()}
    second = agent.update(*second_batch, global_step=2)
    assert {name: value.item() for name, value in first.items()} == kept
    assert second["qf_loss"].item() != kept["qf_loss"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none; bench/throughput.py --cudagraphs runs it)")
def test_cudagraphs_update_on_a_gpu_keeps_each_updates_stats():
    args = sac.Args(actor_hidden_dim=32, critic_hidden_dim=32, batch_size=BATCH, cudagraphs=True)
    torch.manual_seed(0)
    agent = SACAgent(OBS_DIM, gym.spaces.Box(-1.0, 1.0, (ACTION_DIM,), np.float32), args, torch.device("cuda"))
    history = []
    for step, batch in enumerate(batches(6)):
        history.append(agent.update(*(tensor.cuda() for tensor in batch), global_step=step))
    losses = [stats["qf_loss"].item() for stats in history]
    assert len(set(losses)) == len(losses), losses


def test_cudagraphs_without_a_gpu_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="^--cudagraphs needs a CUDA GPU") as error:
        validate_sac_args(sac.Args(cudagraphs=True))
    assert "\n" not in str(error.value)


def test_learned_rewards_filled_lazily_equal_one_prediction_per_step():
    """What a batch reads equals a prediction made at each step (up to rounding), and the filled values do not
    depend on when rows were filled (checkpoints fill everything), bit for bit."""
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    model = RewardEnsemble(OBS_DIM + ACTION_DIM, ensemble_size=3, hidden_dim=32, hidden_layers=2)
    per_step, lazy, checkpointed = (ReplayBuffer(50, OBS_DIM, ACTION_DIM, state_dim=1) for _ in range(3))  # 50: wraps
    lazy_pending, checkpointed_pending = PendingRewards(), PendingRewards()
    predict = functools.partial(predict_reward_arrays, model, "cpu")
    for step in range(130):
        obs, next_obs, action = rng.normal(size=OBS_DIM), rng.normal(size=OBS_DIM), rng.uniform(-1, 1, ACTION_DIM)
        for rb in (per_step, lazy, checkpointed):
            rb.add(obs, next_obs, action, 0.0, 0.0, 0, np.zeros(1))
        row = np.array([(per_step.pos - 1) % per_step.capacity])
        mean, std = predict_rewards(model, torch.as_tensor(per_step.obs_actions(row)))
        per_step.learned_rewards[row], per_step.reward_std[row] = mean.numpy(), std.numpy()
        lazy_pending.add(lazy)
        checkpointed_pending.add(checkpointed)

        idx = rng.integers(0, lazy.size, size=8)
        lazy_pending.fill_if_sampled(predict, lazy, idx)
        np.testing.assert_allclose(lazy.learned_rewards[idx], per_step.learned_rewards[idx], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lazy.reward_std[idx], per_step.reward_std[idx], rtol=1e-5, atol=1e-6)
        if step % 7 == 0:
            checkpointed_pending.fill(predict, checkpointed)
        if step == 60:  # a feedback session relabels everything
            for rb, pending in ((per_step, None), (lazy, lazy_pending), (checkpointed, checkpointed_pending)):
                relabel_replay_buffer(model, rb, "cpu")
                if pending is not None:
                    pending.clear()
    lazy_pending.fill(predict, lazy)
    checkpointed_pending.fill(predict, checkpointed)
    for name in ("learned_rewards", "reward_std"):
        np.testing.assert_array_equal(getattr(lazy, name), getattr(checkpointed, name))
        np.testing.assert_allclose(getattr(lazy, name), getattr(per_step, name), rtol=1e-5, atol=1e-6)
    assert lazy.learned_rewards.std() > 0


def test_pending_rewards_do_not_depend_on_the_buffer_capacity():
    """A run stopped early has a smaller buffer (capacity = its total steps) than the run it resumes into: rows by its
    end must get the same bits, so every block the ensemble sees has the same number of rows (it wrapped short)."""
    torch.manual_seed(0)
    model = RewardEnsemble(OBS_DIM + ACTION_DIM, ensemble_size=3, hidden_dim=32, hidden_layers=2)
    predict = functools.partial(predict_reward_arrays, model, "cpu")
    filled = []
    for capacity in (34, 100):  # 34: the last block (32..47) runs past the end, 2 rows short of a wrap
        rb, pending = ReplayBuffer(capacity, OBS_DIM, ACTION_DIM, state_dim=1), PendingRewards()
        data = np.random.default_rng(1).normal(size=(34, 2 * OBS_DIM + ACTION_DIM))
        for row in data:
            rb.add(row[:OBS_DIM], row[OBS_DIM : 2 * OBS_DIM], row[2 * OBS_DIM :], 0.0, 0.0, 0, np.zeros(1))
            pending.add(rb)
        pending.fill(predict, rb)
        filled.append(rb.learned_rewards[:34].copy())
    np.testing.assert_array_equal(filled[0], filled[1])
    assert filled[0].std() > 0
