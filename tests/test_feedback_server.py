"""Tests of humanFeedback/feedback_server.py: every route through Flask's test client, plus a real
server process that is killed with SIGKILL and restarted on the same data directory."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVER = ROOT / "humanFeedback" / "feedback_server.py"

_spec = importlib.util.spec_from_file_location("feedback_server", SERVER)
fs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fs)


# ----------------------------------------------------------------------------- helpers


def fake_mp4(tag: str) -> bytes:
    """Smallest blob the server accepts as mp4: an 'ftyp' box at byte offset 4 (content differs per tag)."""
    return b"\x00\x00\x00\x18ftypisom\x00\x00\x02\x00isomiso2" + tag.encode()


def real_mp4(path: Path, shade: int, frames: int = 12) -> bytes:
    imageio_ffmpeg = pytest.importorskip("imageio_ffmpeg")
    np = pytest.importorskip("numpy")
    writer = imageio_ffmpeg.write_frames(
        str(path), (64, 48), fps=12, codec="libx264", pix_fmt_out="yuv420p", macro_block_size=16, ffmpeg_log_level="error"
    )
    writer.send(None)
    for i in range(frames):
        frame = np.full((48, 64, 3), shade, dtype=np.uint8)
        frame[:, (i * 5) % 64 :, 1] = 200
        writer.send(frame.tobytes())
    writer.close()
    return path.read_bytes()


class FakeClock:
    def __init__(self):
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def snapshot(data_dir: Path) -> dict:
    """Every row of every table plus every stored file: compared before/after a rejected request."""
    con = sqlite3.connect(data_dir / "feedback.sqlite3")
    try:
        tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
        snap = {t: con.execute(f"SELECT * FROM {t} ORDER BY rowid").fetchall() for t in tables}
    finally:
        con.close()
    clips = data_dir / "clips"
    snap["files"] = sorted((str(p.relative_to(data_dir)), p.read_bytes()) for p in clips.rglob("*") if p.is_file())
    return snap


def assert_error(resp, status: int, *fragments: str) -> str:
    assert resp.status_code == status, (resp.status_code, resp.get_data(as_text=True))
    body = resp.get_json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    message = body["error"]
    assert isinstance(message, str) and message.endswith("."), message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


def batch(prefix: str, n: int, session=1):
    queries = [
        {
            "left_clip": f"{prefix}{i}a.mp4",
            "right_clip": f"{prefix}{i}b.mp4",
            "left_segment_id": 10 * i,
            "right_segment_id": 10 * i + 1,
            "session": session,
        }
        for i in range(n)
    ]
    files = {name: fake_mp4(name) for q in queries for name in (q["left_clip"], q["right_clip"])}
    return queries, files


def form(field: str, items, files: dict[str, bytes]) -> dict:
    data = {field: items if isinstance(items, str) else json.dumps(items)}
    data["clips"] = [(io.BytesIO(content), name) for name, content in files.items()]
    return data


def upload(client, run_id, queries, files, headers=None):
    return client.post(
        f"/api/runs/{run_id}/queries", data=form("queries", queries, files), content_type="multipart/form-data", headers=headers
    )


class Env:
    def __init__(self, tmp_path: Path, **kwargs):
        self.data_dir = tmp_path / "data"
        self.clock = FakeClock()
        kwargs.setdefault("clock", self.clock)
        self.app = fs.create_app(self.data_dir, **kwargs)
        self.client = self.app.test_client()

    def run(self, name="run-a", env_id="Hopper-v5") -> int:
        resp = self.client.post("/api/runs", json={"name": name, "env_id": env_id, "meta": {"seed": 1}})
        assert resp.status_code == 201, resp.get_json()
        return resp.get_json()["run_id"]

    def queries(self, run_id, prefix="c", n=3, session=1) -> list[int]:
        queries, files = batch(prefix, n, session)
        resp = upload(self.client, run_id, queries, files)
        assert resp.status_code == 201, resp.get_json()
        return resp.get_json()["query_ids"]

    def label(self, query_id, choice, annotator="ann"):
        return self.client.post(f"/api/queries/{query_id}/label", json={"choice": choice, "annotator": annotator})

    def answers(self, run_id, after=0):
        resp = self.client.get(f"/api/runs/{run_id}/answers?after={after}")
        assert resp.status_code == 200
        return resp.get_json()

    def status(self, run_id):
        return self.client.get(f"/api/runs/{run_id}/status").get_json()

    def snap(self):
        return snapshot(self.data_dir)


@pytest.fixture
def env(tmp_path):
    return Env(tmp_path)


# ----------------------------------------------------------------------------- config, page, runs


def test_config_reports_flags(tmp_path):
    default = Env(tmp_path / "a").client.get("/api/config").get_json()
    assert default["choices"] == ["left", "right", "tie", "skip"]
    assert default["allow_editing"] is True and default["playback_speed"] == 1.0
    restricted = Env(tmp_path / "b", allow_ties=False, allow_skip=False, allow_editing=False, playback_speed=2.0)
    cfg = restricted.client.get("/api/config").get_json()
    assert cfg["choices"] == ["left", "right"]
    assert (cfg["allow_ties"], cfg["allow_skip"], cfg["allow_editing"], cfg["playback_speed"]) == (False, False, False, 2.0)


def test_storage_is_sqlite_wal_with_expected_tables(env):
    con = sqlite3.connect(env.data_dir / "feedback.sqlite3")
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"runs", "queries", "labels", "evaluations"} <= tables
    cols = {r[1] for r in con.execute("PRAGMA table_info(queries)")}
    assert {
        "run_id",
        "session",
        "left_clip",
        "right_clip",
        "left_segment_id",
        "right_segment_id",
        "lease_annotator",
        "lease_expires",
    } <= cols
    con.close()


# Each row breaks one rule of humanFeedback/schema.sql; the server checks all of them before writing,
# so these are only reachable by writing SQL directly, which is what the constraints guard against.
BAD_ROWS = {
    "choice outside left/right/tie/skip": (
        "INSERT INTO labels (query_id, choice, annotator, created_at, updated_at, seq) VALUES (:pending, 'maybe', 'a', 't', 't', 99)"
    ),
    "tombstone of an unknown choice": (
        "INSERT INTO label_tombstones (seq, label_id, query_id, choice, annotator, created_at, deleted_at) "
        "VALUES (99, 1, :pending, 'undone', 'a', 't', 't')"
    ),
    "label of a query that does not exist": (
        "INSERT INTO labels (query_id, choice, annotator, created_at, updated_at, seq) VALUES (999, 'left', 'a', 't', 't', 99)"
    ),
    "label with an empty annotator": (
        "INSERT INTO labels (query_id, choice, annotator, created_at, updated_at, seq) VALUES (:pending, 'left', '', 't', 't', 99)"
    ),
    "label without a seq": "INSERT INTO labels (query_id, choice, annotator, created_at, updated_at) VALUES (:pending, 'left', 'a', 't', 't')",
    "query of a run that does not exist": (
        "INSERT INTO queries (run_id, session, left_clip, right_clip, left_segment_id, right_segment_id, created_at) "
        "VALUES (999, 1, 'x.mp4', 'y.mp4', 1, 2, 't')"
    ),
    "query comparing a clip with itself": (
        "INSERT INTO queries (run_id, session, left_clip, right_clip, left_segment_id, right_segment_id, created_at) "
        "VALUES (:run, 1, 'x.mp4', 'x.mp4', 1, 2, 't')"
    ),
    "session that is a real number": (
        "INSERT INTO queries (run_id, session, left_clip, right_clip, left_segment_id, right_segment_id, created_at) "
        "VALUES (:run, 1.5, 'x.mp4', 'y.mp4', 1, 2, 't')"
    ),
    "missing segment id": (
        "INSERT INTO queries (run_id, session, left_clip, right_clip, left_segment_id, right_segment_id, created_at) "
        "VALUES (:run, 1, 'x.mp4', 'y.mp4', NULL, 2, 't')"
    ),
    "lease without an expiry": "UPDATE queries SET lease_annotator = 'a', lease_expires = NULL WHERE id = :pending",
    "negative evaluation step": (
        "INSERT INTO evaluations (run_id, clip, predicted_return, step, created_at) VALUES (:run, 'x.mp4', 1.0, -1, 't')"
    ),
    "evaluation step that is text": (
        "INSERT INTO evaluations (run_id, clip, predicted_return, step, created_at) VALUES (:run, 'x.mp4', 1.0, 'ten', 't')"
    ),
    "predicted return that is not a number": (
        "INSERT INTO evaluations (run_id, clip, predicted_return, step, created_at) VALUES (:run, 'x.mp4', 'high', 1, 't')"
    ),
    "run with an empty name": "INSERT INTO runs (name, created_at) VALUES ('', 't')",
}


@pytest.mark.parametrize("statement", BAD_ROWS.values(), ids=BAD_ROWS.keys())
def test_schema_refuses_invalid_rows_at_the_sql_level(env, statement):
    run_id = env.run()
    labelled, pending = env.queries(run_id, n=2, session="s1")
    assert env.label(labelled, "left").status_code == 201
    before = env.snap()
    con = sqlite3.connect(env.data_dir / "feedback.sqlite3")
    try:
        con.execute("PRAGMA foreign_keys = ON")
        with pytest.raises(sqlite3.IntegrityError):
            con.execute(statement, {"run": run_id, "pending": pending})
        con.commit()
    finally:
        con.close()
    assert env.snap() == before


def test_schema_keeps_sessions_and_segment_ids_as_sent(env):
    """Integer and string ids come back with their type: '7' stays a string, 7 an integer."""
    run_id = env.run()
    queries = [{"left_clip": "a.mp4", "right_clip": "b.mp4", "left_segment_id": "7", "right_segment_id": 7, "session": "3"}]
    assert upload(env.client, run_id, queries, {"a.mp4": fake_mp4("a"), "b.mp4": fake_mp4("b")}).status_code == 201
    assert upload(env.client, run_id, queries, {"a.mp4": fake_mp4("a"), "b.mp4": fake_mp4("b")}).status_code == 201  # identical again
    query_id = env.client.get("/api/next?annotator=a").get_json()["query_id"]
    assert env.label(query_id, "tie", annotator="a").status_code == 201
    (answer,) = env.answers(run_id)["answers"]
    assert (answer["session"], answer["left_segment_id"], answer["right_segment_id"]) == ("3", "7", 7)


def page_modules(client, html: str) -> dict[str, str]:
    """The page's ES modules, followed from its <script type="module"> through their imports: name -> source."""
    found: dict[str, str] = {}
    pending = re.findall(r'<script type="module" src="/static/js/([\w.]+)"></script>', html)
    while pending:
        name = pending.pop()
        if name in found:
            continue
        resp = client.get(f"/static/js/{name}")
        assert resp.status_code == 200, name
        assert resp.mimetype == "text/javascript"  # a browser runs a module script only with a JavaScript MIME type
        found[name] = resp.get_data(as_text=True)
        pending += re.findall(r'from "\./([\w.]+)"', found[name])
    return found


