"""A person's every click counts: an answer changed on the server (edited, undone, undone and answered again) reaches
the trainer, whose next reward update trains on the latest answer, and at the run's end the trainer's label log agrees
with the server's answers (toolbox/labels.py check). Real components: the training scripts' main, the feedback server
each starts on a free port, a person posting over HTTP from a thread."""

import _thread
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_end_to_end import scalars
from test_feedback_resume import human_args
from test_human_feedback import free_port, run_token
from test_pref_ppo import hopper_args

import pref_ppo
import sac_rlhf
from cleanrlhf_utils.feedback import CHOICE_LABELS, FeedbackSession, read_label_file

requests = pytest.importorskip("requests")
REPO = Path(__file__).resolve().parents[1]


class Person(threading.Thread):
    """Follows `script(person)` on the run's server as a person at the page would; should a step of it fail, the
    trainer (the main thread) is interrupted, so that the test ends with the failure instead of waiting for answers."""

    def __init__(self, base: str, script):
        super().__init__(daemon=True)
        self.base, self.script, self.http, self.failure = base, script, requests.Session(), None
        self.choices: dict[int, str] = {}  # query id -> the answer on the server now (None: undone)

    def run(self):
        try:
            self.script(self)
        except BaseException as error:  # noqa: BLE001 (reported by the test)
            self.failure = error
            _thread.interrupt_main()

    def wait_for_pair(self, session: int | None = None, exclude=(), timeout: float = 300) -> dict:
        """The next pair the server gives this person (of `session`, when given)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if "X-Feedback-Token" not in self.http.headers:
                    if run_token() is None:  # the trainer has not started its server yet
                        raise requests.ConnectionError
                    self.http.headers["X-Feedback-Token"] = run_token()
                params = {"annotator": "ann"} | ({"exclude": ",".join(map(str, exclude))} if exclude else {})
                query = self.http.get(f"{self.base}/api/next", params=params, timeout=5).json()
            except requests.ConnectionError:
                time.sleep(0.05)
                continue
            if not query.get("waiting") and (session is None or str(query["session"]) == str(session)):
                return query
            time.sleep(0.05)
        raise TimeoutError(f"no pair of session {session} within {timeout} s")

    def label(self, query_id: int, choice: str) -> dict:
        reply = self.http.post(f"{self.base}/api/queries/{query_id}/label", json={"choice": choice, "annotator": "ann"}, timeout=5)
        assert reply.status_code in (200, 201), reply.text
        self.choices[query_id] = choice
        return reply.json()

    def undo(self, query_id: int) -> dict:
        reply = self.http.post(f"{self.base}/api/queries/{query_id}/undo", json={"annotator": "ann"}, timeout=5)
        assert reply.status_code == 200, reply.text
        self.choices[query_id] = None
        return reply.json()


@pytest.fixture(autouse=True)
def ctrl_c_raises_keyboard_interrupt():
    """The person's failure interrupts the trainer as Ctrl-C does (a shell may start the suite with SIGINT ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def recording_reward_training(script, first_update_waits_for: threading.Event | None = None):
    """The script's reward training, given to its main, that first notes the preference buffer's labels it trains on.
    Returns (labels at each update, the training, an event set when the first update starts); that update waits for
    `first_update_waits_for` when given (a person changing answers the trainer has just read)."""
    seen, started = [], threading.Event()

    def reward_training(reward_model, optimizer, prefs, *args, **kwargs):
        seen.append(prefs.labels.copy())
        if len(seen) == 1 and first_update_waits_for is not None:
            started.set()
            assert first_update_waits_for.wait(timeout=120), "the person did not change their answers"
        return script.train_reward_model(reward_model, optimizer, prefs, *args, **kwargs)

    return seen, reward_training, started


def run_with(person: Person, main, args, reward_training):
    person.start()
    try:
        summary = main(args, reward_training=reward_training)
    except KeyboardInterrupt:
        if person.failure is not None:
            raise person.failure from None
        raise
    person.join(timeout=30)
    assert person.failure is None, person.failure
    return summary


