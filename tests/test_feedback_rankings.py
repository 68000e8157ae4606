"""Rankings of k clips through the feedback server: the trainer uploads a query of k clips, a person orders them
(the server stores the order, best first), edits or undoes it, and the trainer's answers carry the latest order; every
answer that is not an order of the query's clips, or of the wrong kind, is a 400 with a reason and stores nothing.
Flask's test client on a real SQLite data dir (tests/test_feedback_ranking_page.py does it in a real browser); then
a human-mode run of rankings of three clips answered over HTTP, corrections included."""

from __future__ import annotations

import itertools
import json
import sqlite3
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_end_to_end import small_args
from test_feedback_server import Env, assert_error, batch, fake_mp4, form, upload, write_old_data_dir
from test_human_feedback import free_port, run_token
from test_labels_toolbox import labels_tool

import sac_rlhf
from cleanrlhf_utils.feedback import answer_label
from cleanrlhf_utils.rankings import order_labels

requests = pytest.importorskip("requests")


def ranking_batch(prefix: str, clips: int, n: int = 1, session=1) -> tuple[list[dict], dict[str, bytes]]:
    queries = [
        {"clips": [f"{prefix}{i}_{k}.mp4" for k in range(clips)], "segment_ids": [100 * i + k for k in range(clips)], "session": session}
        for i in range(n)
    ]
    return queries, {name: fake_mp4(name) for q in queries for name in q["clips"]}


def upload_rankings(env: Env, run_id: int, prefix: str = "r", clips: int = 3, n: int = 1) -> list[int]:
    resp = upload(env.client, run_id, *ranking_batch(prefix, clips, n))
    assert resp.status_code == 201, resp.get_json()
    return resp.get_json()["query_ids"]


def rank(env: Env, query_id: int, order, annotator: str = "ann"):
    return env.client.post(f"/api/queries/{query_id}/label", json={"ranking": order, "annotator": annotator})


@pytest.fixture
def env(tmp_path):
    return Env(tmp_path)


def test_a_ranking_is_served_with_every_clip_answered_edited_and_undone_and_read_back_latest(env):
    run = env.run()
    (ranked,) = upload_rankings(env, run, clips=4)
    lease = env.client.get("/api/next?annotator=ann").get_json()
    assert lease["query_id"] == ranked and lease["kind"] == "ranking"
    assert lease["clip_urls"] == [f"/clips/{run}/r0_{k}.mp4" for k in range(4)]
    assert env.client.get(lease["clip_urls"][3]).data == fake_mp4("r0_3.mp4")

    first = rank(env, ranked, [2, 0, 3, 1])
    assert first.status_code == 201 and first.get_json()["ranking"] == [2, 0, 3, 1]
    assert rank(env, ranked, [2, 0, 3, 1]).get_json()["updated"] is False  # the same order again: stored once
    edited = rank(env, ranked, [3, 2, 1, 0])
    assert edited.status_code == 200 and edited.get_json()["updated"] is True
    read = env.answers(run)["answers"]
    assert [(a["choice"], a["ranking"]) for a in read] == [("ranked", [3, 2, 1, 0])]
    assert answer_label(read[0]) == order_labels(np.array([[3, 2, 1, 0]]))[0] == 23  # the last of the 4! orders

    undone = env.client.post(f"/api/queries/{ranked}/undo", json={"annotator": "ann"}).get_json()
    assert (undone["undone_choice"], undone["undone_ranking"]) == ("ranked", [3, 2, 1, 0])
    assert undone["query"]["kind"] == "ranking" and len(undone["query"]["clip_urls"]) == 4
    assert rank(env, ranked, [0, 1, 2, 3]).status_code == 201
    read = env.answers(run)["answers"]
    assert [(a["choice"], a["ranking"]) for a in read] == [("undone", None), ("ranked", [0, 1, 2, 3])]
    assert env.status(run)["choices"]["ranked"] == 1 and env.status(run)["labelled"] == 1

    # a skip is a ranking query's other answer
    (skipped,) = upload_rankings(env, run, prefix="s")
    assert env.label(skipped, "skip").status_code == 201
    assert env.answers(run, after=read[-1]["seq"])["answers"][0]["choice"] == "skip"


BAD_ANSWERS = {
    "a clip twice": ({"ranking": [0, 0, 1]}, "clips [0] appear more than once"),
    "a clip left out": ({"ranking": [2, 0]}, "clips [1] are missing"),
    "a position past the last clip": ({"ranking": [0, 1, 3]}, "positions [3] are not clips of this query"),
    "a negative position": ({"ranking": [-1, 0, 1]}, "positions [-1] are not clips"),
    "positions that are not integers": ({"ranking": ["0", 1, 2]}, "a ranking is a list of clip positions"),
    "an order that is not a list": ({"ranking": "0,1,2"}, "a ranking is a list of clip positions"),
    "a pair's choice": ({"choice": "left"}, "asks for a ranking of its 3 clips or the choice skip"),
    "a tie": ({"choice": "tie"}, "asks for a ranking of its 3 clips"),
    "a choice and a ranking at once": ({"choice": "skip", "ranking": [0, 1, 2]}, "asks for a ranking of its 3 clips"),
    "neither": ({}, "a ranking is a list of clip positions"),
}