def test_page_is_served_with_both_videos_and_controls(env):
    resp = env.client.get("/")
    assert resp.status_code == 200 and resp.mimetype == "text/html"
    html = resp.get_data(as_text=True)
    for needle in ("<video", "muted", "playsinline", 'data-choice="left"', 'data-choice="tie"', "Undo last", "#rewards"):
        assert needle in html
    assert "Access-Control-Allow-Origin" not in resp.headers
    modules = page_modules(env.client, html)
    assert set(modules) == {"main.js", "api.js", "state.js", "player.js", "views.js", "answers.js"}
    assert "localStorage" in modules["state.js"] and "/api/next" in modules["api.js"]
    missing = env.client.get("/static/js/nothing.js")
    assert missing.status_code == 404 and "error" in missing.get_json()


def test_create_run_is_idempotent_by_name_and_listed(env):
    run_id = env.run("r1", "Hopper-v5")
    again = env.client.post("/api/runs", json={"name": "r1", "env_id": "Hopper-v5"})
    assert again.status_code == 200 and again.get_json() == {"run_id": run_id, "created": False}
    runs = env.client.get("/api/runs").get_json()["runs"]
    assert [(r["run_id"], r["name"], r["env_id"]) for r in runs] == [(run_id, "r1", "Hopper-v5")]
    assert "meta" not in runs[0]  # the list goes to every page visit: meta only per run
    assert env.client.get(f"/api/runs/{run_id}").get_json()["meta"] == {"seed": 1}
    assert env.status(run_id) == {"run_id": run_id, "queries": 0, "labelled": 0, "pending": 0, "choices": dict.fromkeys(fs.CHOICES, 0)}


@pytest.mark.parametrize(
    "body, content_type, status, fragments",
    [
        ("{not json", "application/json", 400, ["not valid JSON"]),
        ("", "application/json", 400, ["empty"]),
        ("[1, 2]", "application/json", 400, ["JSON object", "list"]),
        ('{"env_id": "Hopper-v5"}', "application/json", 400, ["'name'", "missing"]),
        ('{"name": 5}', "application/json", 400, ["'name'", "5"]),
        ('{"name": "r", "meta": [1]}', "application/json", 400, ["'meta'", "object"]),
        ('{"name": "r", "colour": 1}', "application/json", 400, ["colour", "allowed fields"]),
        ('{"name": "r", "meta": {"x": NaN}}', "application/json", 400, ["'meta'", "NaN"]),
        ('{"name": "r1", "env_id": "Walker2d-v5"}', "application/json", 409, ["r1", "Hopper-v5", "Walker2d-v5"]),
    ],
)
def test_create_run_rejects_bad_input_and_changes_nothing(env, body, content_type, status, fragments):
    env.run("r1", "Hopper-v5")
    before = env.snap()
    resp = env.client.post("/api/runs", data=body, content_type=content_type)
    assert_error(resp, status, *fragments)
    assert env.snap() == before


def test_unknown_route_and_method_give_json_errors(env):
    assert_error(env.client.get("/api/nothing"), 404, "/api/nothing")
    assert_error(env.client.delete("/api/runs"), 405, "DELETE")
    for path in ("/api/runs/99/status", "/api/runs/99/answers", "/api/runs/99/evaluations"):
        assert_error(env.client.get(path), 404, "Run 99")


# ----------------------------------------------------------------------------- query upload


def test_upload_stores_queries_and_clips_and_is_idempotent(env):
    run_id = env.run()
    queries, files = batch("c", 3)
    resp = upload(env.client, run_id, queries, files)
    assert resp.status_code == 201
    ids = resp.get_json()["query_ids"]
    assert len(ids) == 3 and ids == sorted(ids)
    for name, content in files.items():
        assert (env.data_dir / "clips" / str(run_id) / name).read_bytes() == content
    assert env.status(run_id)["queries"] == 3

    before = env.snap()
    again = upload(env.client, run_id, queries, files)
    assert again.status_code == 201 and again.get_json()["query_ids"] == ids
    assert env.snap() == before  # nothing duplicated

    more, more_files = batch("d", 1)
    mixed = upload(env.client, run_id, queries[:1] + more, {**{k: files[k] for k in ("c0a.mp4", "c0b.mp4")}, **more_files})
    assert mixed.status_code == 201
    assert mixed.get_json()["query_ids"][0] == ids[0] and mixed.get_json()["query_ids"][1] not in ids
    assert env.status(run_id)["queries"] == 4


def _bad_upload_cases():
    """(id, mutate(queries, files) -> (queries_or_raw, files), status, fragments)."""

    def set_key(i, key, value):
        def mutate(q, f):
            q[i][key] = value
            return q, f

        return mutate

    def rename_clip(old, new):
        def mutate(q, f):
            for item in q:
                for side in ("left_clip", "right_clip"):
                    if item[side] == old:
                        item[side] = new
            f[new] = f.pop(old)
            return q, f

        return mutate

    def replace_file(name, content):
        def mutate(q, f):
            f[name] = content
            return q, f

        return mutate

    return [
        ("slash-in-clip-name", rename_clip("c1a.mp4", "sub/c1a.mp4"), 400, ["sub/c1a.mp4", ".mp4"]),
        ("dotdot-clip-name", rename_clip("c1a.mp4", "../c1a.mp4"), 400, ["../c1a.mp4", "'..'"]),
        ("dotdot-inside-name", rename_clip("c1a.mp4", "a..b.mp4"), 400, ["a..b.mp4"]),
        ("backslash-clip-name", rename_clip("c1a.mp4", "x\\c1a.mp4"), 400, ["c1a.mp4", "'\\'"]),
        ("leading-dot", rename_clip("c1a.mp4", ".c1a.mp4"), 400, [".c1a.mp4", "leading dot"]),
        ("not-mp4-extension", rename_clip("c1a.mp4", "c1a.avi"), 400, ["c1a.avi", ".mp4"]),
        ("non-mp4-content", replace_file("c1a.mp4", b"GIF89a this is not a video at all"), 400, ["c1a.mp4", "ftyp"]),
        ("tiny-file", replace_file("c1a.mp4", b"abc"), 400, ["c1a.mp4", "mp4"]),
        ("missing-clip", lambda q, f: (q, {k: v for k, v in f.items() if k != "c1b.mp4"}), 400, ["c1b.mp4", "not uploaded"]),
        ("unreferenced-file", replace_file("extra.mp4", fake_mp4("extra")), 400, ["extra.mp4", "not referenced"]),
        ("missing-key", lambda q, f: (q[:1] + [{k: v for k, v in q[1].items() if k != "session"}], f), 400, ["queries[1]", "session"]),
        ("unknown-key", set_key(1, "colour", "red"), 400, ["queries[1]", "colour"]),
        ("same-clip-twice", set_key(1, "right_clip", "c1a.mp4"), 400, ["c1a.mp4", "differ"]),
        ("bool-session", set_key(1, "session", True), 400, ["queries[1].session", "integer"]),
        ("null-segment", set_key(1, "left_segment_id", None), 400, ["left_segment_id", "None"]),
        ("huge-segment", set_key(1, "right_segment_id", 2**70), 400, ["right_segment_id", "64-bit"]),
        ("not-an-object", lambda q, f: (q[:1] + ["c1a.mp4"], f), 400, ["queries[1]", "object"]),
        ("malformed-json", lambda q, f: ("[{not json", f), 400, ["'queries'", "not valid JSON"]),
        ("not-a-list", lambda q, f: ('{"left_clip": "a.mp4"}', f), 400, ["'queries'", "list"]),
        ("empty-list", lambda q, f: ("[]", {}), 400, ["'queries'", "non-empty"]),
    ]


