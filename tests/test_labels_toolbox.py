"""toolbox/labels.py: label stores listed, merged without duplicates, exported and imported back
unchanged, and Cohen's kappa on pairs labelled by two people, on real label logs and a real server database."""

import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cleanrlhf_utils.feedback import LabelLog, read_label_file

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("labels_toolbox", ROOT / "toolbox" / "labels.py")
labels_tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(labels_tool)

L, OBS, ACT, STATE = 5, 3, 2, 4


def pairs(n: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    masks = np.ones((n, 2, L), dtype=bool)
    masks[0, 1, 3:] = False  # an episode that ended inside a segment
    return {
        "obs_actions": rng.normal(size=(n, 2, L, OBS + ACT)).astype(np.float32),
        "masks": masks,
        "true_rewards": rng.normal(size=(n, 2, L)).astype(np.float32),
        "physics_states": rng.normal(size=(n, 2, L, STATE)),
    }


def swapped(segments: dict, i: int) -> dict:
    return {name: values[i : i + 1, ::-1].copy() for name, values in segments.items()}


def log(path: Path, segments: dict, labels, annotator: str, session: int = 1) -> Path:
    store = LabelLog(path)
    store.append(segments, np.asarray(labels, dtype=np.float32), [annotator] * len(labels), session, 100 * session)
    store.close()
    return path


@pytest.fixture
def stores(tmp_path):
    """ann labelled 6 pairs; bob labelled 5 of them (one shown the other way round) and one more."""
    segs = pairs(7)
    first6 = {k: v[:6] for k, v in segs.items()}
    ann = log(tmp_path / "runs" / "ann" / "labels.sqlite", first6, [0, 0, 1, 1, 0.5, 1], "ann")
    # bob: pairs 0-3 as shown to ann, pair 4 swapped (bob's 'right' there is ann's 'left'), and pair 6
    bob_segments = {k: np.concatenate([v[:4], swapped(segs, 4)[k], v[6:7]]) for k, v in segs.items()}
    bob = log(tmp_path / "runs" / "bob" / "labels.sqlite", bob_segments, [0, 1, 1, 1, 1, 0], "bob")
    return {"ann": ann, "bob": bob, "segments": segs, "tmp": tmp_path}


def test_kappa_on_pairs_labelled_by_two_people_equals_the_hand_computed_value(stores, capsys):
    # Shared pairs 0-4. ann: left, left, right, right, tie; bob: left, right, right, right, left (pair 4 seen swapped).
    # p_o = 3/5; ann's frequencies left .4 right .4 tie .2, bob's left .4 right .6 tie 0: p_e = .16 + .24 = .40;
    # kappa = (.6 - .4) / (1 - .4) = 1/3.
    (row,) = labels_tool.main(["agreement", str(stores["tmp"] / "runs")])
    assert row["annotators"] == ("ann", "bob") and (row["pairs"], row["agree"]) == (5, 3)
    assert row["kappa"] == pytest.approx(1 / 3)
    assert "ann / bob: 5 pairs labelled by both, 3 the same, Cohen's kappa 0.333" in capsys.readouterr().out
    assert labels_tool.cohen_kappa([0, 1, 0.5, 1], [0, 1, 0.5, 1]) == 1.0
    assert np.isnan(labels_tool.cohen_kappa([1, 1], [1, 1]))  # one answer throughout: undefined, not 1 or 0

    listed = labels_tool.main(["list", str(stores["tmp"] / "runs")])
    assert [(s["kind"], s["labels"], s["annotators"]) for s in listed] == [
        ("label log", 6, {"ann": {"labels": 6, "left": 2, "right": 3, "tie": 1}}),
        ("label log", 6, {"bob": {"labels": 6, "left": 2, "right": 4, "tie": 0}}),
    ]


def test_merge_never_duplicates_and_file_mode_reads_the_result(stores):
    out = stores["tmp"] / "merged.sqlite"
    assert labels_tool.main(["merge", str(stores["ann"]), str(stores["bob"]), str(stores["ann"]), "--out", str(out)]) == 12
    assert labels_tool.main(["merge", str(stores["bob"]), "--out", str(out)]) == 0  # merged again: nothing new
    segments, labels = read_label_file(out)  # what --teacher-feedback-mode file reads
    own_a, labels_a = read_label_file(stores["ann"])
    own_b, labels_b = read_label_file(stores["bob"])
    np.testing.assert_array_equal(labels, np.concatenate([labels_a, labels_b]))
    for name in LabelLog.ARRAYS:
        np.testing.assert_array_equal(segments[name], np.concatenate([own_a[name], own_b[name]]))
    # the same pair by two people is kept twice (two opinions); by one person once
    assert [s["annotators"] for s in labels_tool.main(["list", str(out)])][0].keys() == {"ann", "bob"}


@pytest.mark.parametrize("fmt", ["npz", "uni-rlhf"])
def test_export_then_import_gives_identical_segments_and_labels(stores, fmt):
    merged = stores["tmp"] / "merged.sqlite"
    labels_tool.main(["merge", str(stores["ann"]), str(stores["bob"]), "--out", str(merged)])
    out = stores["tmp"] / ("labels.npz" if fmt == "npz" else "uni")
    labels_tool.main(["export", str(merged), "--format", fmt, "--out", str(out), "--obs-dim", str(OBS), "--env-id", "Toy-v0"])
    source = out if fmt == "npz" else out / "Toy-v0_human_labels"
    back = stores["tmp"] / "back.sqlite"
    assert labels_tool.main(["import", str(source), "--out", str(back)]) == 12
    assert labels_tool.main(["import", str(source), "--out", str(back)]) == 0  # imported twice: nothing twice
    before, after = read_label_file(merged), read_label_file(back)
    np.testing.assert_array_equal(after[1], before[1])
    for name in LabelLog.ARRAYS:
        assert after[0][name].dtype == before[0][name].dtype
        np.testing.assert_array_equal(after[0][name], before[0][name])
    assert [s["annotators"].keys() for s in labels_tool.main(["list", str(back)])] == [{"ann", "bob"}]
    if fmt == "npz":
        with np.load(out) as data:
            assert str(data["format"]) == "cleanrlhf-labels-v1" and data["obs_actions"].shape == (12, 2, L, OBS + ACT)
            assert list(data["annotators"][:1]) == ["ann"] and data["labels"].dtype == np.float32
    else:  # the three pickles Clean-Offline-RLHF sorts into labels, indices_1, indices_2
        names = sorted(p.name for p in source.iterdir() if p.name != "dataset.npz")
        assert names == [f"{kind}_domain_mujoco_env_Toy-v0_num_12_len_{L}" for kind in ("human_label", "indices_1", "indices_2")]
        with np.load(source / "dataset.npz") as data:
            assert data["observations"].shape == (12 * 2 * L, OBS) and data["actions"].shape == (12 * 2 * L, ACT)


def test_server_database_is_listed_with_annotators_and_agreement(tmp_path):
    spec = importlib.util.spec_from_file_location("feedback_server", ROOT / "humanFeedback" / "feedback_server.py")
    fs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fs)
    client = fs.create_app(tmp_path / "data").test_client()
    run = client.post("/api/runs", json={"name": "r", "env_id": "Hopper-v5"}).get_json()["run_id"]
    queries = [
        {"left_clip": f"q{i}a.mp4", "right_clip": f"q{i}b.mp4", "left_segment_id": i, "right_segment_id": 10 + i, "session": 1}
        for i in range(3)
    ]
    clip = b"\x00\x00\x00\x18ftypisom\x00\x00\x02\x00isomiso2"
    files = [(io.BytesIO(clip + name.encode()), name) for q in queries for name in (q["left_clip"], q["right_clip"])]
    resp = client.post(
        f"/api/runs/{run}/queries", data={"queries": json.dumps(queries), "clips": files}, content_type="multipart/form-data"
    )
    ids = resp.get_json()["query_ids"]
    for qid, choice, who in zip(ids, ("left", "tie", "skip"), ("ann", "bob", "ann")):
        assert client.post(f"/api/queries/{qid}/label", json={"choice": choice, "annotator": who}).status_code == 201
    (s,) = labels_tool.main(["list", str(tmp_path / "data")])
    assert (s["kind"], s["labels"], s["skips"]) == ("server", 2, 1)
    assert s["annotators"] == {"ann": {"labels": 1, "left": 1, "right": 0, "tie": 0}, "bob": {"labels": 1, "left": 0, "right": 0, "tie": 1}}
    labels_tool.main(["export", str(tmp_path / "data"), "--format", "npz", "--out", str(tmp_path / "server.npz")])
    with np.load(tmp_path / "server.npz") as data:
        assert data["segment_ids"].tolist() == [["0", "10"], ["1", "11"]] and data["labels"].tolist() == [0.0, 0.5]


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["list", "nowhere"], "nowhere is not a label store"),
        (["export", "STORE", "--format", "csv", "--out", "x"], "invalid choice: 'csv'"),
        (
            ["export", "STORE", "--format", "uni-rlhf", "--out", "u"],
            "--obs-dim None is not allowed; give the environment's observation size, from 1 to 4",
        ),
        (["import", "missing.npz", "--out", "x.sqlite"], "missing.npz does not exist"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(stores, argv, fragment):
    argv = [str(stores["ann"]) if a == "STORE" else a for a in argv]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "toolbox" / "labels.py"), *argv], capture_output=True, text=True, cwd=stores["tmp"], timeout=60
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("labels.py: error: ") and fragment in lines[0], proc.stderr