@pytest.mark.parametrize("body, reason", BAD_ANSWERS.values(), ids=BAD_ANSWERS.keys())
def test_an_answer_that_is_no_order_of_the_querys_clips_is_refused_and_nothing_stored(env, body, reason):
    run = env.run()
    (ranked,) = upload_rankings(env, run)
    env.client.get("/api/next?annotator=ann")
    before = env.snap()
    resp = env.client.post(f"/api/queries/{ranked}/label", json=body | {"annotator": "ann"})
    assert_error(resp, 400, reason)
    assert env.snap() == before
    # nor is a stored answer changed by one
    assert rank(env, ranked, [1, 2, 0]).status_code == 201
    before = env.snap()
    assert_error(env.client.post(f"/api/queries/{ranked}/label", json=body | {"annotator": "ann"}), 400, reason)
    assert env.snap() == before


def test_a_ranking_to_a_pair_is_refused_and_nothing_stored(env):
    run = env.run()
    (pair, _) = env.queries(run, n=2)
    env.client.get("/api/next?annotator=ann")
    before = env.snap()
    assert_error(rank(env, pair, [1, 0]), 400, f"Query {pair} is a pair: answer it with a choice, not a ranking")
    assert_error(
        env.client.post(f"/api/queries/{pair}/label", json={"choice": "left", "ranking": [0, 1], "annotator": "ann"}), 400, "is a pair"
    )
    assert env.snap() == before


BAD_UPLOADS = {
    "two clips": (lambda q: q | {"clips": q["clips"][:2], "segment_ids": q["segment_ids"][:2]}, "must be a list of 3 to 6 clip names"),
    "seven clips": (lambda q: q | {"clips": [f"x{k}.mp4" for k in range(7)], "segment_ids": list(range(7))}, "3 to 6"),
    "a clip twice": (lambda q: q | {"clips": [q["clips"][0], *q["clips"][:2]]}, "names a clip twice"),
    "a segment id short": (lambda q: q | {"segment_ids": q["segment_ids"][:2]}, "one segment id per clip (3)"),
    "a pair's keys besides": (lambda q: q | {"left_clip": q["clips"][0]}, "has unknown keys left_clip"),
}


@pytest.mark.parametrize("change, reason", BAD_UPLOADS.values(), ids=BAD_UPLOADS.keys())
def test_a_ranking_upload_that_is_no_set_of_distinct_clips_is_refused_and_nothing_stored(env, change, reason):
    run = env.run()
    (query,), files = ranking_batch("u", 3)
    query = change(query)
    files = {name: fake_mp4(name) for name in query["clips"]}
    before = env.snap()
    assert_error(upload(env.client, run, [query], files), 400, reason)
    assert env.snap() == before


def test_a_data_dir_from_before_rankings_takes_rankings_and_keeps_its_answers(tmp_path):
    """A server of this version on an older data dir: its labels and tombstones are kept, and a ranking is stored,
    undone (a tombstone) and read back."""
    data_dir = tmp_path / "data"
    write_old_data_dir(data_dir)
    env = Env(tmp_path)
    kept = env.answers(1)["answers"]
    assert [(a["query_id"], a["choice"]) for a in kept] == [(1, "left"), (2, "undone")]
    (ranked,) = upload_rankings(env, 1)
    assert rank(env, ranked, [1, 0, 2]).status_code == 201
    assert env.client.post(f"/api/queries/{ranked}/undo", json={"annotator": "ann"}).status_code == 200
    news = env.answers(1, after=kept[-1]["seq"])["answers"]
    assert [(a["query_id"], a["choice"]) for a in news] == [(ranked, "undone")]
    assert env.answers(1)["answers"][:2] == kept


def test_pairs_and_rankings_in_one_batch_are_stored_as_sent(env):
    run = env.run()
    pairs, pair_files = batch("p", 1)
    rankings, ranking_files = ranking_batch("k", 5)
    resp = env.client.post(
        f"/api/runs/{run}/queries", data=form("queries", pairs + rankings, pair_files | ranking_files), content_type="multipart/form-data"
    )
    assert resp.status_code == 201, resp.get_json()
    # the same batch again is the same queries (a resumed trainer re-sends it); other clips under a stored name are not
    again = env.client.post(
        f"/api/runs/{run}/queries", data=form("queries", pairs + rankings, pair_files | ranking_files), content_type="multipart/form-data"
    )
    assert again.get_json()["query_ids"] == resp.get_json()["query_ids"]
    changed = [rankings[0] | {"segment_ids": [9, 8, 7, 6, 5]}]
    before = env.snap()
    assert_error(upload(env.client, run, changed, ranking_files), 409, "already exists")
    assert env.snap() == before
    first = env.client.get("/api/next?annotator=ann").get_json()
    second = env.client.get(f"/api/next?annotator=ann&exclude={first['query_id']}").get_json()
    assert [(first["kind"], len(first["clip_urls"])), (second["kind"], len(second["clip_urls"]))] == [("pair", 2), ("ranking", 5)]