@pytest.mark.parametrize("case", _bad_upload_cases(), ids=lambda c: c[0])
def test_upload_rejects_bad_batches_all_or_nothing(env, case):
    _, mutate, status, fragments = case
    run_id = env.run()
    env.queries(run_id, prefix="old", n=1)
    queries, files = batch("c", 2)  # entry 0 is valid: it must not be stored either
    queries, files = mutate(queries, files)
    before = env.snap()
    assert_error(upload(env.client, run_id, queries, files), status, *fragments)
    assert env.snap() == before


def test_upload_rejects_uploaded_file_name_with_path(env):
    run_id = env.run()
    queries, files = batch("c", 1)
    data = form("queries", queries, files)
    data["clips"].append((io.BytesIO(fake_mp4("x")), "../../evil.mp4"))
    before = env.snap()
    resp = env.client.post(f"/api/runs/{run_id}/queries", data=data, content_type="multipart/form-data")
    assert_error(resp, 400, "../../evil.mp4")
    assert env.snap() == before and not list(env.data_dir.parent.rglob("evil.mp4"))


def test_upload_rejects_missing_field_json_body_and_unknown_run(env):
    run_id = env.run()
    before = env.snap()
    resp = env.client.post(f"/api/runs/{run_id}/queries", data={"clips": []}, content_type="multipart/form-data")
    assert_error(resp, 400, "'queries'", "missing")
    assert_error(env.client.post(f"/api/runs/{run_id}/queries", json=[]), 415, "application/json", "multipart/form-data")
    queries, files = batch("c", 1)
    assert_error(upload(env.client, 999, queries, files), 404, "Run 999")
    assert env.snap() == before


def test_upload_over_size_limit_is_413_json(tmp_path):
    env = Env(tmp_path, max_upload_bytes=4096)
    run_id = env.run()
    queries, files = batch("c", 1)
    files["c0a.mp4"] = fake_mp4("big") + b"\x00" * 8000
    before = env.snap()
    assert_error(upload(env.client, run_id, queries, files), 413, "4096 bytes", "--max-upload-mb")
    assert env.snap() == before


def test_upload_conflicts_are_409_and_change_nothing(env):
    run_id = env.run()
    queries, files = batch("c", 2)
    assert upload(env.client, run_id, queries, files).status_code == 201
    before = env.snap()

    changed = json.loads(json.dumps(queries))
    changed[1]["left_segment_id"] = 777
    assert_error(upload(env.client, run_id, changed, files), 409, "queries[1]", "already exists")
    assert env.snap() == before

    new_queries, new_files = batch("n", 1)
    new_queries[0]["right_clip"] = "c0a.mp4"  # reuses a stored name with different bytes
    new_files.pop("n0b.mp4")
    new_files["c0a.mp4"] = fake_mp4("different bytes")
    assert_error(upload(env.client, run_id, new_queries, new_files), 409, "c0a.mp4", "different content")
    assert env.snap() == before


# ----------------------------------------------------------------------------- leases / next


def test_next_leases_one_query_per_annotator_and_reassigns_expired(tmp_path):
    env = Env(tmp_path, lease_seconds=60)
    run_id = env.run()
    q1, q2, q3 = env.queries(run_id, n=3)

    alice = env.client.get("/api/next?annotator=alice").get_json()
    bob = env.client.get("/api/next?annotator=bob").get_json()
    assert alice["query_id"] == q1 and bob["query_id"] == q2
    assert alice["left_url"] == f"/clips/{run_id}/c0a.mp4" and alice["right_url"] == f"/clips/{run_id}/c0b.mp4"
    assert alice["session"] == 1
    assert alice["progress"] == {"session_answered": 0, "session_total": 3, "total_labelled": 0, "total_skipped": 0, "seq": 0}
    # the holder gets the same query back (page reload), others do not
    assert env.client.get("/api/next?annotator=alice").get_json()["query_id"] == q1
    # prefetch: alice keeps q1 and also leases q3
    assert env.client.get(f"/api/next?annotator=alice&exclude={q1}").get_json()["query_id"] == q3
    assert env.client.get("/api/next?annotator=carol").get_json() == {"waiting": True}

    env.clock.t += 61  # every lease expired: the oldest goes to whoever asks
    assert env.client.get("/api/next?annotator=carol").get_json()["query_id"] == q1
    assert env.client.get("/api/next?annotator=alice").get_json()["query_id"] == q2
    con = sqlite3.connect(env.data_dir / "feedback.sqlite3")
    leases = dict(con.execute("SELECT id, lease_annotator FROM queries"))
    con.close()
    assert leases[q1] == "carol" and leases[q2] == "alice"

    assert env.label(q1, "left", "carol").status_code == 201
    progress = env.client.get(f"/api/next?annotator=alice&exclude={q2}").get_json()["progress"]
    assert progress == {"session_answered": 1, "session_total": 3, "total_labelled": 1, "total_skipped": 0, "seq": 1}


def test_next_waiting_run_filter_and_bad_params(env):
    assert env.client.get("/api/next?annotator=a").get_json() == {"waiting": True}
    run_a, run_b = env.run("a"), env.run("b")
    env.queries(run_a, prefix="a", n=1)
    (qb,) = env.queries(run_b, prefix="b", n=1)
    got = env.client.get(f"/api/next?annotator=x&run_id={run_b}").get_json()
    assert got["query_id"] == qb and got["run_id"] == run_b
    before = env.snap()
    assert_error(env.client.get("/api/next"), 400, "annotator", "missing")
    assert_error(env.client.get("/api/next?annotator=%20"), 400, "annotator")
    assert_error(env.client.get("/api/next?annotator=x&exclude=1,abc"), 400, "1,abc", "comma-separated")
    assert_error(env.client.get(f"/api/next?annotator=x&exclude={2**64}"), 400, "comma-separated")
    assert_error(env.client.get("/api/next?annotator=x&exclude=%C2%B2"), 400, "comma-separated")
    assert_error(env.client.get("/api/next?annotator=x&run_id=zz"), 400, "run_id='zz'")
    assert_error(env.client.get("/api/next?annotator=x&run_id=42"), 404, "Run 42")
    assert env.snap() == before


# ----------------------------------------------------------------------------- labels


def test_label_create_repeat_edit_and_other_annotator(env):
    run_id = env.run()
    q1, q2, _ = env.queries(run_id)
    first = env.label(q1, "left", "alice")
    assert first.status_code == 201
    body = first.get_json()
    label_id = body["label_id"]
    assert body["progress"] == {"session_answered": 1, "session_total": 3, "total_labelled": 1, "total_skipped": 0, "seq": 1}

    before = env.snap()
    repeat = env.label(q1, "left", "alice")
    assert repeat.status_code == 200 and repeat.get_json()["label_id"] == label_id
    assert env.snap() == before  # one row, nothing touched

    assert_error(env.label(q1, "right", "bob"), 409, f"Query {q1}", "another annotator")
    assert env.snap() == before

    edit = env.label(q1, "right", "alice")
    assert edit.status_code == 200 and edit.get_json()["label_id"] == label_id and edit.get_json()["updated"] is True
    con = sqlite3.connect(env.data_dir / "feedback.sqlite3")
    assert con.execute("SELECT id, choice, annotator FROM labels").fetchall() == [(label_id, "right", "alice")]
    con.close()
    assert env.status(run_id)["choices"]["right"] == 1 and env.status(run_id)["labelled"] == 1
    assert env.label(q2, "skip", "bob").status_code == 201
    assert env.status(run_id)["pending"] == 1


def test_label_conflicting_choice_is_409_without_editing(tmp_path):
    env = Env(tmp_path, allow_editing=False)
    run_id = env.run()
    (q1,) = env.queries(run_id, n=1)
    assert env.label(q1, "left").status_code == 201
    before = env.snap()
    assert_error(env.label(q1, "right"), 409, "'left'", "editing is disabled")
    assert env.label(q1, "left").status_code == 200
    assert env.snap() == before


