"""Roles and leases on the feedback server, with a careless or greedy crowd, on a real server on a real port: the trainer
(its token, or its own login link) runs the server's business; a person logged in by an invitation sees pairs and
answers them, nothing else; invitations are listed, expire in minutes unless used, and are revoked; a browser holds at
most the cap of pairs whatever names it gives and however it labels and undoes, and answers only pairs leased to it."""

from __future__ import annotations

import json
import sqlite3

import pytest
from test_feedback_hardening import Server, assert_json_error, fake_mp4
from test_feedback_server import Env, batch, upload

from cleanrlhf_utils import protocol
from humanFeedback import access, feedback_server

requests = pytest.importorskip("requests", reason="requests is missing (pip install requests)")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("roles"))
    try:
        yield s
    finally:
        s.stop()


def invited(s: Server, name: str = "guest") -> requests.Session:
    """A browser logged in by an invitation the trainer made."""
    resp = s.post(protocol.INVITATIONS, json={"name": name})
    assert resp.status_code == 201 and resp.json()["role"] == "annotator", resp.text
    browser = requests.Session()
    assert browser.get(s.base + resp.json()["url"], timeout=5).status_code == 200
    return browser


def test_an_invitees_session_gets_403_on_every_trainer_route_and_may_label(server):
    run_id = server.run("roles")
    query_ids = server.upload(run_id, "roles", 3)
    guest = invited(server)
    upload = {"files": [("clips", ("x.mp4", fake_mp4("x"), "video/mp4"))]}
    queries = {
        "queries": json.dumps([{"left_clip": "x.mp4", "right_clip": "y.mp4", "left_segment_id": 1, "right_segment_id": 2, "session": 9}])
    }
    evaluations = {"evaluations": json.dumps([{"clip": "x.mp4", "predicted_return": 1.0, "step": 1}])}
    trainer_routes = [
        ("POST", protocol.RUNS, {"json": {"name": "taken-over"}}),
        ("GET", protocol.path(protocol.RUN, run_id=run_id), {}),
        ("GET", protocol.path(protocol.RUN_STATUS, run_id=run_id), {}),
        ("POST", protocol.path(protocol.RUN_QUERIES, run_id=run_id), {"data": queries, **upload}),
        ("POST", protocol.path(protocol.RUN_EVALUATIONS, run_id=run_id), {"data": evaluations, **upload}),
        ("POST", protocol.path(protocol.RUN_PROGRESS, run_id=run_id), {"json": {"step": 1, "phase": "finished"}}),
        ("GET", protocol.path(protocol.RUN_ANSWERS, run_id=run_id) + "?after=0", {}),
        ("POST", protocol.LOGIN_CODES, {"json": {}}),
        ("POST", protocol.INVITATIONS, {"json": {"name": "friend"}}),
        ("GET", protocol.INVITATIONS, {}),
        ("POST", protocol.path(protocol.INVITATION_REVOKE, invitation_id=1), {"json": {}}),
    ]
    routes = feedback_server.create_app(server.data_dir.parent / "probe").url_map.bind("localhost")
    assert {routes.match(path.split("?")[0], method)[0] for method, path, _ in trainer_routes} == set(access.TRAINER_ENDPOINTS)
    before = server.rows() | {"invitations": None}
    for method, path, kwargs in trainer_routes:
        resp = guest.request(method, server.base + path, timeout=10, **kwargs)
        assert_json_error(resp, 403, "the trainer's", "answers them")
    assert server.rows() | {"invitations": None} == before  # nothing created, uploaded, reported or revoked

    # what a person needs: the page, its config (role annotator), runs, pairs, labels, undo, clips, the run's news
    assert guest.get(server.base + "/", timeout=5).status_code == 200
    assert guest.get(server.base + protocol.CONFIG, timeout=5).json()["role"] == "annotator"
    assert run_id in [r["run_id"] for r in guest.get(server.base + protocol.RUNS, timeout=5).json()["runs"]]
    pair = guest.get(server.base + protocol.NEXT_QUERY, params={"annotator": "guest", "run_id": run_id}, timeout=5).json()
    assert pair["query_id"] == query_ids[0] and guest.get(server.base + pair["left_url"], timeout=5).content[4:8] == b"ftyp"
    label = protocol.path(protocol.QUERY_LABEL, query_id=pair["query_id"])
    assert guest.post(server.base + label, json={"choice": "left", "annotator": "guest"}, timeout=5).status_code == 201
    undo = protocol.path(protocol.QUERY_UNDO, query_id=pair["query_id"])
    assert guest.post(server.base + undo, json={"annotator": "guest"}, timeout=5).status_code == 200
    assert guest.get(server.base + protocol.path(protocol.RUN_PROGRESS, run_id=run_id), timeout=5).status_code == 200
    assert guest.get(server.base + protocol.path(protocol.RUN_EVALUATIONS, run_id=run_id) + "?latest=1", timeout=5).status_code == 200
    # the trainer's own login link is a trainer's browser
    trainer = requests.Session()
    assert trainer.get(server.login_link(), timeout=5).status_code == 200
    assert trainer.get(server.base + protocol.CONFIG, timeout=5).json()["role"] == "trainer"
    assert trainer.get(server.base + protocol.INVITATIONS, timeout=5).status_code == 200


