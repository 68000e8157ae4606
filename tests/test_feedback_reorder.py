"""Reordering the reward-model check: the trainer uploads the check's clips also as a query to reorder (check_step),
which no one is leased from /api/next and the check view offers instead; a person's order of them is a ranking like
any other, and the trainer learns it as every set of --clips-per-query of the clips in the order the person gave them.
Flask's test client on a real SQLite data dir, then a human-mode run whose person reorders every check over HTTP,
undoes one reorder and edits another (tests/test_feedback_reorder_page.py does it in a real browser)."""

from __future__ import annotations

import itertools
import json
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from test_feedback_rankings import HttpPerson, small_human_args
from test_feedback_server import Env, assert_error, fake_mp4, upload
from test_human_feedback import free_port
from test_labels_toolbox import labels_tool

import sac_rlhf
from cleanrlhf_utils.feedback import reorder_label
from cleanrlhf_utils.rankings import order_labels

requests = pytest.importorskip("requests")


def check_batch(env: Env, run_id: int, step: int, clips: int = 4) -> tuple[list[str], int]:
    """The check's clips as the trainer uploads them: evaluation clips, then the same files as a query to reorder."""
    names = [f"run{run_id}_check_{step}_{i}.mp4" for i in range(clips)]
    files = {name: fake_mp4(name) for name in names}
    entries = [{"clip": name, "predicted_return": float(i), "step": step, "kind": "check"} for i, name in enumerate(names)]
    resp = env.client.post(
        f"/api/runs/{run_id}/evaluations",
        data={"evaluations": json.dumps(entries), "clips": [(__import__("io").BytesIO(data), name) for name, data in files.items()]},
        content_type="multipart/form-data",
    )
    assert resp.status_code == 201, resp.get_json()
    query = {"clips": names, "segment_ids": [10 * step + i for i in range(clips)], "session": f"check-{step}", "check_step": step}
    resp = upload(env.client, run_id, [query], files)
    assert resp.status_code == 201, resp.get_json()
    return names, resp.get_json()["query_ids"][0]


@pytest.fixture
def env(tmp_path):
    return Env(tmp_path)


def test_the_checks_clips_are_offered_for_reordering_never_leased_and_answered_as_a_ranking(env):
    run = env.run()
    (pair,) = env.queries(run, n=1)
    check_batch(env, run, step=1000)
    names, check = check_batch(env, run, step=2000)
    offered = env.client.get(f"/api/runs/{run}/evaluations").get_json()["reorder"]
    assert (offered["query_id"], offered["kind"], offered["check_step"]) == (check, "ranking", 2000)  # the newest check
    assert offered["clip_urls"] == [f"/clips/{run}/{name}" for name in names]
    # the pair is leased, the checks are not (nor counted as waiting)
    assert env.client.get("/api/next?annotator=ann").get_json()["query_id"] == pair
    assert env.client.get(f"/api/next?annotator=ann&exclude={pair}").get_json() == {"waiting": True}
    assert env.status(run)["pending"] == 1 and env.client.get(f"/api/runs/{run}/progress").get_json()["pending"] == 1

    reply = env.client.post(f"/api/queries/{check}/label", json={"ranking": [3, 1, 0, 2], "annotator": "ann"})
    assert reply.status_code == 201, reply.get_json()
    (answer,) = [a for a in env.answers(run)["answers"] if a["query_id"] == check]
    assert (answer["choice"], answer["ranking"], answer["session"]) == ("ranked", [3, 1, 0, 2], "check-2000")
    undone = env.client.post(f"/api/queries/{check}/undo", json={"annotator": "ann"}).get_json()
    assert undone["query"]["check_step"] == 2000 and undone["query"]["lease_expires"] is None  # back, not leased
    assert env.client.get(f"/api/next?annotator=ann&exclude={pair}").get_json() == {"waiting": True}


def test_a_check_query_that_is_rated_or_has_a_bad_step_is_refused_and_nothing_stored(env):
    run = env.run()
    names = [f"x{i}.mp4" for i in range(3)]
    files = {name: fake_mp4(name) for name in names}
    base = {"clips": names, "segment_ids": [1, 2, 3], "session": "check-5"}
    before = env.snap()
    assert_error(upload(env.client, run, [base | {"check_step": -1}], files), 400, "check_step is -1")
    assert_error(upload(env.client, run, [base | {"check_step": "5"}], files), 400, "check_step is '5'")
    assert_error(upload(env.client, run, [base | {"check_step": 5, "rating_scale": 5}], files), 400, "reordered, not rated")
    assert env.snap() == before