@pytest.mark.parametrize(
    "flags, payload, status, fragments",
    [
        ({"allow_ties": False}, {"choice": "tie", "annotator": "a"}, 400, ["'tie'", "left, right, skip"]),
        ({"allow_skip": False}, {"choice": "skip", "annotator": "a"}, 400, ["'skip'", "left, right, tie"]),
        ({}, {"choice": "up", "annotator": "a"}, 400, ["'up'", "left, right, tie, skip"]),
        ({}, {"choice": None, "annotator": "a"}, 400, ["None"]),
        ({}, {"choice": "left"}, 400, ["annotator", "missing"]),
        ({}, {"choice": "left", "annotator": ""}, 400, ["annotator"]),
        ({}, {"choice": "left", "annotator": 7}, 400, ["annotator", "7"]),
        ({}, "{broken", 400, ["not valid JSON"]),
        ({}, '"left"', 400, ["JSON object"]),
    ],
)
def test_label_rejects_bad_input(tmp_path, flags, payload, status, fragments):
    env = Env(tmp_path, **flags)
    run_id = env.run()
    (q1,) = env.queries(run_id, n=1)
    before = env.snap()
    if isinstance(payload, str):
        resp = env.client.post(f"/api/queries/{q1}/label", data=payload, content_type="application/json")
    else:
        resp = env.client.post(f"/api/queries/{q1}/label", json=payload)
    assert_error(resp, status, *fragments)
    assert env.snap() == before


def test_label_and_undo_unknown_query_is_404(env):
    env.queries(env.run(), n=1)
    before = env.snap()
    assert_error(env.label(12345, "left"), 404, "Query 12345")
    assert_error(env.client.post("/api/queries/12345/undo", json={"annotator": "a"}), 404, "Query 12345")
    assert env.snap() == before


def test_undo_makes_query_pending_and_leaves_a_tombstone(env):
    run_id = env.run()
    q1, _, _ = env.queries(run_id)
    label_id = env.label(q1, "left", "alice").get_json()["label_id"]
    cursor = env.answers(run_id)["cursor"]

    before = env.snap()
    assert_error(env.client.post(f"/api/queries/{q1}/undo", json={"annotator": "bob"}), 409, "another annotator")
    assert_error(env.client.post(f"/api/queries/{q1}/undo", json={}), 400, "annotator")
    assert_error(env.client.post(f"/api/queries/{q1}/undo", data="{", content_type="application/json"), 400, "JSON")
    assert env.snap() == before

    resp = env.client.post(f"/api/queries/{q1}/undo", json={"annotator": "alice"})
    assert resp.status_code == 200
    body = resp.get_json()
    assert body["undone_label_id"] == label_id and body["query"]["query_id"] == q1
    assert env.status(run_id)["labelled"] == 0 and env.status(run_id)["pending"] == 3
    # the query is leased back to alice, so she sees it next; bob does not
    assert env.client.get("/api/next?annotator=bob").get_json()["query_id"] != q1
    assert env.client.get("/api/next?annotator=alice").get_json()["query_id"] == q1

    news = env.answers(run_id, after=cursor)
    assert [(a["label_id"], a["query_id"], a["choice"]) for a in news["answers"]] == [(label_id, q1, "undone")]
    before = env.snap()
    assert_error(env.client.post(f"/api/queries/{q1}/undo", json={"annotator": "alice"}), 409, "no label")
    assert env.snap() == before

    relabel = env.label(q1, "right", "alice")
    assert relabel.status_code == 201 and relabel.get_json()["label_id"] != label_id
    final = env.answers(run_id, after=news["cursor"])["answers"]
    assert [(a["query_id"], a["choice"]) for a in final] == [(q1, "right")]


def test_undo_is_forbidden_without_editing(tmp_path):
    env = Env(tmp_path, allow_editing=False)
    (q1,) = env.queries(env.run(), n=1)
    env.label(q1, "left")
    before = env.snap()
    assert_error(env.client.post(f"/api/queries/{q1}/undo", json={"annotator": "ann"}), 403, "--no-editing")
    assert env.snap() == before


# ----------------------------------------------------------------------------- answers cursor


def test_answers_cursor_redelivers_edits_and_never_deletes(env):
    run_id = env.run()
    q1, q2, q3 = env.queries(run_id, n=3, session="s1")
    l1 = env.label(q1, "left").get_json()["label_id"]
    l2 = env.label(q2, "tie").get_json()["label_id"]

    first = env.answers(run_id)
    assert [(a["label_id"], a["query_id"], a["choice"]) for a in first["answers"]] == [(l1, q1, "left"), (l2, q2, "tie")]
    a0 = first["answers"][0]
    assert (a0["left_segment_id"], a0["right_segment_id"], a0["session"], a0["annotator"]) == (0, 1, "s1", "ann")
    assert a0["created_at"] and a0["updated_at"] and a0["left_clip"] == "c0a.mp4"
    cursor = first["cursor"]
    assert cursor == max(a["seq"] for a in first["answers"])
    assert env.answers(run_id, after=cursor) == {"answers": [], "cursor": cursor}

    env.label(q1, "right")  # edit: re-delivered after the cursor with the same label_id
    l3 = env.label(q3, "skip").get_json()["label_id"]
    news = env.answers(run_id, after=cursor)
    assert [(a["label_id"], a["choice"]) for a in news["answers"]] == [(l1, "right"), (l3, "skip")]
    assert news["cursor"] > cursor

    # reading never deletes: from 0 the current state of every label, in sequence order
    full = env.answers(run_id)["answers"]
    assert [(a["label_id"], a["choice"]) for a in full] == [(l2, "tie"), (l1, "right"), (l3, "skip")]
    page = env.client.get(f"/api/runs/{run_id}/answers?after=0&limit=2").get_json()
    assert len(page["answers"]) == 2 and page["cursor"] == page["answers"][-1]["seq"]

    other = env.run("other")
    assert env.answers(other) == {"answers": [], "cursor": 0}
    for bad in ("-1", "x", "1.5", str(2**64)):
        assert_error(env.client.get(f"/api/runs/{run_id}/answers?after={bad}"), 400, f"after={bad!r}", "integer >= 0")
    assert_error(env.client.get(f"/api/runs/{run_id}/answers?limit=0"), 400, "limit")


# ----------------------------------------------------------------------------- evaluations


def eval_upload(client, run_id, items, files):
    return client.post(f"/api/runs/{run_id}/evaluations", data=form("evaluations", items, files), content_type="multipart/form-data")


def test_evaluations_sorted_by_predicted_return_and_idempotent(env):
    run_id = env.run()
    items = [{"clip": f"ev{i}.mp4", "predicted_return": r, "step": 1000 * i} for i, r in enumerate([1.5, 9.0, -2.0])]
    files = {it["clip"]: fake_mp4(it["clip"]) for it in items}
    resp = eval_upload(env.client, run_id, items, files)
    assert resp.status_code == 201 and len(resp.get_json()["evaluation_ids"]) == 3
    listed = env.client.get(f"/api/runs/{run_id}/evaluations").get_json()["evaluations"]
    assert [(e["clip"], e["predicted_return"], e["step"]) for e in listed] == [
        ("ev1.mp4", 9.0, 1000),
        ("ev0.mp4", 1.5, 0),
        ("ev2.mp4", -2.0, 2000),
    ]
    assert listed[0]["url"] == f"/clips/{run_id}/ev1.mp4"
    assert env.client.get(listed[0]["url"]).get_data() == files["ev1.mp4"]
    before = env.snap()
    again = eval_upload(env.client, run_id, items, files)
    assert again.status_code == 201 and again.get_json() == resp.get_json()
    assert env.snap() == before


@pytest.mark.parametrize(
    "item, files, status, fragments",
    [
        ({"clip": "e.mp4", "predicted_return": float("nan"), "step": 1}, None, 400, ["predicted_return", "finite"]),
        ({"clip": "e.mp4", "predicted_return": "high", "step": 1}, None, 400, ["'high'", "number"]),
        ({"clip": "e.mp4", "predicted_return": 1.0, "step": -5}, None, 400, ["step", "-5"]),
        ({"clip": "e.mp4", "predicted_return": 1.0, "step": True}, None, 400, ["step", "True"]),
        ({"clip": "../e.mp4", "predicted_return": 1.0, "step": 1}, {"../e.mp4": fake_mp4("e")}, 400, ["../e.mp4"]),
        ({"clip": "e.mp4", "predicted_return": 1.0, "step": 1}, {"e.mp4": b"plain text"}, 400, ["e.mp4", "ftyp"]),
        ({"clip": "e.mp4", "predicted_return": 1.0, "step": 1}, {}, 400, ["e.mp4", "not uploaded"]),
        ({"clip": "kept.mp4", "predicted_return": 3.0, "step": 1}, {"kept.mp4": fake_mp4("kept")}, 409, ["kept.mp4", "already has"]),
    ],
)
def test_evaluations_reject_bad_input(env, item, files, status, fragments):
    run_id = env.run()
    kept = [{"clip": "kept.mp4", "predicted_return": 2.0, "step": 1}]
    assert eval_upload(env.client, run_id, kept, {"kept.mp4": fake_mp4("kept")}).status_code == 201
    files = {"e.mp4": fake_mp4("e")} if files is None else files
    before = env.snap()
    assert_error(eval_upload(env.client, run_id, [item], files), status, *fragments)
    assert_error(eval_upload(env.client, 77, [item], files), 404, "Run 77")
    assert env.snap() == before