def server_choices(run_dir: Path) -> dict[int, str | None]:
    """query id -> the answer the run's (autostarted) server keeps now, None where there is none."""
    import sqlite3

    with sqlite3.connect(run_dir / "feedback_data" / "feedback.sqlite3") as db:
        return dict(db.execute("SELECT q.id, l.choice FROM queries q LEFT JOIN labels l ON l.query_id = q.id"))


def labels_check(run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "toolbox" / "labels.py"), "check", str(run_dir)], capture_output=True, text=True)


def assert_run_keeps_the_servers_answers(run_dir: Path, checkpoint: dict, person: Person) -> None:
    """The trainer's preference buffer and label log hold exactly the labels the server has now, and labels.py check
    says so."""
    served = server_choices(run_dir)
    assert {q: c for q, c in served.items() if c is not None} == {q: c for q, c in person.choices.items() if c is not None}
    wanted = sorted(CHOICE_LABELS[c] for c in served.values() if c is not None and c != "skip")
    assert sorted(checkpoint["preference_buffer"]["labels"]) == wanted
    _, logged = read_label_file(run_dir / "labels.sqlite")
    assert sorted(logged) == wanted
    done = labels_check(run_dir)
    assert done.returncode == 0 and "the run keeps every label as the server has it" in done.stdout, done.stdout + done.stderr


def test_sync_an_undo_after_the_session_was_read_is_learned_at_the_next_update(chdir_tmp, capsys):
    """Sync mode: the trainer has read session 1 and learned from it when the person undoes its last answer and
    answers the other way, and undoes another without answering again. The next reward update trains on the new answer
    and without the undone one; the run logs 2 corrections with session 2 and ends agreeing with the server."""
    base = f"http://127.0.0.1:{free_port()}"
    first, later = ["left", "right", "left", "right"], ["right", "tie", "left", "right"]
    seen, reward_training, _ = recording_reward_training(sac_rlhf)

    def script(person: Person):
        session_1 = []
        for choice in first:
            query = person.wait_for_pair(1)
            person.label(query["query_id"], choice)
            session_1.append(query["query_id"])
        person.wait_for_pair(2)  # session 1 is read and learned from: session 2 is up
        assert person.undo(session_1[1])["learned"] == "yes"  # taken back, not answered again
        reply = person.undo(session_1[3])
        assert reply["learned"] == "yes" and reply["undone_choice"] == "right"
        person.label(session_1[3], "left")  # the other way
        for choice in later:
            person.label(person.wait_for_pair(2, exclude=[session_1[1]])["query_id"], choice)

    person = Person(base, script)
    args = human_args("sync", base, teacher_feedback_total_queries=8, teacher_feedback_num_queries_per_session=4)
    summary = run_with(person, sac_rlhf.main, args, reward_training)

    value = {choice: CHOICE_LABELS[choice] for choice in ("left", "right", "tie")}
    assert len(seen) == 2
    np.testing.assert_array_equal(seen[0], [value[c] for c in first])
    # session 1 without its undone pair, its last pair answered the other way, then session 2
    np.testing.assert_array_equal(seen[1], [value["left"], value["left"], value["left"], *(value[c] for c in later)])
    assert summary["labels_obtained"] == 7
    assert [v for _, v in scalars(Path("runs/sync"))["feedback/corrections"]] == [0, 2]
    assert "labels: the run keeps 7 labels, each as the feedback server has it" in capsys.readouterr().out
    checkpoint = torch.load("models/sync/latest/checkpoint.pt", weights_only=False)
    assert_run_keeps_the_servers_answers(Path("runs/sync"), checkpoint, person)