# ----------------------------------------------------------------------------- a human-mode run of rankings

ORDERS = [list(order) for order in itertools.permutations(range(3))]


class HttpPerson(threading.Thread):
    """A person answering a human-mode run over HTTP with the run's token, until stopped: each query /api/next hands
    out goes to `answer`, and `look` runs after every ask (to look at the check view, say). What fails is kept in
    `failure` for the test to report."""

    def __init__(self, base: str, annotator: str):
        super().__init__(daemon=True)
        self.base, self.annotator = base, annotator
        self.http, self.stop, self.failure = requests.Session(), threading.Event(), None

    def post(self, path: str, body: dict, expected: tuple[int, ...] = (200, 201)) -> dict:
        reply = self.http.post(self.base + path, json=body | {"annotator": self.annotator}, timeout=5)
        assert reply.status_code in expected, reply.text
        return reply.json()

    def answer(self, query: dict) -> None:
        raise NotImplementedError

    def look(self) -> None:
        """After every ask, answered or not."""

    def run(self):
        try:
            while not self.stop.is_set():
                try:
                    if "X-Feedback-Token" not in self.http.headers:
                        if run_token() is None:  # the trainer has not made its token yet
                            raise requests.ConnectionError
                        self.http.headers["X-Feedback-Token"] = run_token()
                    query = self.http.get(f"{self.base}/api/next", params={"annotator": self.annotator}, timeout=5).json()
                    if not query.get("waiting"):
                        self.answer(query)
                    self.look()
                except requests.ConnectionError:  # the trainer has not started the server yet
                    pass
                time.sleep(0.05)
        except BaseException as error:  # noqa: BLE001 (reported by the test)
            self.failure = error


class RankingPerson(HttpPerson):
    """Ranks every query of session 1 over HTTP; before answering session 2, changes its mind on session 1's first two
    (an edit, and an undo answered again differently), as a person at the page would."""

    def __init__(self, base: str):
        super().__init__(base, "ranker")
        self.given: dict[int, list[int]] = {}  # query id -> the order on the server now
        self.corrected = False

    def rank(self, query_id: int, order: list[int]) -> None:
        self.post(f"/api/queries/{query_id}/label", {"ranking": order})
        self.given[query_id] = order

    def answer(self, query: dict) -> None:
        assert query["kind"] == "ranking" and len(query["clip_urls"]) == 3
        if query["session"] == 2 and not self.corrected:
            first, second = sorted(self.given)[:2]
            self.rank(first, ORDERS[(ORDERS.index(self.given[first]) + 1) % 6])  # edited
            self.post(f"/api/queries/{second}/undo", {}, (200,))
            self.given.pop(second)
            self.rank(second, ORDERS[5])  # undone, then answered anew
            self.corrected = True
        self.rank(query["query_id"], ORDERS[query["query_id"] % 6])


def small_human_args(run_name: str, base: str, **overrides) -> sac_rlhf.Args:
    """A short human-mode PEBBLE run on a server it starts at `base`: sessions of 3 queries at 200 and 400 steps, 10-step
    segments, small clips, no reward-check clips (unless overridden)."""
    settings = dict(
        total_timesteps=500,
        learning_starts=200,
        total_explore_steps=200,
        teacher_feedback_frequency=200,
        teacher_feedback_mode="human",
        feedback_server_url=base,
        feedback_server_autostart=True,
        feedback_check_clips=0,
        teacher_feedback_total_queries=6,
        teacher_feedback_num_queries_per_session=3,
        segment_length=10,
        max_augmentation_offset=3,
        min_augmentation_offset=1,
        clip_width=64,
        clip_height=48,
    )
    return small_args(run_name, **settings | overrides)


def test_human_mode_ranks_three_clips_over_http_and_learns_the_latest_rankings(chdir_tmp):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    person = RankingPerson(base)
    person.start()
    args = small_human_args("ranked", base, clips_per_query=3)
    try:
        summary = sac_rlhf.main(args)
    finally:
        person.stop.set()
    person.join(timeout=10)
    assert person.failure is None and person.corrected
    assert sorted(person.given) == list(range(1, 7)) and summary["labels_obtained"] == 6

    expected = {query: float(order_labels(np.array([order]))[0]) for query, order in person.given.items()}
    with sqlite3.connect("runs/ranked/labels.sqlite") as db:
        logged = dict(db.execute("SELECT query_id, label FROM labels"))
        shapes = {json.loads(row[0])["masks"][0][0] for row in db.execute("SELECT shapes FROM labels")}
    assert logged == expected and shapes == {3}
    prefs = torch.load("models/ranked/latest/checkpoint.pt", weights_only=False)["preference_buffer"]
    assert prefs["masks"].shape[1:] == (3, 10)
    assert sorted(prefs["labels"].tolist()) == sorted(expected.values())
    shown = [json.loads(line) for line in Path("runs/ranked/shown_pairs.jsonl").read_text().splitlines()]
    assert [len(line["segment_ids"]) for line in shown] == [3] * 6
    assert labels_tool.check(Path("runs/ranked")) == []  # the run keeps each ranking as its server has it