# ----------------------------------------------------------------------------- clips


def test_clips_are_served_only_from_the_data_dir(env, tmp_path):
    run_id = env.run()
    video = real_mp4(tmp_path / "v.mp4", 90)
    resp = upload(
        env.client, run_id, [{"left_clip": "v.mp4", "right_clip": "w.mp4", "left_segment_id": 1, "right_segment_id": 2, "session": 1}],
        {"v.mp4": video, "w.mp4": fake_mp4("w")},
    )  # fmt: skip
    assert resp.status_code == 201
    got = env.client.get(f"/clips/{run_id}/v.mp4")
    assert got.status_code == 200 and got.mimetype == "video/mp4" and got.get_data() == video
    ranged = env.client.get(f"/clips/{run_id}/v.mp4", headers={"Range": "bytes=0-99"})
    assert ranged.status_code == 206 and ranged.get_data() == video[:100]

    (env.data_dir / "secret.mp4").write_bytes(b"outside")
    for path in (
        f"/clips/{run_id}/../secret.mp4",
        f"/clips/{run_id}/..%2Fsecret.mp4",
        f"/clips/{run_id}/a/b.mp4",
        f"/clips/{run_id}/feedback.sqlite3",
    ):
        resp = env.client.get(path)
        assert resp.status_code in (400, 404), path
        assert b"outside" not in resp.get_data() and "error" in resp.get_json()
    assert_error(env.client.get(f"/clips/{run_id}/..%5Csecret.mp4"), 400, "'\\'")
    assert_error(env.client.get(f"/clips/{run_id}/missing.mp4"), 404)
    assert_error(env.client.get("/clips/999/v.mp4"), 404, "Run 999")


# ----------------------------------------------------------------------------- token


def test_token_or_session_is_required_everywhere_and_never_taken_from_the_address(tmp_path):
    env = Env(tmp_path, token="s3cret")
    good = {"X-Feedback-Token": "s3cret"}
    for path in ("/api/config", "/api/runs", "/api/next?annotator=a", "/clips/1/a.mp4", "/static/js/main.js"):
        assert_error(env.client.get(path), 401, "log in", "X-Feedback-Token")
        assert_error(env.client.get(path, headers={"X-Feedback-Token": "nope"}), 403, "wrong")
        assert_error(env.client.get(path + ("&" if "?" in path else "?") + "token=s3cret"), 401, "log in")  # never from a URL
    page = env.client.get("/?token=s3cret")  # a browser that is not logged in gets a page that says how to get in
    assert page.status_code == 401 and page.mimetype == "text/html" and "feedback_session" not in page.headers.get("Set-Cookie", "")
    assert "login link" in page.get_data(as_text=True) and '<form method="post" action="/login">' in page.get_data(as_text=True)
    before = env.snap()
    assert_error(env.client.post("/api/runs", json={"name": "r"}), 401, "log in")
    assert_error(env.client.post("/api/runs", json={"name": "r"}, headers={"X-Feedback-Token": "nope"}), 403, "wrong")
    assert env.snap() == before

    resp = env.client.post("/api/runs", json={"name": "r"}, headers=good)
    assert resp.status_code == 201
    run_id = resp.get_json()["run_id"]
    queries, files = batch("c", 1)
    assert_error(upload(env.client, run_id, queries, files), 401, "log in")
    assert upload(env.client, run_id, queries, files, headers=good).status_code == 201

    # a one-time login code becomes a session cookie, which opens the page, the clips and the API, and holds no token
    code_url = env.client.post("/api/login-codes", json={}, headers=good).get_json()["url"]
    assert re.fullmatch(r"/login\?code=[\w-]{20,}", code_url)
    browser = fs.create_app(env.data_dir, token="s3cret", clock=env.clock).test_client()
    logged_in = browser.get(code_url)
    assert logged_in.status_code == 200 and 'http-equiv="refresh"' in logged_in.get_data(as_text=True)
    cookie = browser.get_cookie("feedback_session_80")
    assert cookie is not None and cookie.http_only and cookie.same_site == "Strict" and "s3cret" not in cookie.value
    assert browser.get("/").status_code == 200
    assert browser.get(f"/clips/{run_id}/c0a.mp4").get_data() == files["c0a.mp4"]
    assert browser.get("/api/next?annotator=a").get_json()["query_id"] >= 1
    # the code is dead after its first use; a forged or foreign session cookie opens nothing
    again = fs.create_app(env.data_dir, token="s3cret", clock=env.clock).test_client()
    assert again.get(code_url).status_code == 403 and again.get_cookie("feedback_session_80") is None
    again.set_cookie("feedback_session_80", cookie.value.rsplit(".", 1)[0] + ".00")
    assert_error(again.get("/api/config"), 401, "log in")
    other_token = fs.create_app(env.data_dir / "other", token="other", clock=env.clock).test_client()
    other_token.set_cookie("feedback_session_80", cookie.value)
    assert_error(other_token.get("/api/config"), 401, "log in")
    # the login form takes the token itself (and a wrong one gets the page again)
    form = fs.create_app(env.data_dir, token="s3cret", clock=env.clock).test_client()
    assert form.post("/login", data={"token": "nope"}).status_code == 403
    assert form.post("/login", data={"token": "s3cret"}).status_code == 200 and form.get("/api/config").status_code == 200


def test_a_host_the_server_is_not_reached_by_is_refused(tmp_path):
    env = Env(tmp_path, host_names=("feedback.example.org",))
    for host in ("localhost:5001", "127.0.0.1:5001", "[::1]:5001", "10.1.2.3", "feedback.example.org", "FEEDBACK.example.org.:443"):
        assert env.client.get("/api/config", headers={"Host": host}).status_code == 200, host
    before = env.snap()
    for host in ("evil.example:5001", "localhost.evil.example", "127.0.0.1.evil.example", ""):
        assert_error(env.client.get("/api/config", headers={"Host": host}), 403, "--allowed-hosts")
        assert_error(env.client.post("/api/runs", json={"name": "r"}, headers={"Host": host}), 403, "--allowed-hosts")
    assert env.snap() == before


# ----------------------------------------------------------------------------- command line


def test_cli_defaults_and_data_dir_relative_to_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = fs.parse_args([])
    assert (args.host, args.port, args.playback_speed, args.lease_seconds, args.max_upload_mb) == ("127.0.0.1", 5001, 1.0, 60.0, 16.0)
    assert args.data_dir == tmp_path.resolve() / "feedback_data"
    assert (args.token, args.no_ties, args.no_skip, args.no_editing) == (None, False, False, False)
    assert (args.allowed_hosts, args.exit_with_parent) == ([], False)


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["--port", "70000"], ["'70000'", "1 to 65535"]),
        (["--port", "http"], ["'http'", "1 to 65535"]),
        (["--playback-speed", "0"], ["'0'", "> 0"]),
        (["--playback-speed", "-1"], ["'-1'", "> 0"]),
        (["--lease-seconds", "nan"], ["'nan'", "> 0"]),
        (["--max-upload-mb", "0"], ["'0'", "> 0"]),
        (["--token", ""], ["token", "non-empty"]),
        (["--threads", "0"], ["'0'", "1 to 256"]),
        (["--threads", "1.5"], ["'1.5'", "1 to 256"]),
        (["--threads", "many"], ["'many'", "1 to 256"]),
        (["--allowed-hosts", "http://x.org"], ["'http://x.org'", "without scheme or port"]),
        (["--allowed-hosts", "x.org:80"], ["'x.org:80'", "without scheme or port"]),
    ],
)
def test_cli_rejects_bad_values_with_one_line(argv, fragments, capsys):
    with pytest.raises(SystemExit) as exc:
        fs.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    for fragment in fragments:
        assert fragment in err


def test_cli_bad_value_in_a_real_process(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SERVER), "--port", "0", "--data-dir", str(tmp_path / "d")], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "'0'" in proc.stderr and "1 to 65535" in proc.stderr
    assert not (tmp_path / "d").exists()


