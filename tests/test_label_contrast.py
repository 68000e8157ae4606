"""bench/label_contrast.py: what a run's labels tell apart in the control cost and the rest of the reward, and what its
model learned of each."""

from pathlib import Path

import numpy as np
import pytest
import torch
from test_bench import bench_module
from test_end_to_end import small_args

import sac_rlhf
from cleanrlhf_utils.feedback import read_label_file

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def label_contrast():
    return bench_module("label_contrast")


def pairs(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Segment pairs whose true return is the rest of the reward less the control cost, as Gymnasium's MuJoCo envs pay."""
    rng = np.random.default_rng(seed)
    control, rest = rng.uniform(0, 20, (n, 2)), rng.normal(0, 10, (n, 2))
    return {"control": control, "rest": rest, "true": rest - control, "steps": np.full((n, 2), 50.0)}


def test_a_model_that_learned_only_the_rest_shows_no_control_cost_where_the_labels_do(label_contrast):
    x = pairs(400)
    labels = (x["true"][:, 1] > x["true"][:, 0]).astype(np.float32)
    shared = {"control": x["control"], "true": x["true"], "steps": x["steps"], "labels": labels}
    blind = label_contrast.contrast_row("run", 1, model=x["rest"], **shared)
    assert blind["label_control"] > 0.5 and blind["label_rest"] > 0.5  # both terms move the teacher's labels
    assert abs(blind["model_control"]) < 0.15 and blind["model_rest"] == pytest.approx(1.0)
    assert 0.5 < blind["model_agreement"] < 0.95  # it ranks by the rest alone: right only where the rest decides
    exact = label_contrast.contrast_row("run", 1, model=x["true"], **shared)
    assert exact["model_control"] == pytest.approx(exact["label_control"]) and exact["model_agreement"] == 1.0
    assert exact["control_per_step"] == pytest.approx(x["control"].sum() / x["steps"].sum())
    assert exact["d_control"] == pytest.approx(np.abs(x["control"][:, 1] - x["control"][:, 0]).mean())


def test_ties_are_left_out_of_the_agreement(label_contrast):
    x = pairs(10)
    labels = np.where(x["true"][:, 1] > x["true"][:, 0], 1.0, 0.0)
    labels[:5] = 0.5
    wrong_on_ties = x["true"].copy()
    wrong_on_ties[:5, 1] = wrong_on_ties[:5, 0] + 1.0  # counted, the ties would be wrong: segment 1 preferred over a tie
    row = label_contrast.contrast_row("run", 1, x["control"], x["true"], wrong_on_ties, x["steps"], labels)
    assert row["model_agreement"] == 1.0 and row["pairs"] == 10


def test_the_share_of_labels_the_control_cost_alone_decides(label_contrast):
    x = pairs(400, seed=1)
    by_torque = (x["control"][:, 1] < x["control"][:, 0]).astype(np.float32)  # the segment with less torque preferred
    by_true = (x["true"][:, 1] > x["true"][:, 0]).astype(np.float32)
    shared = {"control": x["control"], "true": x["true"], "model": x["true"], "steps": x["steps"]}
    assert label_contrast.contrast_row("run", 1, **shared, labels=by_torque)["label_control_decides"] == 1.0
    assert label_contrast.contrast_row("run", 1, **shared, labels=1 - by_torque)["label_control_decides"] == 0.0
    mixed = label_contrast.contrast_row("run", 1, **shared, labels=by_true)["label_control_decides"]
    expected = ((x["control"][:, 1] < x["control"][:, 0]) == (by_true > 0.5)).mean()
    assert mixed == pytest.approx(expected) and 0.5 < mixed < 1.0  # the rest decides the others


def test_what_the_model_pays_for_the_rest_against_the_control_cost(label_contrast):
    rng = np.random.default_rng(2)
    control, rest = rng.uniform(0, 2, 5000), rng.normal(0, 1, 5000)
    true = rest - control
    fit = label_contrast.rest_per_control
    assert fit(3.0 - control + rest, control, true) == pytest.approx(1.0)  # the true reward's price, shifted
    assert fit(3.0 - 2.0 * control + 0.5 * rest, control, true) == pytest.approx(0.25)


def test_a_runs_rows_cover_its_sessions_and_read_the_envs_control_cost(label_contrast, chdir_tmp):
    sac_rlhf.main(small_args("source", total_timesteps=800))
    segments, labels = read_label_file("runs/source/labels.sqlite")
    rows = label_contrast.run_rows(Path("."), "source", "tiny")
    sessions, pooled = rows[:-1], rows[-1]
    assert (
        {row["run"] for row in rows} == {"tiny"}
        and pooled["session"] == "all"
        and pooled["pairs"] == len(labels) == sum(row["pairs"] for row in sessions)
    )
    assert [row["session"] for row in sessions] == sorted({*label_contrast.label_column(Path("runs/source/labels.sqlite"), "session")})
    actions, masks = segments["obs_actions"][..., -3:], segments["masks"]  # Hopper: 3 actions, ctrl_cost_weight 1e-3
    expected = 1e-3 * ((actions**2).sum(-1) * masks).sum() / masks.sum()
    assert pooled["control_per_step"] == pytest.approx(expected, rel=1e-5)
    assert 0.0 <= pooled["model_agreement"] <= 1.0
    assert np.isfinite(pooled["model_rest_per_control"])
    replay = np.load("models/source/latest/replay_buffer.npz")  # the fit reads the final model's rewards stored there
    model, _ = label_contrast.load_reward_model("models/source/latest", "Hopper-v5", segments["obs_actions"].shape[-1])
    predicted = sac_rlhf.predict_rewards(model, torch.as_tensor(np.concatenate([replay["obs"], replay["actions"]], -1)))[0]
    np.testing.assert_array_equal(replay["learned_rewards"], predicted.numpy())
    assert all("model_rest_per_control" not in row for row in sessions)  # a run's final model: the pooled row only