def test_async_edits_inside_and_after_a_session_reach_the_last_update(chdir_tmp, capsys):
    """PrefPPO with --feedback-async: inside the open session the person undoes an answer and gives the other one,
    and edits another; once the trainer has learned from the session they edit a third and undo a fourth. The last
    reward update trains on every latest answer, and the run ends agreeing with the server."""
    base = f"http://127.0.0.1:{free_port()}"
    later = ["right", "left", "tie", "left"]
    changed = threading.Event()
    seen, reward_training, read = recording_reward_training(pref_ppo, first_update_waits_for=changed)

    def script(person: Person):
        session_1 = [person.wait_for_pair(1)["query_id"]]
        person.label(session_1[0], "left")
        assert person.undo(session_1[0])["learned"] == "yes"
        person.label(session_1[0], "right")  # undone and answered the other way
        session_1.append(person.wait_for_pair(1)["query_id"])
        person.label(session_1[1], "left")
        assert person.label(session_1[1], "right")["updated"]  # edited in place
        for _ in range(2):
            session_1.append(person.wait_for_pair(1)["query_id"])
            person.label(session_1[-1], "left")
        assert read.wait(timeout=120)  # the trainer has read session 1 and starts learning from it
        assert person.label(session_1[2], "right")["updated"]
        assert person.undo(session_1[3])["learned"] == "yes"
        changed.set()
        for choice in later:
            person.label(person.wait_for_pair(2, exclude=[session_1[3]])["query_id"], choice)

    person = Person(base, script)
    # session 1 after exploration (step 1024), session 2 sixteen rollouts later (9216): time to answer session 1
    args = hopper_args(
        "async", total_timesteps=10240, teacher_feedback_mode="human", feedback_server_url=base, feedback_server_autostart=True,
        feedback_check_clips=0, feedback_async=True, feedback_async_poll_steps=8, teacher_feedback_total_queries=8,
        teacher_feedback_num_queries_per_session=4, teacher_feedback_frequency=8192, teacher_feedback_schedule="linear",
        segment_length=10, max_augmentation_offset=3, min_augmentation_offset=1, clip_width=64, clip_height=48,
    )  # fmt: skip
    summary = run_with(person, pref_ppo.main, args, reward_training)

    value = {choice: CHOICE_LABELS[choice] for choice in ("left", "right", "tie")}
    assert len(seen) == 2
    # the undo and re-answer and the edit inside the open session were read with it
    np.testing.assert_array_equal(seen[0], [value["right"], value["right"], value["left"], value["left"]])
    # session 1's three kept answers as they are now (right, right, right), then session 2's
    np.testing.assert_array_equal(sorted(seen[-1]), sorted([value["right"]] * 3 + [value[c] for c in later]))
    assert summary["labels_obtained"] == 7
    assert "labels: the run keeps 7 labels, each as the feedback server has it" in capsys.readouterr().out
    checkpoint = torch.load("models/async/latest/checkpoint.pt", weights_only=False)
    assert_run_keeps_the_servers_answers(Path("runs/async"), checkpoint, person)


def test_async_a_session_people_left_gives_way_and_its_late_answers_still_count(chdir_tmp, monkeypatch):
    """--feedback-async: the person answers 2 of session 1's 4 pairs and leaves. Once session 2 is due and nobody has
    answered for FeedbackSession.GIVE_WAY_SECONDS (60 s; 2 s here), the trainer learns from what is in and asks
    session 2: the person, back, gets its newer pairs first. Their late answers to session 1 still reach the run."""
    monkeypatch.setattr(FeedbackSession, "GIVE_WAY_SECONDS", 2.0)
    base = f"http://127.0.0.1:{free_port()}"
    seen, reward_training, _ = recording_reward_training(sac_rlhf)
    sessions_met = []

    def script(person: Person):
        for choice in ("left", "right"):
            person.label(person.wait_for_pair(1)["query_id"], choice)
        back = person.wait_for_pair(2, timeout=120)  # the person leaves; back, they meet session 2 first
        sessions_met.append(back["session"])
        newer = [back["query_id"]]
        person.label(newer[0], "right")
        for _ in range(2):
            newer.append(person.wait_for_pair(2)["query_id"])
            person.label(newer[-1], "right")
        last_new = person.wait_for_pair(2)["query_id"]
        for _ in range(2):  # the two pairs of session 1 left unanswered
            person.label(person.wait_for_pair(1, exclude=[last_new])["query_id"], "tie")
        person.label(last_new, "left")

    person = Person(base, script)
    # sessions at steps 400 and 700; the run goes on to 2400, so that session 2 is asked well before the last step,
    # where the run waits for the open session by design, however late a loaded machine delivers session 1's answers
    settings = dict(teacher_feedback_total_queries=8, teacher_feedback_num_queries_per_session=4, feedback_async=True)
    settings |= dict(total_timesteps=2400, feedback_async_poll_steps=10)
    summary = run_with(person, sac_rlhf.main, human_args("left", base, **settings), reward_training)

    assert sessions_met == [2] and len(seen) == 2
    np.testing.assert_array_equal(seen[0], [CHOICE_LABELS["left"], CHOICE_LABELS["right"]])  # what was in when it gave way
    assert sorted(seen[1]) == sorted([CHOICE_LABELS[c] for c in ("left", "right", "tie", "tie", "right", "right", "right", "left")])
    assert summary["labels_obtained"] == 8 and summary["feedback_sessions"] == 2
    checkpoint = torch.load("models/left/latest/checkpoint.pt", weights_only=False)
    assert_run_keeps_the_servers_answers(Path("runs/left"), checkpoint, person)