def test_cli_threads_default_and_bad_threads_in_a_real_process(tmp_path):
    assert fs.parse_args(["--threads", "3"]).threads == 3 and fs.parse_args([]).threads == 8
    proc = subprocess.run(
        [sys.executable, str(SERVER), "--threads", "-2", "--data-dir", str(tmp_path / "d")], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "threads '-2'" in proc.stderr and "1 to 256" in proc.stderr
    assert not (tmp_path / "d").exists()


def start_on_a_terminal(data_dir: Path, port: int, *extra: str) -> tuple[subprocess.Popen, list[str]]:
    """The server started by hand: its stderr a terminal (a pty, read on until the server ends). Returns the process
    and the lines it printed before serving."""
    import pty
    import threading

    controller, terminal = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k != "FEEDBACK_SERVER_TOKEN"}
    proc = subprocess.Popen(
        [sys.executable, str(SERVER), "--port", str(port), "--data-dir", str(data_dir), *extra],
        stderr=terminal,
        stdout=subprocess.DEVNULL,
        env=env,
    )
    os.close(terminal)
    text, deadline = b"", time.monotonic() + 20
    while b"Log in: " not in text or not text.endswith(b"\n"):
        assert time.monotonic() < deadline and proc.poll() is None, text
        text += os.read(controller, 4096)

    def drain():  # the access log goes on to the terminal
        with contextlib.suppress(OSError):
            while os.read(controller, 4096):
                pass
        os.close(controller)

    threading.Thread(target=drain, daemon=True).start()
    return proc, text.decode().replace("\r\n", "\n").splitlines()


def test_a_server_started_by_hand_makes_a_token_keeps_it_and_prints_a_login_link(tmp_path):
    """No --token: the server makes one, keeps it in <data-dir>/token (mode 0600) for its restarts, says where it is,
    and prints a one-time login link on its terminal. It answers to the names it is reached by and --allowed-hosts."""
    requests = pytest.importorskip("requests")
    data_dir, port = tmp_path / "data", free_port()
    base = f"http://127.0.0.1:{port}"
    proc, lines = start_on_a_terminal(data_dir, port, "--allowed-hosts", "feedback.example.org")
    try:
        token = (data_dir / "token").read_text().strip()
        assert len(token) >= 32 and (data_dir / "token").stat().st_mode & 0o777 == 0o600
        assert lines[0] == f"Feedback server on {base}/; data in {data_dir}"
        assert lines[1] == f"Its token is in {data_dir / 'token'} (readable by you only): give it to a trainer as FEEDBACK_SERVER_TOKEN"
        assert re.fullmatch(rf"Log in: {base}/login\?code=[\w-]+ \(works once, within 15 min\)", lines[2]) and token not in lines[2]
        link = lines[2].split()[2]
        assert requests.get(base + "/api/config", timeout=5).status_code == 401
        browser = requests.Session()
        assert browser.get(link, timeout=5).status_code == 200 and browser.get(base + "/api/config", timeout=5).status_code == 200
        assert requests.get(link, timeout=5).status_code == 403
        good = {"X-Feedback-Token": token}
        for host, status in ((f"feedback.example.org:{port}", 200), (f"localhost:{port}", 200), (f"evil.example:{port}", 403)):
            assert requests.get(base + "/api/config", headers=good | {"Host": host}, timeout=5).status_code == status, host
    finally:
        proc.terminate()
        assert proc.wait(timeout=15) == 0
    proc, lines = start_on_a_terminal(data_dir, port)  # restarted: the same token, a new link
    try:
        assert (data_dir / "token").read_text().strip() == token
        assert requests.get(base + "/api/config", headers={"X-Feedback-Token": token}, timeout=5).status_code == 200
        assert browser.get(base + "/api/config", timeout=5).status_code == 200  # still logged in
        assert lines[2].split()[2] != link
    finally:
        proc.terminate()
        assert proc.wait(timeout=15) == 0


def test_cli_port_in_use_is_one_line_and_exit_1(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, str(SERVER), "--port", str(port), "--data-dir", str(tmp_path / "d")],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0 and f"127.0.0.1:{port}" in proc.stderr and "another --host or --port" in proc.stderr


# ----------------------------------------------------------------------------- real server process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(data_dir: Path, *extra: str):
    """A server process on data_dir, its address, and a requests session that sends its token (the one it made itself
    and keeps in <data-dir>/token, unless --token is among ``extra``)."""
    requests = pytest.importorskip("requests")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(SERVER), "--port", str(port), "--data-dir", str(data_dir), *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=data_dir.parent,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}: {proc.stderr.read().decode()}")
        try:
            requests.get(base + "/api/config", timeout=1)
        except requests.ConnectionError:
            time.sleep(0.1)
            continue
        http = requests.Session()
        http.headers["X-Feedback-Token"] = (
            extra[extra.index("--token") + 1] if "--token" in extra else (data_dir / "token").read_text().strip()
        )
        return proc, base, http
    proc.kill()
    raise AssertionError("server did not start within 20 s")


def test_real_server_survives_sigkill_without_losing_labels(tmp_path):
    data_dir = tmp_path / "data"
    proc, base, http = start_server(data_dir)
    try:
        run_id = http.post(base + "/api/runs", json={"name": "kill-test", "env_id": "Hopper-v5"}, timeout=5).json()["run_id"]
        queries, files = batch("k", 4)
        resp = http.post(
            f"{base}/api/runs/{run_id}/queries",
            data={"queries": json.dumps(queries)},
            files=[("clips", (name, content, "video/mp4")) for name, content in files.items()],
            timeout=10,
        )
        assert resp.status_code == 201
        ids = resp.json()["query_ids"]
        assert http.post(f"{base}/api/queries/{ids[0]}/label", json={"choice": "left", "annotator": "a"}, timeout=5).status_code == 201
        assert http.post(f"{base}/api/queries/{ids[1]}/label", json={"choice": "right", "annotator": "a"}, timeout=5).status_code == 201
        read = http.get(f"{base}/api/runs/{run_id}/answers", params={"after": 0}, timeout=5).json()
        assert [(x["query_id"], x["choice"]) for x in read["answers"]] == [(ids[0], "left"), (ids[1], "right")]
        cursor = read["cursor"]
        # acknowledged right before the kill: must survive too
        assert http.post(f"{base}/api/queries/{ids[2]}/label", json={"choice": "tie", "annotator": "b"}, timeout=5).status_code == 201
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL

    proc, base, http = start_server(data_dir)
    try:
        status = http.get(f"{base}/api/runs/{run_id}/status", timeout=5).json()
        assert (status["queries"], status["labelled"], status["pending"]) == (4, 3, 1)
        after = http.get(f"{base}/api/runs/{run_id}/answers", params={"after": cursor}, timeout=5).json()
        assert [(x["query_id"], x["choice"]) for x in after["answers"]] == [(ids[2], "tie")]
        pending = http.get(f"{base}/api/next", params={"annotator": "c"}, timeout=5).json()
        assert pending["query_id"] == ids[3]
        assert http.get(base + pending["left_url"], timeout=5).content == files["k3a.mp4"]
        assert http.post(f"{base}/api/queries/{ids[3]}/label", json={"choice": "skip", "annotator": "c"}, timeout=5).status_code == 201
        final = http.get(f"{base}/api/runs/{run_id}/answers", params={"after": after["cursor"]}, timeout=5).json()
        assert [(x["query_id"], x["choice"]) for x in final["answers"]] == [(ids[3], "skip")]
        assert final["cursor"] > after["cursor"] > cursor
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stderr.close()


def test_real_server_gives_each_query_to_one_annotator_under_concurrency(tmp_path):
    proc, base, http = start_server(tmp_path / "data", "--lease-seconds", "600")
    try:
        run_id = http.post(base + "/api/runs", json={"name": "concurrent"}, timeout=5).json()["run_id"]
        queries, files = batch("p", 6)
        resp = http.post(
            f"{base}/api/runs/{run_id}/queries",
            data={"queries": json.dumps(queries)},
            files=[("clips", (name, content, "video/mp4")) for name, content in files.items()],
            timeout=10,
        )
        ids = resp.json()["query_ids"]

        def ask(i):
            return http.get(f"{base}/api/next", params={"annotator": f"person{i}"}, timeout=10).json()

        with ThreadPoolExecutor(max_workers=8) as pool:
            got = list(pool.map(ask, range(8)))
        leased = [g["query_id"] for g in got if "query_id" in g]
        assert sorted(leased) == ids and sum(1 for g in got if g.get("waiting")) == 2
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stderr.close()


def stop_server(proc: subprocess.Popen) -> str:
    """SIGTERM, then what the server wrote to stderr; the server must exit 0."""
    proc.terminate()
    _, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err.decode()
    return err.decode()


