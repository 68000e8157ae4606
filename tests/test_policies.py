"""Shipped policies (policies/*.pt with policies/manifest.json): each one measures what its entry records, an export
from a run's checkpoint evaluates bit for bit as recorded, the side camera stays put, and a filmstrip shows the frames
it says."""

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from cleanrlhf_utils.envs import SegmentRenderer, get_physics_state, make_env, write_mp4
from cleanrlhf_utils.tracking import machine

REPO_ROOT = Path(__file__).resolve().parents[1]
POLICIES = REPO_ROOT / "policies"
MANIFEST = json.loads((POLICIES / "manifest.json").read_text())
sys.path.insert(0, str(REPO_ROOT / "toolbox"))


def test_policies_are_shipped_small_and_intact():
    assert MANIFEST, "policies/manifest.json lists no policy"
    assert sorted(path.name for path in POLICIES.glob("*.pt")) == sorted(MANIFEST)
    for name, entry in MANIFEST.items():
        data = (POLICIES / name).read_bytes()
        assert len(data) < 1_000_000 and hashlib.sha256(data).hexdigest() == entry["sha256"], name


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_a_shipped_policy_measures_what_its_manifest_records(name):
    """The first check_episodes of the recorded evaluation, run again: on the machine that recorded them the same
    numbers bit for bit; on another CPU the simulation may part ways after a while, so there at least half the
    recorded objective success, or of the return for a policy of the env's own task (the behaviour is still there)."""
    import evaluation

    measure = MANIFEST[name]["measure"]
    episodes = measure["check_episodes"]
    result = evaluation.main(evaluation.Args(policy=str(POLICIES / name), episodes=episodes, seed=measure["seed"]))
    objective = MANIFEST[name]["objective"]  # "": a policy of the env's own task, measured by its return
    assert result.get("objective", "") == objective == measure.get("objective", "")
    recorded = ("returns", "objective_returns", "objective_successes") if objective else ("returns",)
    if machine() == measure["machine"]:
        for key in recorded:
            assert result[key] == measure[key][:episodes], key
        for measure_name, values in measure.get("objective_measures_per_episode", {}).items():
            assert result["objective_measures_per_episode"][measure_name] == values[:episodes], measure_name
    elif objective:
        assert np.mean(result["objective_successes"]) >= 0.5 * np.mean(measure["objective_successes"][:episodes])
    else:
        assert np.mean(result["returns"]) >= 0.5 * np.mean(measure["returns"][:episodes])


def test_an_exported_checkpoint_evaluates_as_recorded(chdir_tmp):
    """A short sac.py run on the landed-backflip objective, exported: the .pt holds the actor's weights alone, the
    entry rebuilds it (env, hidden sizes, no termination), and evaluating the file again gives the recorded numbers
    exactly, with the objective's further measure beside its success."""
    import export_policy
    import torch

    import evaluation
    import sac

    sac.main(
        sac.Args(
            env_id="Hopper-v5", reward_objective="hopper-landed-backflip", total_timesteps=300, learning_starts=100,
            batch_size=32, actor_hidden_dim=32, critic_hidden_dim=32, evaluation_frequency=0, evaluation_episodes=1,
            torch_threads=1, cuda=False, progress_bar=False, run_name="flip",
            terminate_when_unhealthy=False, terminate_when_tilted=False,  # what the objective needs
        )
    )  # fmt: skip
    entry = export_policy.main(
        export_policy.Args(
            "models/flip/latest", "flip", "a test", "Hopper flipping", "objective-ceiling",
            episodes=2, check_episodes=1, commit="abc1234", out_dir="shipped", film_seed=3,
        )
    )  # fmt: skip
    weights, actor = (
        torch.load("shipped/flip.pt", weights_only=True),
        torch.load("models/flip/latest/checkpoint.pt", weights_only=False)["agent"]["actor"],
    )
    assert weights.keys() == actor.keys() and all(torch.equal(weights[key], actor[key]) for key in actor)
    assert entry["env_id"] == "Hopper-v5" and entry["objective"] == "hopper-landed-backflip" and entry["steps"] == 300
    assert (entry["actor_hidden_dim"], entry["terminate_when_unhealthy"], entry["terminate_when_tilted"]) == (32, False, False)
    assert entry["measure"]["objective_measures"].keys() == {"torso_high_backflips"}
    assert (entry["behaviour"], entry["taught_by"]) == ("Hopper flipping", "objective-ceiling")  # the gallery's caption
    assert entry["film_seed"] == 3 and entry["measure"]["seed"] == 0  # the gallery films an episode the measure did not
    again = evaluation.main(evaluation.Args(policy="shipped/flip.pt", episodes=2))
    for key in ("returns", "objective_returns", "objective_successes", "objective_measures_per_episode"):
        assert again[key] == entry["measure"][key], key
    with pytest.raises(evaluation.ConfigError, match="give --path-to-model .* or --policy"):
        evaluation.main(evaluation.Args(path_to_model="models/flip/latest", policy="shipped/flip.pt"))