def test_invitations_are_listed_expire_in_minutes_unless_used_and_are_revoked(tmp_path):
    env = Env(tmp_path, token="s3cret")
    trainer = {"X-Feedback-Token": "s3cret"}
    run_id = env.client.post(protocol.RUNS, json={"name": "inv"}, headers=trainer).get_json()["run_id"]

    def invite(name):
        return env.client.post(protocol.INVITATIONS, json={"name": name}, headers=trainer).get_json()

    made = [invite("ann"), invite("bob")]
    assert [m["expires_seconds"] for m in made] == [access.LOGIN_CODE_SECONDS] * 2 and access.LOGIN_CODE_SECONDS == 15 * 60

    def browser():
        return feedback_server.create_app(env.data_dir, token="s3cret", clock=env.clock).test_client()

    ann = browser()
    assert ann.get(made[0]["url"]).status_code == 200  # used in time: ann is in for as long as a session lasts
    env.clock.t += access.LOGIN_CODE_SECONDS + 1
    late = browser()
    assert late.get(made[1]["url"]).status_code == 403 and late.get(protocol.CONFIG).status_code == 401  # bob's expired
    env.clock.t += 7 * 24 * 3600
    assert ann.get(protocol.CONFIG).get_json()["role"] == "annotator"
    made.append(invite("cy"))

    def states():
        listed = env.client.get(protocol.INVITATIONS, headers=trainer).get_json()["invitations"]
        return {i["name"]: i["state"] for i in listed}

    assert states() == {"ann": "in use", "bob": "expired", "cy": "waiting"}
    queries, files = batch("inv", 2)
    assert upload(env.client, run_id, queries, files, headers=trainer).status_code == 201
    held = ann.get(protocol.NEXT_QUERY + "?annotator=ann").get_json()["query_id"]
    for invitation in (made[0], made[2]):
        resp = env.client.post(
            protocol.path(protocol.INVITATION_REVOKE, invitation_id=invitation["invitation_id"]), json={}, headers=trainer
        )
        assert resp.get_json() == {"invitation_id": invitation["invitation_id"], "state": "revoked"}
    assert states() == {"ann": "revoked", "bob": "expired", "cy": "revoked"}
    # ann's app learns of the revocation when it starts (one server process keeps it in memory as it revokes)
    assert browser().get(made[2]["url"]).status_code == 403  # cy's link is dead
    revoked_browser = feedback_server.create_app(env.data_dir, token="s3cret", clock=env.clock).test_client()
    revoked_browser.set_cookie("feedback_session_80", ann.get_cookie("feedback_session_80").value)
    assert revoked_browser.get(protocol.CONFIG).status_code == 401
    # the pair ann held is free for someone else at once
    other = env.client.get(protocol.NEXT_QUERY + "?annotator=other", headers=trainer).get_json()
    assert other["query_id"] == held