def test_real_server_stops_cleanly_on_sigterm_and_logs_requests_without_the_token(tmp_path):
    requests = pytest.importorskip("requests")
    proc, base, http = start_server(tmp_path / "data", "--token", "s3cret", "--threads", "1")
    try:
        assert http.get(base + "/api/config", timeout=5).status_code == 200
        assert requests.get(base + "/api/runs", timeout=5).status_code == 401
        login = http.post(base + "/api/login-codes", json={}, timeout=5).json()["url"]
        assert requests.get(base + login, timeout=5).status_code == 200
    finally:
        err = stop_server(proc)
    assert err.startswith(f"Feedback server on {base}/; data in {tmp_path / 'data'}\n")
    assert not (tmp_path / "data" / "token").exists()  # a token given is never copied to a file
    assert '"GET /login HTTP/1.1" 200 -' in err and login.split("=", 1)[1] not in err  # nor is a login code logged
    assert '"GET /api/config HTTP/1.1" 200 -' in err and '"GET /api/runs HTTP/1.1" 401 -' in err
    assert "s3cret" not in err
    assert err.endswith("Feedback server stopped\n")


def test_real_server_answers_an_oversize_upload_with_the_json_413(tmp_path):
    proc, base, http = start_server(tmp_path / "data", "--max-upload-mb", "1")
    try:
        run_id = http.post(base + "/api/runs", json={"name": "big"}, timeout=5).json()["run_id"]
        queries, files = batch("big", 1)
        files["big0a.mp4"] = fake_mp4("big") + b"\x00" * (3 * 1024 * 1024)
        resp = http.post(
            f"{base}/api/runs/{run_id}/queries",
            data={"queries": json.dumps(queries)},
            files=[("clips", (name, content, "video/mp4")) for name, content in files.items()],
            timeout=30,
        )
        assert resp.status_code == 413 and "--max-upload-mb" in resp.json()["error"]
        assert http.get(f"{base}/api/runs/{run_id}/status", timeout=5).json()["queries"] == 0
    finally:
        stop_server(proc)