def test_a_correction_after_the_last_update_is_learned_by_one_more_fit_or_told_it_is_not(chdir_tmp, capsys):
    """Session 2 is the run's last. Right after its reward update the person edits one of its answers: the server says
    the run learns it, and it does, by one more fit at the run's end, in the final checkpoint. Once the run has ended
    they edit another: the server says this run will not learn it, and it does not. Never both, never neither."""
    from test_feedback_hardening import Server

    (chdir_tmp / "server").mkdir()
    server = Server(chdir_tmp / "server", "--token", "corrections-token")  # outlives the run, as a server started by hand does
    base, changed, corrected = server.base, threading.Event(), threading.Event()
    seen, replies = [], {}

    def reward_training(reward_model, optimizer, prefs, *args, **kwargs):
        seen.append(prefs.labels.copy())
        stats = sac_rlhf.train_reward_model(reward_model, optimizer, prefs, *args, **kwargs)
        if len(seen) == 2:  # the last session's update is done: the person changes their mind now
            changed.set()
            assert corrected.wait(timeout=60), "the person did not change their answer"
        return stats

    def script(person: Person):
        for session in (1, 2):
            for _ in range(4):
                query = person.wait_for_pair(session)
                person.label(query["query_id"], "left")
                replies.setdefault(session, []).append(query["query_id"])
        assert changed.wait(timeout=300)
        replies["during"] = person.label(replies[2][0], "right")  # after the last update, while the run trains on
        corrected.set()

    person = Person(base, script)
    args = human_args(
        "last", base, feedback_server_autostart=False, feedback_server_token="corrections-token",
        teacher_feedback_total_queries=8, teacher_feedback_num_queries_per_session=4,
    )  # fmt: skip
    try:
        summary = run_with(person, sac_rlhf.main, args, reward_training)
        replies["after"] = person.label(replies[2][1], "right")  # the run has ended
    finally:
        server.stop()
    assert summary["labels_obtained"] == 8
    assert replies["during"]["learned"] == "yes" and replies["after"]["learned"] == "no"
    left, right = CHOICE_LABELS["left"], CHOICE_LABELS["right"]
    assert len(seen) == 3  # two sessions, and one more fit for the correction
    np.testing.assert_array_equal(seen[1], [left] * 8)
    np.testing.assert_array_equal(seen[2], [left] * 4 + [right] + [left] * 3)  # the correction, learned
    checkpoint = torch.load("models/last/latest/checkpoint.pt", weights_only=False)
    np.testing.assert_array_equal(checkpoint["preference_buffer"]["labels"], seen[2])  # the later edit: not learned
    _, logged = read_label_file("runs/last/labels.sqlite")
    assert sorted(logged) == sorted(seen[2])
    out = capsys.readouterr().out
    assert "labels: 1 changed after the last reward update; the reward model learns them in one more fit" in out, out
