"""Ratings through the feedback server: the trainer uploads clips to rate with their scale, a person rates each clip
(the server stores the ratings in the order shown), edits or undoes them, and the trainer's answers carry the latest;
every answer that is not one rating on the scale per clip, or of another kind, is a 400 with a reason and stores
nothing. Flask's test client on a real SQLite data dir; then a human-mode run of ratings answered over HTTP,
corrections included."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import numpy as np
import pytest
import torch
from test_feedback_rankings import HttpPerson, rank, small_human_args, upload_rankings
from test_feedback_server import Env, assert_error, fake_mp4, upload, write_old_data_dir
from test_human_feedback import free_port
from test_labels_toolbox import labels_tool

import sac_rlhf
from cleanrlhf_utils.feedback import answer_label
from cleanrlhf_utils.ratings import rating_labels

requests = pytest.importorskip("requests")


def rating_batch(prefix: str, clips: int, scale: int = 5, n: int = 1, session=1) -> tuple[list[dict], dict[str, bytes]]:
    queries = [
        {
            "clips": [f"{prefix}{i}_{k}.mp4" for k in range(clips)],
            "segment_ids": [100 * i + k for k in range(clips)],
            "session": session,
            "rating_scale": scale,
        }
        for i in range(n)
    ]
    return queries, {name: fake_mp4(name) for q in queries for name in q["clips"]}


def upload_ratings(env: Env, run_id: int, prefix: str = "t", clips: int = 2, scale: int = 5) -> list[int]:
    resp = upload(env.client, run_id, *rating_batch(prefix, clips, scale))
    assert resp.status_code == 201, resp.get_json()
    return resp.get_json()["query_ids"]


def rate(env: Env, query_id: int, ratings, annotator: str = "ann"):
    return env.client.post(f"/api/queries/{query_id}/label", json={"ratings": ratings, "annotator": annotator})


@pytest.fixture
def env(tmp_path):
    return Env(tmp_path)


def test_ratings_are_served_answered_edited_and_undone_and_read_back_latest(env):
    run = env.run()
    (rated,) = upload_ratings(env, run, clips=2, scale=5)
    lease = env.client.get("/api/next?annotator=ann").get_json()
    assert (lease["query_id"], lease["kind"], lease["rating_scale"]) == (rated, "rating", 5)
    assert lease["clip_urls"] == [f"/clips/{run}/t0_{k}.mp4" for k in range(2)]

    first = rate(env, rated, [2, 5])
    assert first.status_code == 201 and first.get_json()["ratings"] == [2, 5]
    assert rate(env, rated, [2, 5]).get_json()["updated"] is False  # the same ratings again: stored once
    edited = rate(env, rated, [1, 4])
    assert edited.status_code == 200 and edited.get_json()["updated"] is True
    read = env.answers(run)["answers"]
    assert [(a["choice"], a["ratings"], a["ranking"]) for a in read] == [("rated", [1, 4], None)]
    assert answer_label(read[0], 5) == rating_labels(np.array([[0, 3]]), 5)[0] == 15

    undone = env.client.post(f"/api/queries/{rated}/undo", json={"annotator": "ann"}).get_json()
    assert (undone["undone_choice"], undone["undone_ratings"]) == ("rated", [1, 4])
    assert undone["query"]["kind"] == "rating" and undone["query"]["rating_scale"] == 5
    assert rate(env, rated, [5, 5]).status_code == 201  # two clips may share a rating
    read = env.answers(run)["answers"]
    assert [(a["choice"], a["ratings"]) for a in read] == [("undone", None), ("rated", [5, 5])]
    assert env.status(run)["choices"]["rated"] == 1 and env.status(run)["labelled"] == 1
    (skipped,) = upload_ratings(env, run, prefix="s")  # a skip is a rating query's other answer
    assert env.label(skipped, "skip").status_code == 201


BAD_ANSWERS = {
    "a clip unrated": ({"ratings": [3]}, "1 ratings given; rate each of the 3 clips once"),
    "a clip rated twice": ({"ratings": [3, 3, 3, 3]}, "4 ratings given"),
    "above the scale": ({"ratings": [1, 2, 6]}, "ratings [6] are off the scale; rate each clip from 1 (worst) to 5 (best)"),
    "zero": ({"ratings": [0, 2, 3]}, "ratings [0] are off the scale"),
    "a rating that is not an integer": ({"ratings": [1, 2.5, 3]}, "ratings are a list of integers, one per clip"),
    "text": ({"ratings": "1,2,3"}, "ratings are a list of integers"),
    "a ranking": ({"ranking": [0, 1, 2]}, "asks for ratings of its 3 clips, not a ranking"),
    "a pair's choice": ({"choice": "left"}, "asks for ratings of its 3 clips or the choice skip, not the choice 'left'"),
    "a skip and ratings at once": ({"choice": "skip", "ratings": [1, 2, 3]}, "asks for ratings of its 3 clips or the choice skip"),
    "neither": ({}, "ratings are a list of integers"),
}


@pytest.mark.parametrize("body, reason", BAD_ANSWERS.values(), ids=BAD_ANSWERS.keys())
def test_an_answer_that_is_no_rating_of_each_clip_is_refused_and_nothing_stored(env, body, reason):
    run = env.run()
    (rated,) = upload_ratings(env, run, clips=3)
    env.client.get("/api/next?annotator=ann")
    before = env.snap()
    assert_error(env.client.post(f"/api/queries/{rated}/label", json=body | {"annotator": "ann"}), 400, reason)
    assert env.snap() == before
    assert rate(env, rated, [1, 5, 3]).status_code == 201  # nor is a stored answer changed by one
    before = env.snap()
    assert_error(env.client.post(f"/api/queries/{rated}/label", json=body | {"annotator": "ann"}), 400, reason)
    assert env.snap() == before


def test_ratings_to_a_pair_or_a_ranking_are_refused_and_nothing_stored(env):
    run = env.run()
    (pair,) = env.queries(run, n=1)
    (ranked,) = upload_rankings(env, run)
    env.client.get("/api/next?annotator=ann")
    env.client.get(f"/api/next?annotator=ann&exclude={pair}")
    before = env.snap()
    assert_error(rate(env, pair, [1, 2]), 400, f"Query {pair} is a pair: answer it with a choice, not a rating")
    assert_error(rate(env, ranked, [1, 2, 3]), 400, f"Query {ranked} asks for a ranking of its 3 clips, not ratings")
    assert env.snap() == before


BAD_UPLOADS = {
    "one clip": (lambda q: q | {"clips": q["clips"][:1], "segment_ids": q["segment_ids"][:1]}, "a list of 2 to 6 clip names to rate"),
    "a scale of one point": (lambda q: q | {"rating_scale": 1}, "rating_scale is 1; it must be an integer from 2 to 10"),
    "a scale of eleven": (lambda q: q | {"rating_scale": 11}, "rating_scale is 11"),
    "a scale that is no integer": (lambda q: q | {"rating_scale": "5"}, "rating_scale is '5'"),
}


@pytest.mark.parametrize("change, reason", BAD_UPLOADS.values(), ids=BAD_UPLOADS.keys())
def test_a_rating_upload_with_a_bad_scale_or_too_few_clips_is_refused_and_nothing_stored(env, change, reason):
    run = env.run()
    (query,), _ = rating_batch("u", 2)
    query = change(query)
    before = env.snap()
    assert_error(upload(env.client, run, [query], {name: fake_mp4(name) for name in query["clips"]}), 400, reason)
    assert env.snap() == before


def test_a_data_dir_from_before_ratings_takes_ratings_and_keeps_its_answers(tmp_path):
    write_old_data_dir(tmp_path / "data")
    env = Env(tmp_path)
    kept = env.answers(1)["answers"]
    (rated,) = upload_ratings(env, 1)
    (ranked,) = upload_rankings(env, 1)
    assert rate(env, rated, [4, 1]).status_code == 201 and rank(env, ranked, [2, 1, 0]).status_code == 201
    assert env.client.post(f"/api/queries/{rated}/undo", json={"annotator": "ann"}).status_code == 200
    news = env.answers(1, after=kept[-1]["seq"])["answers"]
    assert [(a["query_id"], a["choice"]) for a in news] == [(ranked, "ranked"), (rated, "undone")]
    assert env.answers(1)["answers"][:2] == kept


# ----------------------------------------------------------------------------- a human-mode run of ratings


class RatingPerson(HttpPerson):
    """Rates every query over HTTP on a scale of 4; before answering session 2, changes its mind on session 1's first
    two (an edit, and an undo answered again differently), as a person at the page would."""

    def __init__(self, base: str):
        super().__init__(base, "rater")
        self.given: dict[int, list[int]] = {}  # query id -> the ratings on the server now
        self.corrected = False

    def rate(self, query_id: int, ratings: list[int]) -> None:
        self.post(f"/api/queries/{query_id}/label", {"ratings": ratings})
        self.given[query_id] = ratings

    def answer(self, query: dict) -> None:
        assert (query["kind"], query["rating_scale"], len(query["clip_urls"])) == ("rating", 4, 2)
        if query["session"] == 2 and not self.corrected:
            first, second = sorted(self.given)[:2]
            self.rate(first, [5 - r for r in self.given[first]])  # edited
            self.post(f"/api/queries/{second}/undo", {}, (200,))
            self.given.pop(second)
            self.rate(second, [4, 4])  # undone, then answered anew
            self.corrected = True
        qid = query["query_id"]
        self.rate(qid, [1 + qid % 4, 1 + (qid // 4) % 4])


def test_human_mode_rates_clips_over_http_and_learns_the_latest_ratings(chdir_tmp):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    person = RatingPerson(base)
    person.start()
    args = small_human_args("rated", base, rating_scale=4)
    try:
        summary = sac_rlhf.main(args)
    finally:
        person.stop.set()
    person.join(timeout=10)
    assert person.failure is None and person.corrected
    assert sorted(person.given) == list(range(1, 7)) and summary["labels_obtained"] == 6

    expected = {query: float(rating_labels(np.array([ratings]) - 1, 4)[0]) for query, ratings in person.given.items()}
    with sqlite3.connect("runs/rated/labels.sqlite") as db:
        logged = dict(db.execute("SELECT query_id, label FROM labels"))
        scales = {row[0] for row in db.execute("SELECT rating_scale FROM labels")}
    assert logged == expected and scales == {4}
    checkpoint = torch.load("models/rated/latest/checkpoint.pt", weights_only=False)
    assert sorted(checkpoint["preference_buffer"]["labels"].tolist()) == sorted(expected.values())
    assert checkpoint["reward_model"]["rating_cut_parameters"].shape == (3, 3)
    shown = [json.loads(line) for line in open("runs/rated/shown_pairs.jsonl").read().splitlines()]
    assert [len(line["segment_ids"]) for line in shown] == [2] * 6
    assert labels_tool.check(Path("runs/rated")) == []  # the run keeps each rating as its server has it
    (served,) = labels_tool.main(["list", "runs/rated/feedback_data"])  # the server's ratings as the pairs they decide
    assert served["labels"] == 6 and served["annotators"]["rater"]["tie"] == sum(a == b for a, b in person.given.values())