# The schema written by feedback_server.py before humanFeedback/schema.sql existed (commit 257de00),
# kept here verbatim: data dirs written by that server must keep working.
OLD_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL UNIQUE,
    env_id TEXT,
    created_at TEXT NOT NULL,
    meta TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS queries (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id INTEGER NOT NULL REFERENCES runs(id),
    session,
    left_clip TEXT NOT NULL,
    right_clip TEXT NOT NULL,
    left_segment_id,
    right_segment_id,
    created_at TEXT NOT NULL,
    lease_annotator TEXT,
    lease_expires REAL,
    UNIQUE (run_id, left_clip, right_clip)
);
CREATE TABLE IF NOT EXISTS labels (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    query_id INTEGER NOT NULL UNIQUE REFERENCES queries(id),
    choice TEXT NOT NULL CHECK (choice IN ('left', 'right', 'tie', 'skip')),
    annotator TEXT NOT NULL,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL,
    seq INTEGER NOT NULL UNIQUE
);
CREATE TABLE IF NOT EXISTS label_tombstones (
    seq INTEGER PRIMARY KEY,
    label_id INTEGER NOT NULL,
    query_id INTEGER NOT NULL REFERENCES queries(id),
    choice TEXT NOT NULL,
    annotator TEXT NOT NULL,
    created_at TEXT NOT NULL,
    deleted_at TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS evaluations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id INTEGER NOT NULL REFERENCES runs(id),
    clip TEXT NOT NULL,
    predicted_return REAL NOT NULL,
    step INTEGER NOT NULL,
    created_at TEXT NOT NULL,
    UNIQUE (run_id, clip)
);
CREATE TABLE IF NOT EXISTS sequence (
    name TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
INSERT OR IGNORE INTO sequence (name, value) VALUES ('label', 0);
CREATE INDEX IF NOT EXISTS queries_run ON queries (run_id, session);
CREATE INDEX IF NOT EXISTS tombstones_query ON label_tombstones (query_id);
"""


def write_old_data_dir(data_dir: Path) -> dict[str, bytes]:
    """A data dir as a server without the newer tables leaves it: three queries of run 1, one labelled 'left', one labelled
    'tie' and undone (a tombstone), one never labelled; one evaluation.  Returns the clips."""
    clips = {f"o{i}{side}.mp4": fake_mp4(f"o{i}{side}") for i in range(3) for side in "ab"}
    (data_dir / "clips" / "1").mkdir(parents=True)
    for name, content in clips.items():
        (data_dir / "clips" / "1" / name).write_bytes(content)
    t = "2025-01-01T00:00:00.000Z"
    con = sqlite3.connect(data_dir / "feedback.sqlite3")
    con.execute("PRAGMA journal_mode=WAL")
    con.executescript(OLD_SCHEMA)
    with con:
        con.execute("INSERT INTO runs VALUES (1, 'old-run', 'Hopper-v5', ?, '{\"seed\": 3}')", (t,))
        con.executemany(
            "INSERT INTO queries VALUES (?, 1, ?, ?, ?, ?, ?, ?, NULL, NULL)",
            [
                (1, "s1", "o0a.mp4", "o0b.mp4", 0, 1, t),
                (2, "s1", "o1a.mp4", "o1b.mp4", 10, 11, t),
                (3, 2, "o2a.mp4", "o2b.mp4", "g20", "g21", t),
            ],
        )
        con.execute("INSERT INTO labels VALUES (1, 1, 'left', 'ann', ?, ?, 1)", (t, t))
        con.execute("INSERT INTO label_tombstones VALUES (3, 2, 2, 'tie', 'ann', ?, ?)", (t, t))
        con.execute("UPDATE sequence SET value = 3 WHERE name = 'label'")
        con.execute("INSERT INTO evaluations VALUES (1, 1, 'o0a.mp4', 4.5, 1000, ?)", (t,))
    con.close()
    return clips


def test_real_server_opens_an_old_schema_database_and_serves_its_labels(tmp_path):
    data_dir = tmp_path / "data"
    clips = write_old_data_dir(data_dir)
    con = sqlite3.connect(data_dir / "feedback.sqlite3")
    old_tables = con.execute("SELECT name, sql FROM sqlite_master ORDER BY name").fetchall()
    con.close()

    proc, base, http = start_server(data_dir)
    try:
        runs = http.get(base + "/api/runs", timeout=5).json()["runs"]
        assert [(r["run_id"], r["name"], r["env_id"]) for r in runs] == [(1, "old-run", "Hopper-v5")]
        assert http.get(base + "/api/runs/1", timeout=5).json()["meta"] == {"seed": 3}
        status = http.get(base + "/api/runs/1/status", timeout=5).json()
        assert (status["queries"], status["labelled"], status["pending"], status["choices"]["left"]) == (3, 1, 2, 1)
        read = http.get(base + "/api/runs/1/answers", params={"after": 0}, timeout=5).json()
        got = [(a["seq"], a["query_id"], a["choice"], a["session"], a["left_segment_id"]) for a in read["answers"]]
        assert got == [(1, 1, "left", "s1", 0), (3, 2, "undone", "s1", 10)] and read["cursor"] == 3
        (evaluation,) = http.get(base + "/api/runs/1/evaluations", timeout=5).json()["evaluations"]
        assert (evaluation["clip"], evaluation["predicted_return"], evaluation["step"]) == ("o0a.mp4", 4.5, 1000)

        pending = http.get(base + "/api/next", params={"annotator": "new"}, timeout=5).json()
        assert pending["query_id"] == 2 and http.get(base + pending["right_url"], timeout=5).content == clips["o1b.mp4"]
        assert http.post(base + "/api/queries/3/label", json={"choice": "right", "annotator": "new"}, timeout=5).status_code == 201
        news = http.get(base + "/api/runs/1/answers", params={"after": 3}, timeout=5).json()["answers"]
        assert [(a["seq"], a["query_id"], a["choice"], a["session"], a["right_segment_id"]) for a in news] == [(4, 3, "right", 2, "g21")]
    finally:
        stop_server(proc)

    con = sqlite3.connect(data_dir / "feedback.sqlite3")
    now = con.execute("SELECT name, sql FROM sqlite_master ORDER BY name").fetchall()
    added = ("run_progress", "session_sizes", "sqlite_autoindex_session_sizes_1")  # the trainer's news
    added += ("invitations", "sqlite_autoindex_invitations_1")
    added += ("query_clips", "sqlite_autoindex_query_clips_1", "sqlite_autoindex_query_clips_2")  # rankings
    # its tables as they were, but for the kind of each evaluation clip (the old ones: reward checks), who holds a
    # lease or owns a label (the old ones: their annotator's name, as the token's are) and a ranking's answer
    grown = ("evaluations", "queries", "labels", "label_tombstones")
    assert [t for t in now if t[0] not in added and t[0] not in grown] == [t for t in old_tables if t[0] not in grown]
    assert con.execute("SELECT clip, kind FROM evaluations").fetchall() == [("o0a.mp4", "check")]
    assert con.execute("SELECT annotator, holder FROM labels ORDER BY id").fetchall() == [("ann", "token:ann"), ("new", "token:new")]
    con.close()


# ----------------------------------------------------------------------------- the trainer's news


def test_progress_report_declares_session_size_and_is_shown_while_waiting(env):
    run = env.run()
    url = f"/api/runs/{run}/progress"
    counts = {"trainer_seen_seconds": None, "pending": 0, "total_labelled": 0, "total_skipped": 0, "seq": 0}
    assert env.client.get(url).get_json() == {"run_id": run, "progress": None, **counts}
    resp = env.client.post(url, json={"step": 400, "phase": "labelling", "session": 1, "session_size": 5})
    assert resp.status_code == 200, resp.get_json()
    (q1, _) = env.queries(run, n=2)  # two of the five uploaded so far: the session still has five pairs
    lease = env.client.get("/api/next?annotator=ann").get_json()
    assert lease["query_id"] == q1 and lease["progress"] == {
        "session_answered": 0,
        "session_total": 5,
        "total_labelled": 0,
        "total_skipped": 0,
        "seq": 0,
    }
    assert (lease["run_name"], lease["instructions"], lease["clip_seconds"]) == ("run-a", None, None)
    assert env.label(q1, "left").get_json()["progress"] == {
        "session_answered": 1,
        "session_total": 5,
        "total_labelled": 1,
        "total_skipped": 0,
        "seq": 1,
    }

    env.clock.t += 30
    report = {"step": 900, "phase": "training", "total_steps": 10_000, "sessions_done": 1, "sessions_total": 3}
    report |= {"next_session_step": 1_400, "seconds_to_next_session": 12.5, "steps_per_second": 40.0}
    assert env.client.post(url, json=report).status_code == 200
    env.label(env.client.get("/api/next?annotator=ann").get_json()["query_id"], "right")
    waiting = env.client.get("/api/next?annotator=ann").get_json()
    (news,) = waiting["training"]
    assert waiting["waiting"] is True and news == {"run_id": run, "run_name": "run-a", **report, "age_seconds": 0.0, "stale": False}
    env.clock.t += 121
    assert env.client.get(url).get_json()["progress"]["stale"] is True  # the trainer has not reported for two minutes


def test_the_run_state_counts_labels_apart_from_skips_and_says_when_the_trainer_was_last_heard(env):
    run = env.run()
    q1, q2, q3 = env.queries(run, n=3)
    url = f"/api/runs/{run}/progress"
    assert env.label(q1, "left").status_code == 201 and env.label(q2, "skip").status_code == 201
    state = env.client.get(url).get_json()
    assert (state["total_labelled"], state["total_skipped"], state["pending"], state["trainer_seen_seconds"]) == (1, 1, 1, None)
    undone = env.client.post(f"/api/queries/{q1}/undo", json={"annotator": "ann"}).get_json()
    assert undone["undone_choice"] == "left"  # the page shows the person what they had answered
    assert undone["query"]["progress"] == {"session_answered": 1, "session_total": 3, "total_labelled": 0, "total_skipped": 1, "seq": 3}
    env.answers(run)  # the trainer reads answers: it is alive
    env.clock.t += 7
    state = env.client.get(url).get_json()
    assert (state["total_labelled"], state["pending"], state["trainer_seen_seconds"], state["seq"]) == (0, 2, 7.0, 3)
    report = {"step": 10, "phase": "training", "agreement": {"ann": 0.75, " bob ": 1}}
    assert env.client.post(url, json=report).status_code == 200
    state = env.client.get(url).get_json()
    assert state["progress"]["agreement"] == {"ann": 0.75, "bob": 1.0} and state["trainer_seen_seconds"] == 0.0


@pytest.mark.parametrize(
    "agreement, fragment",
    [
        ([0.5], "must be an object"),
        ({"ann": 1.5}, "share 1.5"),
        ({"ann": True}, "share True"),
        ({"": 0.5}, "annotator"),
        ({"a": "x"}, "'x'"),
    ],
)
def test_a_reported_agreement_is_a_share_per_annotator(env, agreement, fragment):
    run = env.run()
    before = env.snap()
    assert_error(env.client.post(f"/api/runs/{run}/progress", json={"step": 1, "phase": "training", "agreement": agreement}), 400, fragment)
    assert env.snap() == before


def test_the_latest_evaluation_is_the_newest_by_step_then_upload(env):
    run = env.run()
    items = [{"clip": "e1.mp4", "predicted_return": 9.0, "step": 100}, {"clip": "e2.mp4", "predicted_return": 1.0, "step": 300}]
    items.append({"clip": "e3.mp4", "predicted_return": 5.0, "step": 200})
    assert eval_upload(env.client, run, items, {i["clip"]: fake_mp4(i["clip"]) for i in items}).status_code == 201
    url = f"/api/runs/{run}/evaluations"
    assert [e["clip"] for e in env.client.get(url + "?latest=1").get_json()["evaluations"]] == ["e2.mp4"]
    later = [{"clip": "e4.mp4", "predicted_return": 0.0, "step": 300}]
    assert eval_upload(env.client, run, later, {"e4.mp4": fake_mp4("e4")}).status_code == 201
    assert [e["clip"] for e in env.client.get(url + "?latest=1").get_json()["evaluations"]] == ["e4.mp4"]
    assert [e["clip"] for e in env.client.get(url).get_json()["evaluations"]] == ["e1.mp4", "e3.mp4", "e2.mp4", "e4.mp4"]
    assert_error(env.client.get(url + "?latest=2"), 400, "latest='2'")


def test_the_agents_evaluation_clips_are_the_latest_and_stay_out_of_the_reward_view(env):
    """The trainer uploads two kinds of clip: reward checks (ranked in the reward view) and the start of an evaluation
    episode (kind agent: what the agent does now, shown beside the pairs). The newest agent clip is the latest even
    when a reward check of a later step came after it; an unknown kind is refused and nothing is stored."""
    run = env.run()
    items = [
        {"clip": "c1.mp4", "predicted_return": 3.0, "step": 100},
        {"clip": "a1.mp4", "predicted_return": 50.0, "step": 200, "kind": "agent"},
    ]
    items.append({"clip": "c2.mp4", "predicted_return": 1.0, "step": 300, "kind": "check"})
    assert eval_upload(env.client, run, items, {i["clip"]: fake_mp4(i["clip"]) for i in items}).status_code == 201
    url = f"/api/runs/{run}/evaluations"
    (latest,) = env.client.get(url + "?latest=1").get_json()["evaluations"]
    assert (latest["clip"], latest["kind"], latest["step"]) == ("a1.mp4", "agent", 200)
    assert [e["clip"] for e in env.client.get(url).get_json()["evaluations"]] == ["c1.mp4", "c2.mp4"]
    before = env.snap()
    bad = [{"clip": "x.mp4", "predicted_return": 1.0, "step": 5, "kind": "movie"}]
    assert_error(eval_upload(env.client, run, bad, {"x.mp4": fake_mp4("x")}), 400, "kind", "'movie'", "check, agent")
    assert env.snap() == before


def test_run_meta_gives_the_page_its_instructions_and_clip_length(env):
    resp = env.client.post("/api/runs", json={"name": "r", "meta": {"instructions": "Which one hops further?", "clip_seconds": 0.4}})
    run = resp.get_json()["run_id"]
    env.queries(run, n=1)
    lease = env.client.get("/api/next?annotator=ann").get_json()
    assert (lease["instructions"], lease["clip_seconds"]) == ("Which one hops further?", 0.4)


@pytest.mark.parametrize(
    "body, fragments",
    [
        ({"phase": "training"}, ["'step' is missing"]),
        ({"step": -1, "phase": "training"}, ["'step' is -1", "from 0"]),
        ({"step": True, "phase": "training"}, ["'step' is True"]),
        ({"step": 2**63, "phase": "training"}, ["'step'"]),
        ({"step": 1, "phase": "sleeping"}, ["'phase' is 'sleeping'", "training, labelling"]),
        ({"step": 1, "phase": "training", "session_size": 3}, ["'session_size' needs field 'session'"]),
        ({"step": 1, "phase": "training", "session": 1.5, "session_size": 3}, ["session", "1.5"]),
        ({"step": 1, "phase": "training", "seconds_to_next_session": -3}, ["'seconds_to_next_session' is -3"]),
        ({"step": 1, "phase": "training", "eta": 3}, ["Unknown field(s) eta"]),
    ],
)
def test_progress_report_rejects_bad_input_and_changes_nothing(env, body, fragments):
    run = env.run()
    before = env.snap()
    assert_error(env.client.post(f"/api/runs/{run}/progress", json=body), 400, *fragments)
    assert env.snap() == before


def test_progress_report_of_unknown_run_and_non_json_body(env):
    assert_error(env.client.post("/api/runs/7/progress", json={"step": 1, "phase": "training"}), 404, "Run 7")
    run = env.run()
    resp = env.client.post(f"/api/runs/{run}/progress", data='{"step": 1, "phase": "training"}', content_type="text/plain")
    assert_error(resp, 415, "application/json")
