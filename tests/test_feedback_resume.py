"""Labels across faults and resumes: every label a person gives is kept exactly
once, a resumed session asks the pairs already on the server, a session's labels and its reward update are one unit
in the checkpoint, a human run checkpoints after every session, and --feedback-async trains while people label.
Real components: sac_rlhf.main, a feedback server it starts on a free port, a labeller thread posting over HTTP."""

import _thread
import json
import signal
import sqlite3
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_end_to_end import assert_same_training, final_state, scalars, small_args
from test_human_feedback import free_port, run_token

import sac_rlhf
from cleanrlhf_utils import run as run_module
from cleanrlhf_utils.feedback import CHOICE_LABELS, LabelLog, read_label_file

requests = pytest.importorskip("requests")
CHOICES = ["left", "right", "tie", "skip"]


class Labeller(threading.Thread):
    """A person at the page: answers each pair it gets (left / right / tie / skip by query id), `seconds` after
    getting it. After `interrupt_after` answers it presses Ctrl-C in the trainer (the main thread) and stops."""

    def __init__(self, base: str, seconds: float = 0.0, interrupt_after: int | None = None, answers: int | None = None):
        super().__init__(daemon=True)
        self.base, self.seconds, self.interrupt_after, self.answers = base, seconds, interrupt_after, answers
        self.given: dict[int, str] = {}  # query id -> choice, one entry per answer posted
        self.received_at: dict[int, float] = {}  # query id -> when the page first showed it
        self.answered_at: list[float] = []
        self.stop, self.posts = threading.Event(), 0

    def run(self):
        http = requests.Session()  # with the token of the run's server, kept in its folder also for a resume
        while not self.stop.is_set():
            try:
                if "X-Feedback-Token" not in http.headers:
                    if run_token() is None:  # the trainer has not started the server yet
                        raise requests.ConnectionError
                    http.headers["X-Feedback-Token"] = run_token()
                query = http.get(f"{self.base}/api/next", params={"annotator": "ann"}, timeout=5).json()
            except requests.ConnectionError:  # the trainer has not started the server yet, or stopped it
                time.sleep(0.05)
                continue
            if query.get("waiting"):
                time.sleep(0.05)
                continue
            self.received_at.setdefault(query["query_id"], time.monotonic())
            if self.stop.wait(self.seconds):
                return
            choice = CHOICES[query["query_id"] % 4]
            url = f"{self.base}/api/queries/{query['query_id']}/label"
            assert http.post(url, json={"choice": choice, "annotator": "ann"}, timeout=5).status_code == 201
            self.posts += 1
            self.given[query["query_id"]] = choice
            self.answered_at.append(time.monotonic())
            if self.posts == self.interrupt_after:
                _thread.interrupt_main()  # Ctrl-C while the trainer waits for the rest of the session
                return
            if self.posts == self.answers:  # the person leaves
                return