def test_a_reorder_gives_each_set_of_clips_the_order_the_person_gave_it():
    answer = {"choice": "ranked", "ranking": [3, 1, 0, 2], "annotator": "ann"}
    # pairs (i, j), i < j, shown in that order: 1 where clip j is placed above clip i
    assert [reorder_label(answer, pair) for pair in itertools.combinations(range(4), 2)] == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    # a set of three: the order within it, (3, 1, 2) as positions 2, 0, 1 of (1, 2, 3)
    assert reorder_label(answer, (1, 2, 3)) == order_labels(np.array([[2, 0, 1]]))[0]
    assert reorder_label({"choice": "right", "annotator": "ann"}, (0, 1)) == 1.0  # a check of two clips is a pair
    assert np.isnan(reorder_label({"choice": "skip", "annotator": "ann"}, (0, 1)))


# ----------------------------------------------------------------------------- a human-mode run with reorders


class ReorderingPerson(HttpPerson):
    """Answers every pair 'left' and reverses the model's order of every new check (best first: the clip the model
    rates lowest first); once three checks are reordered, undoes the first reorder and gives the second another order."""

    def __init__(self, base: str):
        super().__init__(base, "orderer")
        self.reordered: dict[int, list[int]] = {}  # check query id -> the order on the server now
        self.steps: dict[int, int] = {}  # check query id -> its check step
        self.corrected = False

    def answer(self, query: dict) -> None:
        self.post(f"/api/queries/{query['query_id']}/label", {"choice": "left"})

    def look(self) -> None:
        checks = self.http.get(f"{self.base}/api/runs/1/evaluations", timeout=5)
        offered = checks.json()["reorder"] if checks.status_code == 200 else None  # 404 until the run exists
        if offered and offered["query_id"] not in self.steps:
            order = list(range(len(offered["clip_urls"])))[::-1]
            self.post(f"/api/queries/{offered['query_id']}/label", {"ranking": order})
            self.reordered[offered["query_id"]], self.steps[offered["query_id"]] = order, offered["check_step"]
        if len(self.steps) >= 3 and not self.corrected:
            first, second = sorted(self.steps)[:2]
            self.post(f"/api/queries/{first}/undo", {})
            del self.reordered[first]
            self.reordered[second] = [1, 0, 2]
            self.post(f"/api/queries/{second}/label", {"ranking": [1, 0, 2]})
            self.corrected = True


def test_human_mode_learns_a_persons_reorders_of_the_check_as_the_pairs_they_decide(chdir_tmp):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    person = ReorderingPerson(base)
    person.start()
    args = small_human_args(
        "reordered", base, total_timesteps=1000, feedback_check_clips=3, teacher_feedback_total_queries=8,
        teacher_feedback_num_queries_per_session=2,
    )  # fmt: skip
    try:
        summary = sac_rlhf.main(args)
    finally:
        person.stop.set()
    person.join(timeout=10)
    assert person.failure is None and person.corrected

    # Each reorder the run read before its end: the 3 pairs of its 3 clips, labelled by the person's order within them;
    # the undone reorder has none.
    with sqlite3.connect("runs/reordered/labels.sqlite") as db:
        rows = db.execute("SELECT query_id, session, label FROM labels WHERE session < 0 ORDER BY id").fetchall()
    learned: dict[int, list[float]] = {}
    for query_id, session, label in rows:
        assert session == -person.steps[query_id]
        learned.setdefault(query_id, []).append(label)
    assert learned and set(learned) <= set(person.reordered)
    for query_id, labels in learned.items():
        answer = {"choice": "ranked", "ranking": person.reordered[query_id]}
        assert labels == [reorder_label(answer, pair) for pair in itertools.combinations(range(3), 2)], query_id
    assert sorted(person.steps)[0] not in learned
    assert summary["labels_obtained"] == 8 + 3 * len(learned)  # the sessions' pairs, and the reorders' on top
    assert labels_tool.check(Path("runs/reordered")) == []