def test_a_revoked_invitation_logs_its_browser_out_of_the_running_server(server):
    guest = invited(server, "short-lived")
    assert guest.get(server.base + protocol.CONFIG, timeout=5).status_code == 200
    listed = server.get(protocol.INVITATIONS).json()["invitations"]
    (mine,) = [i for i in listed if i["name"] == "short-lived"]
    assert mine["state"] == "in use" and mine["role"] == "annotator"
    assert server.post(protocol.path(protocol.INVITATION_REVOKE, invitation_id=mine["invitation_id"]), json={}).status_code == 200
    assert_json_error(guest.get(server.base + protocol.CONFIG, timeout=5), 401, "log in")
    assert guest.get(server.base + "/", timeout=5).status_code == 401  # the page says how to get in


def test_one_session_holds_at_most_the_cap_whatever_names_it_gives_or_however_it_labels_and_undoes(tmp_path):
    s = Server(tmp_path, "--lease-seconds", "600")
    try:
        run_id = s.run("greedy")
        ids = s.upload(run_id, "g", 20)
        cap = feedback_server.MAX_LEASES_PER_ANNOTATOR
        greedy, honest = invited(s, "greedy"), invited(s, "honest")
        next_url, held = s.base + protocol.NEXT_QUERY, []
        for i in range(20):  # a new name for every pair
            resp = greedy.get(next_url, params={"annotator": f"name{i}", "run_id": run_id, "exclude": ",".join(map(str, held))}, timeout=5)
            if resp.status_code == 200:
                held.append(resp.json()["query_id"])
        assert held == ids[:cap], held
        assert honest.get(next_url, params={"annotator": "honest"}, timeout=5).json()["query_id"] == ids[cap]

        def label(query_id, name="greedy", choice="left"):
            path = s.base + protocol.path(protocol.QUERY_LABEL, query_id=query_id)
            return greedy.post(path, json={"choice": choice, "annotator": name}, timeout=5)

        def undo(query_id, release=()):
            path = s.base + protocol.path(protocol.QUERY_UNDO, query_id=query_id)
            return greedy.post(path, json={"annotator": "any", "release": list(release)}, timeout=5)

        # pairs never leased to it, free or someone else's, are not its to answer
        assert_json_error(label(ids[10]), 409, "not leased to you")
        assert_json_error(label(ids[cap]), 409, "shown to another annotator")
        # label what it holds, take three more, then undo: never more than the cap at once
        for query_id in held:
            assert label(query_id, "whoever").status_code == 201
        more = []
        for _ in range(cap):
            params = {"annotator": "x", "run_id": run_id, "exclude": ",".join(map(str, more))}
            more.append(greedy.get(next_url, params=params, timeout=5).json()["query_id"])
        assert len(set(more)) == cap
        for query_id in held:
            assert_json_error(undo(query_id), 429, "the most one person may hold")
        assert undo(held[0], release=[more[0]]).status_code == 200  # the undone pair takes the place of one it gives up
        undone = undo(held[1])
        assert undone.status_code == 429
        with sqlite3.connect(s.data_dir / "feedback.sqlite3") as con:
            leases = con.execute("SELECT id, lease_holder FROM queries").fetchall()
        holders = {}
        for query_id, holder in leases:
            holders.setdefault(holder, []).append(query_id)
        assert max(len(v) for k, v in holders.items() if k is not None) <= cap, holders
        # another name of the same browser is the same person: it undoes and edits its own answers
        edited = label(held[2], "another name", "right")
        assert edited.status_code == 200 and edited.json()["updated"]
        assert (
            honest.post(s.base + protocol.path(protocol.QUERY_UNDO, query_id=held[2]), json={"annotator": "whoever"}, timeout=5).status_code
            == 409
        )
    finally:
        s.stop()