def test_imitation_export_says_what_it_needs_when_imitation_is_missing(stores):
    if importlib.util.find_spec("imitation") is not None:
        pytest.skip("imitation is installed here")
    with pytest.raises(SystemExit) as exit_info:
        labels_tool.main(["export", str(stores["ann"]), "--format", "imitation", "--out", str(stores["tmp"] / "p.pkl"), "--obs-dim", "3"])
    assert exit_info.value.code == 2 and not (stores["tmp"] / "p.pkl").exists()


def test_rankings_and_ratings_are_read_as_the_pairs_of_clips_they_decide(tmp_path):
    """A run with --clips-per-query 3 stores each ranking as one order index over 3 clips, a run with --rating-scale
    each query's ratings as one number: every command reads them as the pairs of clips they decide, in the order
    shown, with those clips' segments."""
    rng = np.random.default_rng(0)
    segments = {
        "obs_actions": rng.normal(size=(1, 3, L, OBS + ACT)).astype(np.float32),
        "masks": np.ones((1, 3, L), dtype=bool),
        "true_rewards": rng.normal(size=(1, 3, L)).astype(np.float32),
        "physics_states": rng.normal(size=(1, 3, L, STATE)),
    }
    ranked = log(tmp_path / "runs" / "ranked" / "labels.sqlite", segments, [3.0], "ann")  # the order (1, 2, 0): index 3
    rated = LabelLog(tmp_path / "runs" / "rated" / "labels.sqlite", rating_scale=5)
    rated.append(segments, np.array([0 + 4 * 5 + 4 * 25], dtype=np.float32), ["bob"], 1, 100)  # rated 1, 5, 5
    rated.close()
    labels_tool.main(["export", str(ranked), str(tmp_path / "runs" / "rated"), "--format", "npz", "--out", str(tmp_path / "x.npz")])
    with np.load(tmp_path / "x.npz") as data:
        # pairs (0, 1), (0, 2), (1, 2): clip 1 ranked first, then 2, then 0; rated 1, 5 and 5 (the last two alike)
        assert data["labels"].tolist() == [1.0, 1.0, 0.0, 1.0, 1.0, 0.5]
        clips = [(0, 1), (0, 2), (1, 2)] * 2
        expected = np.stack([segments["obs_actions"][0, [i, j]] for i, j in clips])
        np.testing.assert_array_equal(data["obs_actions"], expected)
        assert data["annotators"].tolist() == ["ann"] * 3 + ["bob"] * 3
    (summary,) = labels_tool.main(["list", str(ranked)])
    assert summary["labels"] == 3 and summary["annotators"]["ann"] == {"labels": 3, "left": 1, "right": 2, "tie": 0}
