"""bench/reward_on_policies.py: what a preference run's final reward model pays on the episodes of given policies, and
whether it orders them as the true return does."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_bench import bench_module
from test_end_to_end import small_args

import sac_rlhf

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def reward_on_policies():
    return bench_module("reward_on_policies")


def test_the_ranking_share_counts_pairs_ordered_as_the_true_return_and_leaves_ties_out(reward_on_policies):
    rows = [
        {"true_return": 100.0, "learned_return": 1.0},
        {"true_return": 50.0, "learned_return": 2.0},  # the model prefers it to the first: wrong
        {"true_return": 10.0, "learned_return": 0.5},  # below both on both: right twice
        {"true_return": 10.0, "learned_return": 0.1},  # tied with the third on the true return: that pair left out
    ]
    assert reward_on_policies.ranked_as_true(rows) == pytest.approx(4 / 5)
    assert reward_on_policies.ranked_as_true(rows[2:]) is None


def test_a_policys_row_says_which_term_the_model_follows_and_how_far_its_members_disagree(reward_on_policies):
    rng = np.random.default_rng(0)
    episodes = []
    for _ in range(2):
        forward, ctrl = rng.normal(1, 0.5, 100), -rng.uniform(0, 1, 100)
        terms = {"forward": list(forward), "ctrl": list(ctrl), "survive": [1.0] * 100, "contact": [np.nan] * 100}
        episodes.append({"true": forward + ctrl + 1.0, "terms": terms})
    learned = [2 * np.asarray(e["terms"]["forward"]) for e in episodes]  # a model that pays the forward term alone, doubled
    spread = [np.full(100, 0.3), np.full(100, 0.1)]
    row = reward_on_policies.policy_row("p", episodes, learned, spread, scale=0.4)
    assert row["learned_vs_forward"] == pytest.approx(1.0) and abs(row["learned_vs_ctrl"]) < 0.3
    assert row["learned_vs_survive"] is None  # a constant term correlates with nothing
    assert row["contact_per_step"] is None and row["learned_vs_contact"] is None  # a term the env does not report
    assert row["true_return"] == pytest.approx(np.mean([e["true"].sum() for e in episodes]))
    assert row["learned_return"] == pytest.approx(np.mean([x.sum() for x in learned]))
    assert row["disagreement"] == pytest.approx(0.2 / 0.4) and row["steps"] == 100


def test_a_real_runs_model_is_read_on_its_policys_episodes_with_the_runs_end_of_an_episode(chdir_tmp):
    sac_rlhf.main(small_args("source", total_timesteps=800, terminate_when_unhealthy=False))
    output = chdir_tmp / "out.json"
    command = [
        sys.executable, str(REPO / "bench" / "reward_on_policies.py"), "--workdir", str(chdir_tmp), "--reward-from", "source",
        "--policies", "own=source", "still=zero-actions", "--episodes", "2", "--output", str(output),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(output.read_text())
    row, still = result["rows"]
    # The run had no end on a fall, so neither do its episodes here: Hopper-v5's 1000 steps each.
    assert row["policy"] == "own" and row["episodes"] == 2 and row["steps"] == 1000
    assert result["settings"]["terminate_when_unhealthy"] is False
    # Hopper-v5 pays forward progress, a healthy reward and a control cost, reported as paid: they make up its return.
    per_step = row["forward_per_step"] + row["ctrl_per_step"] + row["survive_per_step"]
    assert per_step * row["steps"] == pytest.approx(row["true_return"], rel=1e-6)
    assert row["ctrl_per_step"] < 0 and row["contact_per_step"] is None
    # Doing nothing pays no control cost and stands for the whole episode; the two policies are ordered once.
    assert still["policy"] == "still" and still["ctrl_per_step"] == 0.0 and still["steps"] == 1000
    expected = 1.0 if (row["true_return"] > still["true_return"]) == (row["learned_return"] > still["learned_return"]) else 0.0
    assert row["ranked_as_true"] == still["ranked_as_true"] == expected
    assert "--reward-from source" in result["command"]

    # A policy that is no finished run under the workdir is refused in one line naming it; nothing is written.
    refused = subprocess.run([*command[:-1], str(chdir_tmp / "again.json"), "--policies", "gone=nope"], capture_output=True, text=True)
    assert refused.returncode != 0 and refused.stderr.strip().splitlines() == [
        f"--policies nope: {chdir_tmp / 'runs' / 'nope' / 'args.json'} is missing (a finished run under --workdir {chdir_tmp} has it)"
    ]
    assert not (chdir_tmp / "again.json").exists()
