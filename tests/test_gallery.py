"""The README's gallery: toolbox/gallery.py films a shipped policy into a small GIF of the frames its settings say, the
same bytes each time; the README's gallery shows exactly the policies the manifest lists, with how each was taught and
its labels, and every GIF it shows exists; bad names, missing policies and bad captions are refused in one line."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from cleanrlhf_utils.envs import make_env
from cleanrlhf_utils.errors import ConfigError
from cleanrlhf_utils.policies import FROM_PREFERENCES, TAUGHT_BY, gallery_gif, read_manifest

REPO = Path(__file__).resolve().parents[1]
POLICIES = REPO / "policies"
sys.path.insert(0, str(REPO / "toolbox"))


def gif_frames(path: Path) -> tuple[list[np.ndarray], list[int]]:
    """A GIF's frames as RGB arrays and each one's duration in milliseconds."""
    image = Image.open(path)
    frames, durations = [], []
    for index in range(image.n_frames):
        image.seek(index)
        frames.append(np.asarray(image.convert("RGB")).astype(int))
        durations.append(image.info["duration"])
    return frames, durations


def test_a_gif_holds_the_frames_its_settings_say_and_the_same_seed_gives_the_same_bytes(tmp_path, capsys):
    """The windmill renders 25 frames a second: 0.8 s at 12.5 frames a second keeps every second step of the first 20,
    10 frames of 80 ms each, at the size asked for; each frame shows a scene (not one colour), the blades move from
    frame to frame, and a second film of the same seed is the same file."""
    import gallery

    settings = {"names": ("windmill-clockwise-pebble",), "seconds": 0.8, "fps": 12.5, "width": 96, "height": 72}
    (gif,) = gallery.main(gallery.Args(out_dir=str(tmp_path / "a"), **settings))
    assert gif == tmp_path / "a" / "windmill-clockwise-pebble.gif"
    assert "windmill-clockwise-pebble.gif: 10 frames of 96x72" in capsys.readouterr().out
    frames, durations = gif_frames(gif)
    assert len(frames) == 10 and durations == [80] * 10
    assert all(frame.shape == (72, 96, 3) and frame.std() > 10 for frame in frames)
    assert all((after != before).any(-1).sum() > 20 for before, after in zip(frames, frames[1:]))  # pixels that changed
    (again,) = gallery.main(gallery.Args(out_dir=str(tmp_path / "b"), **settings))
    assert again.read_bytes() == gif.read_bytes()
    (later,) = gallery.main(gallery.Args(out_dir=str(tmp_path / "c"), **settings | {"seed": 1}))
    assert later.read_bytes() != gif.read_bytes()
    # An entry that names its filmed episode is filmed on it unless --seed says otherwise.
    shipped = tmp_path / "policies"
    shipped.mkdir()
    shutil.copy(POLICIES / "windmill-clockwise-pebble.pt", shipped)
    entry = read_manifest(POLICIES)["windmill-clockwise-pebble.pt"] | {"film_seed": 1}
    (shipped / "manifest.json").write_text(json.dumps({"windmill-clockwise-pebble.pt": entry}))
    (named,) = gallery.main(gallery.Args(policies=str(shipped), out_dir=str(tmp_path / "d"), **settings))
    assert named.read_bytes() == later.read_bytes()
    (overridden,) = gallery.main(gallery.Args(policies=str(shipped), out_dir=str(tmp_path / "e"), **settings | {"seed": 0}))
    assert overridden.read_bytes() == gif.read_bytes()


def test_the_track_camera_follows_the_robot_where_the_side_camera_stays_put():
    """Moved 1 m forward, the HalfCheetah stays where it was in the track camera's frame (the floor moves under it);
    from the side camera it moves right. A track frame depends on its state alone, not on the frames before it."""

    def frames(camera: str, forwards: list[float]) -> list[np.ndarray]:
        env = make_env("HalfCheetah-v5", 0, "rgb_array", 160, 120, camera=camera)()
        env.reset(seed=0)
        qpos, qvel = env.unwrapped.init_qpos.copy(), env.unwrapped.init_qvel.copy()
        rendered = []
        for forward in forwards:
            env.unwrapped.set_state(qpos + np.eye(len(qpos))[0] * forward, qvel)
            rendered.append(env.render().astype(int))
        env.close()
        return rendered

    def body_column(frame: np.ndarray) -> float:
        return np.nonzero((frame[..., 0] - frame[..., 2] > 40).any(0))[0].mean()  # the cheetah's tan: floor and sky are grey

    start, forward = frames("track", [0.0, 1.0])
    assert abs(body_column(forward) - body_column(start)) < 2 and np.abs(forward - start).mean() > 1
    assert np.array_equal(frames("track", [1.0])[0], forward)
    start, forward = frames("side", [0.0, 1.0])
    assert body_column(forward) - body_column(start) > 30


def readme_gallery() -> list[str]:
    readme = (REPO / "README.md").read_text()
    assert readme.count("<!-- gallery:start -->") == 1 and readme.count("<!-- gallery:end -->") == 1
    head, block = readme.split("<!-- gallery:start -->")
    assert head.count("\n## ") == 0, "the gallery comes before the README's first section"
    return re.findall(r"<td[^>]*>(.*?)</td>", block.split("<!-- gallery:end -->")[0], re.S)


def test_the_readme_gallery_shows_exactly_the_shipped_policies_and_how_each_was_taught():
    """One cell per manifest entry, in its order: its GIF (which exists, at most 400 kB), its title, who taught it and,
    for a policy taught by preferences, its label count. A policy added to the manifest without `python
    toolbox/gallery.py && python dev/gen_docs.py` fails here."""
    manifest = read_manifest(POLICIES)
    cells = readme_gallery()
    assert len(cells) == len(manifest), "regenerate with: python toolbox/gallery.py && python dev/gen_docs.py"
    for cell, (name, entry) in zip(cells, manifest.items(), strict=True):
        (gif,) = re.findall(r'<img src="([^"]+)"', cell)
        assert gif == gallery_gif(name) == f"docs/gallery/{name.removesuffix('.pt')}.gif"
        assert (REPO / gif).is_file() and (REPO / gif).stat().st_size <= 400_000, gif
        assert f"<b>{entry['behaviour']}</b>" in cell and TAUGHT_BY[entry["taught_by"]] in cell, name
        if entry["taught_by"] in FROM_PREFERENCES:
            assert f"{entry['labels']} labels" in cell, name
        else:
            assert entry["labels"] == 0 and "labels" not in cell and "not preferences" in cell, name


def test_the_shipped_policies_say_who_taught_them():
    manifest = read_manifest(POLICIES)
    taught = {name: (entry["taught_by"], entry["labels"]) for name, entry in manifest.items()}
    assert taught["hopper-landed-backflip-sac.pt"] == taught["ant-raise-leg-sac.pt"] == ("objective-ceiling", 0)
    assert taught["windmill-clockwise-pebble.pt"] == taught["windmill-counterclockwise-pebble.pt"] == ("synthetic-teacher", 44)
    assert taught["halfcheetah-pebble.pt"] == taught["ant-raise-leg-pebble.pt"] == ("synthetic-teacher", 500)


def test_bad_names_missing_policies_and_bad_captions_are_refused_in_one_line(tmp_path):
    import export_policy
    import gallery

    result = subprocess.run(
        [sys.executable, str(REPO / "toolbox" / "gallery.py"), "--names", "no-such-policy", "--out-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert (
        "--names no-such-policy: not a shipped policy; allowed: " + ", ".join(name.removesuffix(".pt") for name in read_manifest(POLICIES))
        in line
    )
    assert list(tmp_path.iterdir()) == []
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    shutil.copy(POLICIES / "manifest.json", shipped)  # the manifest without its .pt files
    with pytest.raises(ConfigError, match=r"^--names windmill-clockwise-pebble: .*windmill-clockwise-pebble\.pt is missing$"):
        gallery.main(gallery.Args(names=("windmill-clockwise-pebble",), policies=str(shipped), out_dir=str(tmp_path)))
    manifest = json.loads((shipped / "manifest.json").read_text())
    manifest["halfcheetah-pebble.pt"]["taught_by"] = "a-crowd"
    (shipped / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"halfcheetah-pebble\.pt: taught_by 'a-crowd' is not one of: synthetic-teacher, "):
        gallery.main(gallery.Args(policies=str(shipped), out_dir=str(tmp_path)))
    common = {"checkpoint": "models/none", "name": "x", "setting": "a test", "out_dir": str(tmp_path / "out")}
    with pytest.raises(ConfigError, match=r"^--taught-by 'teacher' is not one of: synthetic-teacher, simulated-person, person, "):
        export_policy.main(export_policy.Args(behaviour="Walking", taught_by="teacher", **common))
    with pytest.raises(ConfigError, match=r"^--labels 0: a policy taught by person learned from at least 1 label$"):
        export_policy.main(export_policy.Args(behaviour="Walking", taught_by="person", **common))
    with pytest.raises(ConfigError, match=r"^--behaviour ' ': a short title"):
        export_policy.main(export_policy.Args(behaviour=" ", taught_by="objective-ceiling", **common))
    assert not (tmp_path / "out").exists()