def test_video_is_the_short_name_of_capture_video():
    import evaluation
    from cleanrlhf_utils.arguments import parse_args

    assert parse_args(evaluation.Args, ["--policy", "p.pt", "--video"]).capture_video is True
    assert parse_args(evaluation.Args, ["--policy", "p.pt", "--capture-video", "--camera", "side"]).camera == "side"


def hopper_columns(frame: np.ndarray) -> np.ndarray:
    """The image columns the Hopper's brown body covers."""
    return np.nonzero((np.abs(frame.astype(int) - [200, 120, 60]).sum(-1) < 120).any(0))[0]


def hopper_rows(frame: np.ndarray) -> np.ndarray:
    return np.nonzero((np.abs(frame.astype(int) - [200, 120, 60]).sum(-1) < 120).any(1))[0]


def test_the_side_camera_stays_put_and_shows_the_floor():
    """Moved 1 m forward the Hopper moves right in the frame, lifted 0.5 m it moves up: the camera follows neither.
    The lower part of the frame is the checkered floor, the upper part the sky."""
    env = make_env("Hopper-v5", 0, "rgb_array", 320, 240, terminate_when_unhealthy=False, camera="side")()
    env.reset(seed=0)
    qpos, qvel = env.unwrapped.init_qpos.copy(), env.unwrapped.init_qvel.copy()
    env.unwrapped.set_state(qpos, qvel)
    start = env.render()
    env.unwrapped.set_state(qpos + [1.0, 0, 0, 0, 0, 0], qvel)
    forward = env.render()
    env.unwrapped.set_state(qpos + [0, 0.5, 0, 0, 0, 0], qvel)
    lifted = env.render()
    assert hopper_columns(forward).mean() - hopper_columns(start).mean() > 30
    assert hopper_rows(start).mean() - hopper_rows(lifted).mean() > 15
    grey = start.mean(-1)
    assert grey[-40:].std() > 3 * grey[:40].std()  # checkers below, an even sky above
    renderer = SegmentRenderer("Hopper-v5", 320, 240, camera="side")  # stored states re-rendered (clips, filmstrips)
    try:
        env.reset(seed=0)
        env.unwrapped.set_state(qpos + [1.0, 0, 0, 0, 0, 0], qvel)
        again = renderer.render_states(get_physics_state(env)[None])[0]
    finally:
        renderer.close()
        env.close()
    assert np.abs(again.astype(int) - forward).mean() < 1


def test_a_filmstrip_holds_the_frames_it_names(tmp_path, capsys):
    """A 30-frame video whose frame i is grey level 8 i: a 4-frame strip of frames 6 to 27 holds frames 6, 13, 20 and
    27 side by side, white lines between them; --crop keeps the columns asked for, --gif writes the stretch."""
    import filmstrip
    from PIL import Image

    frames = np.repeat((8 * np.arange(30, dtype=np.uint8))[:, None, None, None], 3, -1) * np.ones((30, 48, 64, 3), np.uint8)
    write_mp4(tmp_path / "grey.mp4", frames, 25)
    out = tmp_path / "strip.png"
    filmstrip.main(
        filmstrip.Args(str(tmp_path / "grey.mp4"), str(out), first=6, last=27, frames=4, crop=(8, 40), gif=str(tmp_path / "s.gif"))
    )
    image = np.asarray(Image.open(out).convert("RGB")).astype(int)
    assert image.shape == (48, 4 * 32 + 3 * 2, 3)
    levels = [image[:, column * 34 : column * 34 + 32].mean() for column in range(4)]
    assert np.allclose(levels, [48, 104, 160, 216], atol=4), levels
    assert (image[:, 32:34] == 255).all()
    assert "frames 6, 13, 20, 27" in capsys.readouterr().out
    gif = Image.open(tmp_path / "s.gif")
    assert gif.n_frames == 22 and gif.size == (32, 48)
    filmstrip.main(filmstrip.Args(str(tmp_path / "grey.mp4"), str(out), gif=str(tmp_path / "half.gif"), gif_step=3, gif_scale=0.5))
    half = Image.open(tmp_path / "half.gif")
    assert half.n_frames == 10 and half.size == (32, 24)