@pytest.fixture(autouse=True)
def ctrl_c_raises_keyboard_interrupt():
    """Ctrl-C as in a terminal. A shell starts background jobs (a CI runner's, a nohup'd suite) with SIGINT ignored,
    Python then installs no KeyboardInterrupt handler, and the labeller's _thread.interrupt_main did nothing: the
    trainer waited for the rest of the session for ever."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def human_args(run_name: str, base: str, **overrides) -> sac_rlhf.Args:
    """Sessions of 5 pairs at steps 400 and 700 (one checkpoint at the end of exploration, at 400)."""
    settings = dict(
        total_timesteps=800,
        teacher_feedback_mode="human",
        feedback_server_url=base,
        feedback_server_autostart=True,
        feedback_check_clips=0,
        teacher_feedback_total_queries=10,
        teacher_feedback_num_queries_per_session=5,
        teacher_feedback_schedule="linear",
        segment_length=10,
        max_augmentation_offset=3,
        min_augmentation_offset=1,
        video_width=64,
        video_height=48,
    )
    for name in ("clip_width", "clip_height"):  # the clip size, where the page's settings are in
        if hasattr(sac_rlhf.Args, name):
            settings[name] = 48 if name == "clip_height" else 64
    return small_args(run_name, **(settings | overrides))


def server_status(base: str, run: str) -> dict:
    headers = {"X-Feedback-Token": run_token()}
    run_id = next(r["run_id"] for r in requests.get(f"{base}/api/runs", headers=headers, timeout=5).json()["runs"] if r["name"] == run)
    return requests.get(f"{base}/api/runs/{run_id}/status", headers=headers, timeout=5).json()


def log_rows(path: str) -> list[tuple]:
    with sqlite3.connect(path) as db:
        return db.execute("SELECT session, label, annotator, obs_actions FROM labels ORDER BY id").fetchall()


def test_label_log_is_idempotent_and_opens_older_files(tmp_path):
    """The same session recorded twice (a resume re-reading the server's answers) is stored once; a
    labels.sqlite of an older version (no key, duplicated rows) opens, loses its duplicates, and takes new labels."""
    rng = np.random.default_rng(0)
    segments = {
        "obs_actions": rng.random((3, 2, 4, 5), dtype=np.float32),
        "masks": np.ones((3, 2, 4), dtype=np.float32),
        "true_rewards": rng.random((3, 2, 4), dtype=np.float32),
        "physics_states": rng.random((3, 2, 4, 6)),
        "segment_ids": np.array([[1, 7], [2, 9], [3, 11]]),
    }
    labels = np.array([1.0, 0.0, 0.5], dtype=np.float32)
    log = LabelLog(tmp_path / "labels.sqlite")
    for _ in range(3):
        log.append(segments, labels, ["a", "b", "c"], 1, 400)
    log.close()
    stored, stored_labels = read_label_file(tmp_path / "labels.sqlite")
    np.testing.assert_array_equal(stored_labels, labels)
    np.testing.assert_array_equal(stored["obs_actions"], segments["obs_actions"])

    # An older labels.sqlite: the table without a key, each label of session 1 written twice by two resumes.
    old = tmp_path / "old.sqlite"
    with sqlite3.connect(old) as db:
        db.execute(
            "CREATE TABLE labels (id INTEGER PRIMARY KEY, global_step INTEGER, session INTEGER, label REAL, annotator TEXT,"
            " obs_actions BLOB, masks BLOB, true_rewards BLOB, physics_states BLOB, shapes TEXT)"
        )
        for _ in range(2):
            for i in range(3):
                arrays = {name: np.ascontiguousarray(segments[name][i]) for name in LabelLog.ARRAYS}
                shapes = json.dumps({name: [list(a.shape), str(a.dtype)] for name, a in arrays.items()})
                db.execute(
                    "INSERT INTO labels (global_step, session, label, annotator, obs_actions, masks, true_rewards, physics_states, shapes)"
                    " VALUES (?,?,?,?,?,?,?,?,?)",
                    (400, 1, float(labels[i]), "a", *(a.tobytes() for a in arrays.values()), shapes),
                )
    log = LabelLog(old)
    log.append(segments, labels, ["a", "b", "c"], 1, 400)  # the same labels again, now with their key
    log.append({k: v[:1] for k, v in segments.items()}, labels[:1], ["d"], 2, 700)  # a new session's label
    log.close()
    _, old_labels = read_label_file(old)
    np.testing.assert_array_equal(old_labels, [1.0, 0.0, 0.5, 1.0])


def test_resumed_session_asks_the_same_pairs_and_keeps_each_label_once(chdir_tmp, monkeypatch):
    """Ctrl-C with 2 of 5 pairs answered; the resumed run finishes that session with the pairs already
    on the server (the 2 answers kept, 3 pairs still asked) and asks session 2. A human run checkpoints after every
    session. Resumed twice more from the exploration checkpoint (before session 1), the run re-reads every answer
    from the server: labels.sqlite keeps each label once."""
    base = f"http://127.0.0.1:{free_port()}"
    saved_at: list[tuple[str, int]] = []
    real_save = run_module.save_checkpoint

    def save(folder, state, rb=None):
        saved_at.append((Path(folder).name, state["loop"]["global_step"]))
        real_save(folder, state, rb)

    monkeypatch.setattr(run_module, "save_checkpoint", save)  # every checkpoint of a run is written by cleanrlhf_utils.run
    first = Labeller(base, interrupt_after=2)
    first.start()
    with pytest.raises(KeyboardInterrupt):
        sac_rlhf.main(human_args("h", base))
    first.join(timeout=10)
    assert len(first.given) == 2
    saved = torch.load("models/h/latest/checkpoint.pt", weights_only=False)
    assert saved["loop"]["global_step"] == 400 and saved["loop"]["sessions_done"] == 0
    assert len(log_rows("runs/h/labels.sqlite")) == sum(c != "skip" for c in first.given.values())  # kept, with their annotator
    assert {row[2] for row in log_rows("runs/h/labels.sqlite")} <= {"ann"}

    saved_at.clear()
    second = Labeller(base)
    second.start()
    try:
        summary = sac_rlhf.main(human_args("h", base, resume="models/h/latest"))
    finally:
        second.stop.set()
    second.join(timeout=10)
    given = first.given | second.given
    assert len(first.given) + len(second.given) == len(given) == 10, "a pair was answered twice"
    assert sorted(given) == list(range(1, 11)), "the resumed session asked new pairs"
    expected = [CHOICE_LABELS[given[q]] for q in sorted(given) if given[q] != "skip"]
    assert summary["labels_obtained"] == len(expected) and summary["feedback_sessions"] == 2
    prefs = final_state("h")["checkpoint"]["preference_buffer"]
    np.testing.assert_array_equal(prefs["labels"], np.array(expected, dtype=np.float32))
    assert ("latest", 400) in saved_at and ("latest", 700) in saved_at, saved_at  # a checkpoint after each session
    rows = log_rows("runs/h/labels.sqlite")
    assert [r[1] for r in rows] == expected and {r[2] for r in rows} == {"ann"}

    # Two resumes from the checkpoint written before session 1: the same pairs, answered already, read again.
    for _ in range(2):
        sac_rlhf.main(human_args("h", base, resume="models/h/400"))
    assert len(log_rows("runs/h/labels.sqlite")) == len(expected), "labels.sqlite holds a label twice"
    assert len({r[3] for r in log_rows("runs/h/labels.sqlite")}) == len(expected)


def test_interrupted_reward_update_is_redone_exactly(chdir_tmp, monkeypatch):
    """Ctrl-C while the reward model learns from session 1. The checkpoint holds the state from before the
    update (the session open with its labels); the resume redoes the update at the same step, asks session 2 at its
    own step, and ends exactly where an uninterrupted run ends."""
    short = {"total_timesteps": 800, "teacher_feedback_total_queries": 20, "teacher_feedback_schedule": "linear"}
    sac_rlhf.main(small_args("whole", **short))
    uninterrupted = final_state("whole")
    real_train = sac_rlhf.train_reward_model

    def train(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(sac_rlhf, "train_reward_model", train)
    with pytest.raises(KeyboardInterrupt):
        sac_rlhf.main(small_args("cut", **short))
    monkeypatch.setattr(sac_rlhf, "train_reward_model", real_train)
    saved = final_state("cut")["checkpoint"]
    assert saved["loop"]["global_step"] == 400 and saved["loop"]["sessions_done"] == 0
    sac_rlhf.main(small_args("cut", resume="models/cut/latest", **short))
    resumed = final_state("cut")
    assert list(resumed["checkpoint"]["preference_buffer"]["global_steps"]) == [400] * 10 + [700] * 10
    assert_same_training(uninterrupted, resumed)


def test_feedback_async_trains_while_people_label(chdir_tmp):
    """With --feedback-async the run's steps advance while a slow labeller answers (every 0.4 s); each
    session's labels are learned from once all are in, and every label given arrives exactly once."""
    base = f"http://127.0.0.1:{free_port()}"
    labeller = Labeller(base, seconds=0.4)
    labeller.start()
    try:
        summary = sac_rlhf.main(human_args("a", base, total_timesteps=1400, feedback_async=True, feedback_async_poll_steps=50))
    finally:
        labeller.stop.set()
    labeller.join(timeout=10)
    given = labeller.given
    assert sorted(given) == list(range(1, 11)) and labeller.posts == 10
    expected = [CHOICE_LABELS[given[q]] for q in sorted(given) if given[q] != "skip"]
    prefs = final_state("a")["checkpoint"]["preference_buffer"]
    np.testing.assert_array_equal(prefs["labels"], np.array(expected, dtype=np.float32))
    assert [r[1] for r in log_rows("runs/a/labels.sqlite")] == expected
    assert summary["feedback_sessions"] == 2 and summary["labels_obtained"] == len(expected)
    # Session 1 opened at step 400 and took >= 2 s of answers: training went on meanwhile.
    first_session_steps = prefs["global_steps"][: sum(given[q] != "skip" for q in range(1, 6))]
    assert (first_session_steps > 450).all(), prefs["global_steps"]
    idle = [value for _, value in scalars(Path("runs/a"))["feedback/trainer_idle_seconds"]]
    assert len(idle) == 2 and idle[0] < 1.0, idle  # a sync run waits >= 5 x 0.4 s in each session
    assert summary["trainer_idle_seconds"] == pytest.approx(sum(idle), abs=1e-3) and summary["trainer_idle_seconds"] < 4.0


def slow_reward_updates(monkeypatch, script, seconds: float = 1.5) -> list[tuple[float, float]]:
    """Makes the script's reward update `seconds` slower (the real update runs after the wait), as a person who gets
    some answers wrong makes it (all epochs, up to 40 s in bench/simulated_person.py). Returns the list that receives
    each update's (start, end) in time.monotonic()."""
    updates, real_train = [], script.train_reward_model

    def slow_train(*args, **kwargs):
        begun = time.monotonic()
        time.sleep(seconds)
        stats = real_train(*args, **kwargs)
        updates.append((begun, time.monotonic()))
        return stats

    monkeypatch.setattr(script, "train_reward_model", slow_train)
    return updates


def test_feedback_async_puts_the_next_pairs_up_before_the_reward_update(chdir_tmp, monkeypatch):
    """A simulated person waited at every session boundary through the reward update, the
    relabel, the selection and the first clip (up to 40 s). With --feedback-async the next session's pairs, chosen by
    the model as it stood, go up before the update: the person gets session 2's first pair while the reward model
    still learns from session 1 (an update made 1.5 s slow here), and every answer still arrives exactly once."""
    base = f"http://127.0.0.1:{free_port()}"
    updates = slow_reward_updates(monkeypatch, sac_rlhf)
    labeller = Labeller(base, seconds=0.2)
    labeller.start()
    try:  # session 2 is due 10 steps after session 1 opens: long before a person has answered 5 pairs
        args = human_args(
            "s", base, total_timesteps=1400, feedback_async=True, feedback_async_poll_steps=10, teacher_feedback_frequency=10,
            feedback_check_clips=2,  # the reward check's clips render while the next session's do
        )  # fmt: skip
        summary = sac_rlhf.main(args)
    finally:
        labeller.stop.set()
    labeller.join(timeout=10)
    shown = [json.loads(line) for line in Path("runs/s/shown_pairs.jsonl").read_text().splitlines()]
    pairs = {(pair["session"], pair["pair"]): pair["query_id"] for pair in shown}  # the check's clips go up as queries too
    assert len(updates) == 2 and sorted(labeller.given) == sorted(pairs.values()) and len(pairs) == labeller.posts == 10
    first_update_ends = updates[0][1]
    assert labeller.received_at[pairs[2, 0]] < first_update_ends, "session 2's first pair came only after session 1's update"
    expected = [CHOICE_LABELS[labeller.given[q]] for q in sorted(labeller.given) if labeller.given[q] != "skip"]
    prefs = final_state("s")["checkpoint"]["preference_buffer"]
    np.testing.assert_array_equal(prefs["labels"], np.array(expected, dtype=np.float32))
    assert [r[1] for r in log_rows("runs/s/labels.sqlite")] == expected and summary["feedback_sessions"] == 2
    assert summary["people_idle_seconds"] < 1.0, summary  # without staging: >= the 1.5 s update
    check_clips = sorted(path.name for path in Path("videos/s/clips").glob("*_check_*.mp4"))
    assert len(check_clips) == 4 and all(Path("videos/s/clips", name).stat().st_size > 1000 for name in check_clips), check_clips


def test_staged_pairs_survive_an_interrupted_reward_update(chdir_tmp, monkeypatch):
    """Ctrl-C during session 1's reward update, after session 2's pairs went up: the checkpoint keeps them, and the
    resumed run redoes the update and opens session 2 with those pairs, uploading none of them again; every label
    is kept once."""
    base = f"http://127.0.0.1:{free_port()}"
    real_train = sac_rlhf.train_reward_model

    def interrupted_train(*args, **kwargs):
        deadline = time.monotonic() + 30
        while server_status(base, "r")["queries"] < 10 and time.monotonic() < deadline:
            time.sleep(0.05)  # session 2's pairs are all up: Ctrl-C comes after the staging, not during it
        raise KeyboardInterrupt

    monkeypatch.setattr(sac_rlhf, "train_reward_model", interrupted_train)
    settings = dict(total_timesteps=1400, feedback_async=True, feedback_async_poll_steps=10, teacher_feedback_frequency=10)
    first = Labeller(base, seconds=0.1, answers=5)
    first.start()
    with pytest.raises(KeyboardInterrupt):
        sac_rlhf.main(human_args("r", base, **settings))
    first.join(timeout=10)
    saved = torch.load("models/r/latest/checkpoint.pt", weights_only=False)
    assert saved["loop"]["sessions_done"] == 0 and saved["session"]["staged"]["number"] == 2
    staged_pairs = saved["session"]["staged"]["segments"]["obs_actions"]

    monkeypatch.setattr(sac_rlhf, "train_reward_model", real_train)
    second = Labeller(base, seconds=0.1)
    second.start()
    try:
        summary = sac_rlhf.main(human_args("r", base, resume="models/r/latest", **settings))
    finally:
        second.stop.set()
    second.join(timeout=10)
    given = first.given | second.given
    assert sorted(first.given) == [1, 2, 3, 4, 5] and sorted(second.given) == [6, 7, 8, 9, 10], "a pair was uploaded twice"
    expected = [CHOICE_LABELS[given[q]] for q in sorted(given) if given[q] != "skip"]
    assert summary["feedback_sessions"] == 2 and summary["labels_obtained"] == len(expected)
    prefs = final_state("r")["checkpoint"]["preference_buffer"]
    np.testing.assert_array_equal(prefs["labels"], np.array(expected, dtype=np.float32))
    second_session = [given[q] != "skip" for q in range(6, 11)]
    np.testing.assert_array_equal(prefs["obs_actions"][-sum(second_session) :], staged_pairs[second_session])


def test_feedback_async_needs_human_mode(chdir_tmp):
    with pytest.raises(sac_rlhf.ConfigError, match="--feedback-async needs --teacher-feedback-mode human"):
        sac_rlhf.main(small_args("x", feedback_async=True))


def test_async_poll_never_waits_long_on_a_hung_server(tmp_path):
    """--feedback-async reads answers with one request of at most 2 s: a server that accepts the connection and never
    answers (hung, or a proxy in front of a dead one) costs the trainer that, not the client's 30 s timeout."""
    import socket

    from cleanrlhf_utils.feedback import FeedbackClient, FeedbackServerUnreachable, HumanTeacher

    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen()  # the kernel completes connections; nobody reads or answers
        teacher = HumanTeacher(FeedbackClient(f"http://127.0.0.1:{hung.getsockname()[1]}"), 1, None, tmp_path, 30)
        teacher.open = {"session": 1, "query_ids": [None]}
        start = time.monotonic()
        with pytest.raises(FeedbackServerUnreachable):
            teacher.poll(retry=False)
        assert time.monotonic() - start < 5
