"""Every teacher behind one interface: the synthetic teacher (B-Pref's), people answering in the browser through the
feedback server (humanFeedback/feedback_server.py), and the labels an earlier run saved; `make_teacher` picks one. Also
the feedback session a run is in, and the log every run keeps of its labels (runs/<run>/labels.sqlite), which is what
file mode reads back.

Every teacher answers `label(segments, session) -> (labels, annotators)`: `segments` holds the pairs' arrays
(obs_actions, masks, true_rewards, physics_states: (N, 2, L, ...)) and their replay-buffer start indices
(segment_ids: (N, 2)); labels (N,) are 1 = segment 1 preferred, 0 = segment 0, 0.5 = tie, nan = skipped. Queries of
k > 2 clips (--clips-per-query) have arrays (N, k, ...) and rankings for labels, each its order's index
(cleanrlhf_utils.rankings); with --rating-scale, a query's labels are its clips' ratings (cleanrlhf_utils.ratings).
Every teacher gives every kind."""

import contextlib
import copy
import functools
import hmac
import itertools
import json
import math
import os
import queue
import secrets
import sys
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar, Literal, Protocol

import numpy as np

from . import protocol
from .checkpoints import training_state
from .envs import SegmentRenderer, check_can_render, get_physics_state, make_env, segment_frames, write_mp4
from .errors import ConfigError, check_ranges, need
from .objectives import check_objective, load_objective, segment_rewards
from .rankings import MAX_CLIPS, clip_pairs, order_labels, pair_labels
from .ratings import MAX_SCALE, RATING_SCALE_RANGE, rating_labels, rating_pair_labels
from .stopping import stoppable_at_once


@dataclass
class FeedbackArgs:
    """Who labels, and how people are reached: the feedback server, its clips, or an earlier run's labels."""

    help_group: ClassVar[str] = "teacher"

    teacher_feedback_mode: Literal["simulated", "human", "file"] = "simulated"
    """who labels: `simulated` (synthetic teacher on the true reward), `human` (people in the browser, through
    the feedback server), `file` (the labels an earlier run saved, --feedback-file)"""
    teacher_beta: float = -1.0
    """synthetic teacher's rationality: >= 0 draws labels from Bradley-Terry at this temperature; < 0 is perfect"""
    teacher_gamma: float = 1.0
    """synthetic teacher's myopia: step t of an L-step segment weighs gamma^(L-1-t)"""
    teacher_eps_mistake: float = 0.0
    """synthetic teacher: probability of flipping a label"""
    teacher_eps_skip: float = 0.0
    """synthetic teacher: skip pairs whose returns are both below this fraction of the average segment return"""
    teacher_eps_equal: float = 0.0
    """synthetic teacher: call a tie when the returns differ by less than this fraction of the average segment return"""
    teacher_objective: str = ""
    """what the teacher prefers instead of the env's reward: a built-in objective or module:function (docs/environments.md)"""
    feedback_server_url: str = "http://localhost:5001"
    """address of the feedback server (human mode)"""
    feedback_server_autostart: bool = False
    """start the feedback server as a child process if none answers at --feedback-server-url"""
    feedback_server_token: str | None = None
    """shared secret of the feedback server; default: the FEEDBACK_SERVER_TOKEN environment variable (which keeps it off
    the command line, visible to every user in ps), else the run's runs/<run>/feedback_token, else (with
    --feedback-server-autostart) a new one, kept there for a resume"""
    feedback_server_data_dir: str | None = None
    """database and clips of an autostarted server (--feedback-server-autostart); default runs/<run>/feedback_data, one
    per run. Give several runs the same folder, URL and FEEDBACK_SERVER_TOKEN to label them all on one page"""
    feedback_instructions: str = "Which clip shows the agent doing its task better?"
    """the question shown above every pair of this run's clips, e.g. "which one moves forward better?" """
    feedback_file: str | None = None
    """labels.sqlite of an earlier run (runs/<run>/labels.sqlite) to train from in file mode"""
    feedback_check_clips: int = 5
    """human mode: clips with the reward model's predicted return uploaded after each reward update"""
    clip_fps: float | None = None
    """frame rate of the clips shown to people (one frame per environment step); default the environment's real time,
    1/dt (Hopper 125, dm_control walker 40), so a clip lasts segment_length * dt seconds (the page loops it)"""
    clip_width: int = 576
    clip_height: int = 432
    """size of the clips shown to people: the page shows two side by side at 576 px at most, so they are rendered at
    the size they are seen (the page never enlarges a clip beyond its own size); at most 640x480, MuJoCo's offscreen buffer"""
    feedback_async: bool = False
    """human mode: keep training on the current reward model while people label. A session's pairs are uploaded and
    its answers read every --feedback-async-poll-steps steps without waiting; the reward model learns from them (and
    the replay buffer is relabelled) when they are all in, or every --feedback-async-update-every labels, and the next
    session's pairs are selected then. The run waits for the open session only at its last step"""
    feedback_async_poll_steps: int = 200
    """--feedback-async: environment steps between two reads of the server's answers (one short request each)"""
    feedback_async_update_every: int = 0
    """--feedback-async: update the reward model every this many new labels of the open session (0: once all are in)"""
    feedback_login_link: bool = False
    """human mode: print a new one-time login link also when the run is resumed (a run that starts afresh prints one;
    browsers logged in before stay logged in across a resume)"""


def need_no_teacher(args: FeedbackArgs, flag: str, why: str) -> None:
    """A run that asks no teacher (`flag`, for `why`) refuses a human or file one in one line instead of starting it."""
    mode = args.teacher_feedback_mode
    need(mode == "simulated", f"{flag} {why} and asks no teacher: drop --teacher-feedback-mode {mode}")


TEACHER_RANGES = {
    "teacher_gamma": "in [0, 1]",
    "teacher_eps_mistake": "in [0, 1]",
    "teacher_eps_skip": "in [0, 1]",
    "teacher_eps_equal": "in [0, 1]",
}


def validate_feedback_args(args: FeedbackArgs) -> None:
    """The teacher's settings: the synthetic teacher's noise, --teacher-feedback-mode human|file and how the server and
    its clips are reached."""
    check_ranges(args, TEACHER_RANGES)
    if args.teacher_feedback_mode == "file":
        need(args.feedback_file is not None, "--teacher-feedback-mode file needs --feedback-file PATH (a runs/<run>/labels.sqlite)")
        need(Path(args.feedback_file).is_file(), f"--feedback-file {args.feedback_file} does not exist")
    if args.teacher_feedback_mode == "human":
        check_can_render(args.env_id, "--teacher-feedback-mode human")
    need(
        not args.feedback_async or args.teacher_feedback_mode == "human",
        f"--feedback-async needs --teacher-feedback-mode human (a {args.teacher_feedback_mode} teacher answers at once: nothing to wait for)",
    )
    need(args.feedback_async_poll_steps >= 1, f"--feedback-async-poll-steps must be >= 1, got {args.feedback_async_poll_steps}")
    need(args.feedback_async_update_every >= 0, f"--feedback-async-update-every must be >= 0, got {args.feedback_async_update_every}")
    need(args.feedback_check_clips >= 0, f"--feedback-check-clips must be >= 0, got {args.feedback_check_clips}")
    need(args.clip_fps is None or args.clip_fps > 0, f"--clip-fps must be > 0, got {args.clip_fps}")
    need(16 <= args.clip_width <= 640, f"--clip-width must be from 16 to 640 (MuJoCo's offscreen buffer), got {args.clip_width}")
    need(16 <= args.clip_height <= 480, f"--clip-height must be from 16 to 480 (MuJoCo's offscreen buffer), got {args.clip_height}")
    instructions = args.feedback_instructions.strip()
    need(
        0 < len(instructions) <= 500,
        f"--feedback-instructions must be 1 to 500 characters, got {len(instructions)}: say in one line what people should judge",
    )
    need(
        args.feedback_server_url.startswith(("http://", "https://")),
        f"--feedback-server-url {args.feedback_server_url} must start with http:// or https://",
    )


def label_file_kind(path: str | Path) -> tuple[int, int] | None:
    """How many clips each label of a labels.sqlite judges (2: pairs) and on which rating scale (0: compared or
    ranked), from its first row; None when it holds none."""
    import sqlite3

    db = sqlite3.connect(f"file:{Path(path).resolve()}?mode=ro", uri=True)
    try:
        columns = [row[1] for row in db.execute("PRAGMA table_info(labels)")]
        scale = "rating_scale" if "rating_scale" in columns else "0"  # a file from before ratings holds none
        row = db.execute(f"SELECT shapes, {scale} FROM labels ORDER BY id LIMIT 1").fetchone()
    except sqlite3.DatabaseError as error:
        raise ConfigError(f"--feedback-file {path} is not a run's labels.sqlite ({error})") from None
    finally:
        db.close()
    return None if row is None else (int(json.loads(row[0])["masks"][0][0]), int(row[1] or 0))


def check_query_kind(args) -> None:
    """What a query asks: a pair compared, a ranking of k clips (--clips-per-query k > 2: from the synthetic teacher,
    people, or a file of rankings of k clips) or ratings of its clips (--rating-scale). A ranking of more than two clips
    and ratings have no ties (--teacher-eps-equal is a pair's); a file replays labels of its own kind only."""
    clips, scale, mode = args.clips_per_query, args.rating_scale, args.teacher_feedback_mode
    need(scale == 0 or 2 <= scale <= MAX_SCALE, f"--rating-scale must be {RATING_SCALE_RANGE}, got {scale}")
    if mode == "file":
        stored = label_file_kind(args.feedback_file)
        asked = f"--clips-per-query {stored[0]}" + (f" --rating-scale {stored[1]}" if stored and stored[1] else "")
        need(
            stored in (None, (clips, scale)),
            f"--feedback-file {args.feedback_file} holds labels of {stored and stored[0]} clips each"
            + (f" rated on a scale of {stored[1]}" if stored and stored[1] else "")
            + f"; give {asked}",
        )
    if clips == 2 and scale == 0:
        return
    kind = f"ratings on a scale of {scale}" if scale else f"a ranking of {clips} clips"
    need(
        args.teacher_eps_equal == 0,
        f"--teacher-eps-equal {args.teacher_eps_equal} calls ties of a pair, and {kind} has none: use it with --clips-per-query 2 and no --rating-scale",
    )


# What each of the protocol's choices means as a label (the left clip is segment 0).
CHOICE_LABELS = dict(zip(protocol.CHOICES, (0.0, 1.0, 0.5, float("nan")), strict=True))


def answer_label(answer: dict, rating_scale: int = 0) -> float:
    """The label of an answer the feedback server gives: a pair's choice (CHOICE_LABELS), a ranking's order, best
    first, as its order's index (cleanrlhf_utils.rankings), or the ratings of a query's clips, 1 .. rating_scale, as
    cleanrlhf_utils.ratings writes them."""
    if answer["choice"] == protocol.RANKED:
        return float(order_labels(np.array([answer["ranking"]]))[0])
    if answer["choice"] == protocol.RATED:
        return float(rating_labels(np.array([answer["ratings"]]) - 1, rating_scale)[0])
    return CHOICE_LABELS[answer["choice"]]


def reorder_label(answer: dict, positions: tuple[int, ...]) -> float:
    """The label a person's reorder of the reward-model check (`answer`, over all of its clips) gives the check clips at
    `positions` (a subset, in the order shown): their order within the person's, as rankings.order_labels writes it.
    A check of two clips is asked as a pair: its choice (a skip: nan)."""
    if answer["choice"] != protocol.RANKED:
        return answer_label(answer)
    within = [positions.index(place) for place in answer["ranking"] if place in positions]
    return float(order_labels(np.array([within]))[0])


def reorderable(args) -> bool:
    """Whether people may reorder the reward-model check's clips as labels: its --feedback-check-clips (at most
    rankings.MAX_CLIPS, at least a query's clips) and a run that compares or ranks (a reorder gives no ratings)."""
    return args.rating_scale == 0 and args.clips_per_query <= args.feedback_check_clips <= MAX_CLIPS


def query_entry(clips: list[str], segment_ids: list, session: int, rating_scale: int = 0) -> dict:
    """A query as the server takes it: a pair's two clips as left and right, a ranking's clips in the order shown, the
    clips to rate in the order shown with their scale."""
    if rating_scale:
        return {"clips": clips, "segment_ids": segment_ids, "session": session, "rating_scale": rating_scale}
    if len(clips) > 2:
        return {"clips": clips, "segment_ids": segment_ids, "session": session}
    (left, right), (left_id, right_id) = clips, segment_ids
    return {"left_clip": left, "right_clip": right, "left_segment_id": left_id, "right_segment_id": right_id, "session": session}


class FeedbackServerError(RuntimeError):
    """The feedback server refused a request (4xx) or stayed unreachable past the retry budget."""


class FeedbackServerUnreachable(FeedbackServerError):
    """No answer (connection refused, timeout, 5xx) within the retry budget: worth asking again later."""


def encode_multipart(fields: dict[str, str], files: dict[str, Path]) -> tuple[bytes, str]:
    boundary = f"----cleanrlhf{os.urandom(12).hex()}"
    parts = []
    for name, value in fields.items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode())
    for name, path in files.items():
        header = f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{name}"\r\nContent-Type: video/mp4\r\n\r\n'
        parts.append(header.encode() + Path(path).read_bytes() + b"\r\n")
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


class FeedbackClient:
    """JSON/multipart client of the feedback server. Connection failures and 5xx answers are retried with
    exponential backoff (so the trainer survives a server restart); 4xx answers are errors at once."""

    RETRY_SECONDS = 600.0  # how long a request is re-sent to a server that is away before the run stops (resumable)

    def __init__(self, url: str, token: str | None = None, retry_seconds: float | None = None, timeout: float = 30.0):
        self.url, self.token, self.timeout = url.rstrip("/"), token, timeout
        self.retry_seconds = self.RETRY_SECONDS if retry_seconds is None else retry_seconds
        self.on_outage = None  # called with the failure once per outage (see OUTAGE_SECONDS)
        self.away, self.failing_since = False, None
        self.proven = False  # the server at url answered this token's challenge since it last went away (prove)

    # A server that refuses connections is away at once; one that is slow to answer (busy storing a large upload) only
    # once its requests have failed for this long.
    OUTAGE_SECONDS = 10.0

    def request(self, method: str, path: str, json_body=None, fields=None, files=None, retry: bool = True) -> dict:
        import http.client
        import urllib.error
        import urllib.request

        headers = {protocol.TOKEN_HEADER: self.token} if self.token else {}
        data = None
        if json_body is not None:
            data, headers["Content-Type"] = json.dumps(json_body).encode(), "application/json"
        elif fields is not None or files is not None:
            data, headers["Content-Type"] = encode_multipart(fields or {}, files or {})
        deadline, delay = time.monotonic() + self.retry_seconds, 0.25
        while True:
            try:
                if self.token and not self.proven:
                    self.prove()
                req = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
                with urllib.request.urlopen(req, timeout=self.timeout) as response:
                    reply = json.loads(response.read() or b"{}")
                self.away, self.failing_since = False, None
                return reply
            except urllib.error.HTTPError as error:
                if error.code < 500:
                    try:
                        reason = json.loads(error.read()).get("error", "")
                    except ValueError:
                        reason = ""
                    if error.code in (401, 403):
                        reason += f" Give the run this server's token ({protocol.TOKEN_ENV}; a server started by hand keeps it in <data-dir>/token)."
                    raise FeedbackServerError(f"{method} {path}: HTTP {error.code} {reason}") from None
                failure = f"HTTP {error.code}"
            except (urllib.error.URLError, ConnectionError, TimeoutError, http.client.HTTPException, ValueError) as error:
                # ValueError: a reply cut short by a dying server; every request is idempotent, so re-send it.
                reason = getattr(error, "reason", error)
                failure = str(reason) or type(error).__name__
                self.proven = False  # whatever answers there next proves itself again before it gets the token
                if isinstance(reason, ConnectionRefusedError):  # nothing listens: away now, whatever came before
                    self.failing_since = -float("inf")
            self.failing_since = time.monotonic() if self.failing_since is None else self.failing_since
            if not self.away and self.on_outage is not None and time.monotonic() - self.failing_since >= self.OUTAGE_SECONDS:
                self.away = True  # said once per outage; the callback may start the server again
                self.on_outage(failure)
            if not retry or time.monotonic() + delay > deadline:
                raise FeedbackServerUnreachable(f"feedback server {self.url} unreachable ({failure})")
            time.sleep(delay)
            delay = min(delay * 2, 10.0)

    def prove(self) -> None:
        """Asks what answers at url to prove it holds this client's token (an HMAC of a fresh nonce,
        protocol.server_proof) before the token is sent there: something else on the port (a squatter, another program,
        a server with another token) never receives it, and is refused in one line (FeedbackServerError). A connection
        that fails propagates, for the caller to retry."""
        import urllib.error
        import urllib.request

        nonce = secrets.token_urlsafe(24)
        try:
            with urllib.request.urlopen(f"{self.url}{protocol.SERVER_PROOF}?nonce={nonce}", timeout=self.timeout) as response:
                proof = json.loads(response.read()).get("proof")
        except urllib.error.HTTPError:  # an HTTP answer, but no proof
            proof = None
        except (ValueError, AttributeError):  # not the JSON object a feedback server answers
            proof = None
        if not (isinstance(proof, str) and hmac.compare_digest(proof, protocol.server_proof(self.token, nonce))):
            raise FeedbackServerError(
                f"something answers at {self.url} that cannot prove it holds this run's token (not this run's feedback server, "
                "or one with another token); the token was not sent: stop what listens there, or use another --feedback-server-url"
            )
        self.proven = True

    def alive(self) -> bool:
        """Whether a server answers at this URL; FeedbackServerError if it refuses this client's token, or cannot prove
        it holds it."""
        try:
            self.request("GET", protocol.CONFIG, retry=False)
            return True
        except FeedbackServerUnreachable:
            return False

    def login_link(self) -> tuple[str, float]:
        """A one-time login link for a browser, and the seconds within which it works."""
        reply = self.request("POST", protocol.LOGIN_CODES, json_body={})
        return self.url + reply["url"], float(reply["expires_seconds"])

    def create_run(self, name: str, env_id: str, meta: dict) -> int:
        return int(self.request("POST", protocol.RUNS, json_body={"name": name, "env_id": env_id, "meta": meta})["run_id"])

    def upload_queries(self, run_id: int, queries: list[dict], clips: dict[str, Path]) -> list[int]:
        return self.request(
            "POST", protocol.path(protocol.RUN_QUERIES, run_id=run_id), fields={"queries": json.dumps(queries)}, files=clips
        )["query_ids"]

    def answers(self, run_id: int, after: int, retry: bool = True) -> tuple[list[dict], int]:
        reply = self.request("GET", f"{protocol.path(protocol.RUN_ANSWERS, run_id=run_id)}?after={after}", retry=retry)
        return reply["answers"], int(reply["cursor"])

    def upload_evaluations(self, run_id: int, evaluations: list[dict], clips: dict[str, Path]) -> None:
        self.request(
            "POST", protocol.path(protocol.RUN_EVALUATIONS, run_id=run_id), fields={"evaluations": json.dumps(evaluations)}, files=clips
        )

    def report_progress(self, run_id: int, report: dict, retry: bool = True) -> dict:
        """The server's reply: its label_seq is the last label write before the report was stored."""
        return self.request("POST", protocol.path(protocol.RUN_PROGRESS, run_id=run_id), json_body=report, retry=retry)


def start_feedback_server(url: str, log_path: Path, token: str, data_dir: Path | None = None):
    """Starts the feedback server (the installed humanFeedback package, as `python -m humanFeedback.feedback_server`)
    with `token` on the URL's port unless a server that takes the token already answers there; its database and clips
    go to data_dir (default: feedback_data in the current directory). The server stops when this process ends, also
    when it is killed (--exit-with-parent)."""
    import subprocess
    from urllib.parse import urlparse

    need(bool(token), "start_feedback_server needs a token: a server is never started without one")
    client = FeedbackClient(url, token)
    if client.alive():
        return None
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", str(parsed.port or 5001)
    command = [sys.executable, "-m", "humanFeedback.feedback_server", "--host", host, "--port", port, "--exit-with-parent"]
    if data_dir is not None:
        command += ["--data-dir", str(data_dir)]
    env = {key: value for key, value in os.environ.items() if key != protocol.TOKEN_ENV}
    env[protocol.TOKEN_ENV] = token  # not --token: a command line is visible to every user in ps
    log_path.parent.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(command, stdout=open(log_path, "a"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 30
    while not client.alive():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise FeedbackServerError(f"the feedback server did not start on {url}; see {log_path}")
        time.sleep(0.2)
    return process


class SessionInterrupted(KeyboardInterrupt):
    """Ctrl-C while people were labelling: carries the answers given so far, with their annotators."""

    def __init__(self, labels: np.ndarray, annotators: list[str]):
        super().__init__()
        self.labels, self.annotators = labels, annotators


class Teacher(Protocol):
    """Whoever labels a run's pairs: the synthetic teacher (SyntheticTeacher), people (HumanTeacher) or an earlier run's
    labels (FileTeacher). `make_teacher` is the one place that picks one, by --teacher-feedback-mode; the training loop
    only ever talks to this interface. A teacher subclasses it to take the defaults of what it does not need (progress
    reports, clips for the page, later changes of its answers, closing)."""

    labels_are_free: bool
    """asking costs nothing (the synthetic teacher): held-out accuracy is measured on fresh pairs, not on the budget"""
    people_answer: bool = False
    """the labels come from people: the time the trainer waits for them is measured, each session is checkpointed as
    soon as its labels are in (a killed run must not lose people's work), and they are shown the reward model's ranking"""

    def label(self, segments: dict, session: int) -> tuple[np.ndarray, list[str]]:
        """Labels of the pairs in `segments` (N,): 1 = segment 1 preferred, 0 = segment 0, 0.5 = tie, nan = skipped;
        and who gave each."""
        ...

    def training_progress(self, step: int, sessions_done: int, sessions_total: int) -> None:
        """Called by the training loop every step: where training is, for a teacher that tells people (best effort,
        never waits)."""

    def show_reward_check(self, states, masks, predicted_returns, step: int, segment_ids=None, subsets=()) -> None:
        """Segments with the reward model's predicted return, for people to compare with their own ranking (and, with
        `subsets`, to reorder as labels)."""

    def show_evaluation(self, states: np.ndarray, step: int, mean_return: float) -> None:
        """The simulator states of an evaluation's first episode, for people to see what the agent does now."""

    def show_agreement(self, pairs: list[tuple[int, int]], agree: np.ndarray) -> None:
        """Whether the reward model prefers what was preferred, for each labelled pair (session, index) so far."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def session_measures(self) -> dict[str, float]:
        """What the teacher measured about the answers of the session just learned from, logged under feedback/ (e.g.
        how often people agreed with --teacher-objective); empty by default."""
        return {}

    def pair_ids(self, session: int, count: int) -> list[int | None]:
        """Where each of a session's pairs lives at its source (the feedback server's query id), kept in the label log
        beside its label; None where the teacher has no such place."""
        return [None] * count

    def latest_labels(self, pairs: list[tuple[int, int]]) -> tuple[np.ndarray, list[str]] | None:
        """The labels given now to pairs (session, index) of sessions already learned from, and who gave them (nan: no
        answer now, or a skip): people change their minds. None: this teacher's labels never change once given."""
        return None

    def stop_learning(self) -> bool:
        """The run reads no answer after this (its end): a teacher that tells people says so before the last read.
        Returns whether the run has finished (an answer given from now on is not learned by it)."""
        return False

    def close(self) -> None:
        pass


class HumanTeacher(Teacher):
    """Asks people: renders each pair from its simulator states and uploads it as soon as it is encoded
    (a background thread stays ahead of the labeller), then waits for every answer of the session (`label`), or
    returns at once and is asked for the answers given so far now and then (`start`, `poll`, `finish`: --feedback-async).
    The open session's query ids and answers are part of its state, so a resumed run asks the same pairs."""

    labels_are_free = False  # every label costs a person's time: held-out accuracy costs labels
    people_answer = True

    def __init__(
        self,
        client: FeedbackClient,
        run_id: int,
        renderer: SegmentRenderer,
        clip_dir: Path,
        fps: int,
        cursor: int = 0,
        poll_seconds: float = 0.25,
        server_process=None,
        pair_log: Path | None = None,
        objective_returns=None,
        restart_server=None,
        rating_scale: int = 0,
    ):
        self.client, self.run_id, self.renderer, self.clip_dir, self.fps = client, run_id, renderer, clip_dir, fps
        self.rating_scale = rating_scale  # 0: its queries are compared or ranked; else each clip is rated 1 .. it
        # runs/<run>/shown_pairs.jsonl: one line per uploaded pair (query id, segment ids, env returns and, with
        # --teacher-objective, the objective's returns), so what people answered can be set against what they saw.
        self.pair_log, self.objective_returns = pair_log, objective_returns  # segments -> (N, 2) objective returns
        self.shown: dict[int, list[float]] = {}  # query id -> the objective's [left, right] returns (with an objective)
        self.measured_query_ids: list = []  # the query ids of the latest session that started (session_measures)
        self.cursor, self.poll_seconds = cursor, poll_seconds
        self.server_process = server_process  # the feedback server this teacher started, stopped with it
        self.restart_server = restart_server  # () -> a new server process, on the same data: when the one it started dies
        self.logged_pairs = set()  # query ids in shown_pairs.jsonl: a resumed run logs each pair once
        if pair_log is not None and pair_log.is_file():
            self.logged_pairs = {json.loads(line)["query_id"] for line in pair_log.read_text().splitlines() if line.strip()}
        self.answers: dict[int, dict] = {}  # query id -> latest answer (an undone one removed); kept in the checkpoint
        self.pair_query: dict[tuple[int, int], int] = {}  # (session, pair) -> query id of every pair uploaded
        # (-check step, subset) -> the check clips' positions a label of a person's reorder of that check orders
        self.check_subsets: dict[tuple[int, int], tuple[int, ...]] = {}
        self.open: dict | None = None  # the open session: {"session": n, "query_ids": [id or None per pair]}
        self.worker, self.stop_upload, self.upload_errors = None, threading.Event(), []
        self.render_lock = threading.Lock()  # one renderer: the pairs' upload thread and the page worker take turns
        self.page_jobs: queue.Queue = queue.Queue()  # clips for the page (reward checks, evaluations), rendered off the loop
        self.page_worker = threading.Thread(target=self._show_on_page, daemon=True)
        self.page_worker.start()
        # The trainer's news for the page (report_progress): when sessions come, how fast steps go, the last sent.
        self.total_steps, self.first_session_step, self.session_frequency = 0, 0, 1
        self.step, self.sessions_done, self.sessions_total = 0, 0, 0
        self.progress_client = FeedbackClient(client.url, client.token, retry_seconds=0, timeout=2.0)
        client.on_outage = self.progress_client.on_outage = self.server_away
        self.outage_said = -float("inf")  # when the terminal last heard of an outage (once a minute is enough)
        self.outage_lock = threading.Lock()
        self.next_report, self.reporter, self.rate_mark, self.steps_per_second = 0.0, None, None, None
        self.agreement: dict[str, float] = {}  # annotator -> share of their labels the reward model agrees with
        # the last label write the run reads (set when it tells the server it has finished: what the page tells a person
        # who answers later, "not learned by this run", stays true); None: every one
        self.read_until: int | None = None

    progress_seconds = 5.0  # the trainer reports its progress to the server at most this often

    def training_progress(self, step: int, sessions_done: int, sessions_total: int) -> None:
        """Tells the server the step and roughly when the next session comes, so the page can say so between
        sessions. Costs a clock read per step."""
        self.step, self.sessions_done, self.sessions_total = step, sessions_done, sessions_total
        if time.monotonic() >= self.next_report:
            self.report_progress("training")

    def report_progress(self, phase: str, **extra) -> None:
        """Best effort and never blocking: the report is posted from a thread, without retries and with a 2 s timeout;
        none is sent while the previous one is still on its way, and a server that is away changes nothing here."""
        now = time.monotonic()
        self.next_report = now + self.progress_seconds
        if phase == "training" and self.rate_mark is not None and now > self.rate_mark[1] and self.step > self.rate_mark[0]:
            rate = (self.step - self.rate_mark[0]) / (now - self.rate_mark[1])
            self.steps_per_second = rate if self.steps_per_second is None else 0.5 * self.steps_per_second + 0.5 * rate
        self.rate_mark = (self.step, now) if phase == "training" else None  # time in a session is not training speed
        if self.reporter is None or not self.reporter.is_alive():
            self.reporter = threading.Thread(target=self._send_report, args=(self.progress_report(phase) | extra,), daemon=True)
            self.reporter.start()

    def progress_report(self, phase: str) -> dict:
        report = {"step": int(self.step), "phase": phase, "total_steps": int(self.total_steps), "sessions_done": int(self.sessions_done)}
        report["sessions_total"] = int(self.sessions_total)
        if self.sessions_done < self.sessions_total:
            next_step = max(int(self.step), self.first_session_step + self.sessions_done * self.session_frequency)
            report["next_session_step"] = next_step
            if self.steps_per_second:
                report["seconds_to_next_session"] = round((next_step - self.step) / self.steps_per_second, 1)
        if self.steps_per_second:
            report["steps_per_second"] = round(self.steps_per_second, 2)
        if self.agreement:
            report["agreement"] = self.agreement
        return report

    def _send_report(self, report: dict) -> None:
        try:
            self.progress_client.report_progress(self.run_id, report, retry=False)
        except Exception:  # noqa: BLE001 (news for the page; training goes on whatever happened to it)
            pass

    def render_clip(self, name: str, states: np.ndarray, mask: np.ndarray) -> Path:
        """A clip in clip_dir, written under a temporary name first: a clip of that name already there is complete, and
        is reused (a resumed session re-sends the bytes the server may already hold, which it accepts only unchanged)."""
        path = self.clip_dir / name
        with self.render_lock:  # one renderer (one GL context): the upload thread and the reward check take turns
            if not path.exists():
                partial = path.with_name(f".{name}.part.mp4")
                write_mp4(partial, segment_frames(self.renderer, states, mask), self.fps)
                os.replace(partial, path)
        return path

    def _render_and_upload(self, segments: dict, session: int, query_ids: list, stop: threading.Event, errors: list) -> None:
        """The upload thread: pair i's clips, then its query, in order, until every pair is up or `stop` is set."""
        try:
            env_returns = segments["true_rewards"].sum(-1).tolist() if "true_rewards" in segments else None  # (N, 2)
            objective = None if self.objective_returns is None else np.asarray(self.objective_returns(segments)).tolist()
            for i, segment_ids in enumerate(segments["segment_ids"].tolist()):
                if stop.is_set():
                    return
                if query_ids[i] is not None:  # uploaded before the run was resumed (and logged then)
                    self.pair_query[(session, i)] = query_ids[i]
                    if objective is not None:
                        self.shown[query_ids[i]] = objective[i]
                    continue
                stem = f"run{self.run_id}_s{session}_q{i}_" + "_".join(map(str, segment_ids))
                sides = ("left", "right") if len(segment_ids) == 2 else [f"clip{k}" for k in range(len(segment_ids))]
                clips = [
                    self.render_clip(f"{stem}_{side}.mp4", segments["physics_states"][i, k], segments["masks"][i, k])
                    for k, side in enumerate(sides)
                ]
                query = query_entry([clip.name for clip in clips], segment_ids, session, self.rating_scale)
                query_ids[i] = self.client.upload_queries(self.run_id, [query], {path.name: path for path in clips})[0]
                self.pair_query[(session, i)] = query_ids[i]
                pair_returns = None if env_returns is None else env_returns[i]
                self.log_shown_pair(query_ids[i], session, i, query, pair_returns, None if objective is None else objective[i])
        except BaseException as error:  # reported by the waiting thread
            errors.append(error)

    def log_shown_pair(self, query_id: int, session: int, pair: int, query: dict, env_returns: list | None, objective: list | None) -> None:
        if objective is not None:
            self.shown[query_id] = objective
        if self.pair_log is None or query_id in self.logged_pairs:  # a resumed run uploads the same pair again: logged once
            return
        self.logged_pairs.add(query_id)
        line = {"query_id": query_id, "session": session, "pair": pair}
        if "clips" in query:  # a ranking: each clip's, in the order shown
            line["segment_ids"] = query["segment_ids"]
            line |= {} if env_returns is None else {"env_returns": env_returns}
            line |= {} if objective is None else {"objective_returns": objective}
        else:
            line |= {"left_segment_id": query["left_segment_id"], "right_segment_id": query["right_segment_id"]}
            if env_returns is not None:
                line |= {"left_env_return": env_returns[0], "right_env_return": env_returns[1]}
            if objective is not None:
                line |= {"left_objective_return": objective[0], "right_objective_return": objective[1]}
        with open(self.pair_log, "a") as log:  # one line per write: a reader never sees half a pair
            log.write(json.dumps(line) + "\n")

    def session_measures(self) -> dict[str, float]:
        """With --teacher-objective: the share of the latest session's left/right answers that prefer the clip with the
        higher objective return (pairs the objective ties, ties and skips left out), a person's agreement with what the
        objective says they want."""
        agree = [
            (self.answers[qid]["choice"] == "right") == (self.shown[qid][1] > self.shown[qid][0])
            for qid in self.measured_query_ids
            if qid in self.answers and qid in self.shown
            if self.answers[qid]["choice"] in ("left", "right") and self.shown[qid][0] != self.shown[qid][1]
        ]
        return {"objective_agreement": float(np.mean(agree))} if agree else {}

    def _read_new_answers(self, retry: bool = True) -> None:
        # Without retries (--feedback-async, Ctrl-C) also with the progress client's 2 s timeout: a hung server never
        # holds training up for the main client's 30 s.
        client = self.client if retry else self.progress_client
        new, self.cursor = client.answers(self.run_id, self.cursor, retry)
        if self.read_until is not None:  # the run has finished: later answers were told they are not learned
            new, self.cursor = [a for a in new if a["seq"] <= self.read_until], min(self.cursor, self.read_until)
        for answer in new:
            if answer["choice"] == "undone":
                self.answers.pop(answer["query_id"], None)
            else:
                self.answers[answer["query_id"]] = answer

    def label(self, segments: dict, session: int) -> tuple[np.ndarray, list[str]]:
        count = len(segments["segment_ids"])
        self.rate_mark = None  # the time people take is not training speed
        query_ids = self.start(segments, session)
        try:
            with stoppable_at_once():  # people may take minutes: Ctrl-C keeps their answers and the session open
                said = ""
                while True:
                    labels, annotators, answered = self.poll()
                    uploaded = sum(q is not None for q in query_ids)
                    if (news := f"\rfeedback session {session}: {answered.sum()}/{count} answered, {uploaded} uploaded") != said:
                        print(news, end="", flush=True)  # when it changes: a log file gets a line per answer, not per poll
                        said = news
                    if answered.all():
                        break
                    time.sleep(self.poll_seconds)
        except KeyboardInterrupt:
            self.stop_upload.set()
            with contextlib.suppress(Exception):  # answers given just before Ctrl-C, if the server answers at once
                self._read_new_answers(retry=False)
            raise SessionInterrupted(*self._labels_of(query_ids)) from None
        except BaseException:
            self.stop_upload.set()
            raise
        print()
        self.finish()
        self.report_progress("updating", session=session)  # the reward model learns from the answers; the loop reports next
        self.next_report = 0.0
        return labels, annotators

    def start(self, segments: dict, session: int) -> list:
        """Uploads the session's pairs from a background thread and returns at once: their query ids, None until
        uploaded. A session already open with this number (a resumed run's, from the checkpoint) keeps its query ids
        and answers: only pairs not uploaded yet are sent, so people are asked nothing twice."""
        count = len(segments["segment_ids"])
        if self.open is None or self.open["session"] != session or len(self.open["query_ids"]) != count:
            self.open = {"session": session, "query_ids": [None] * count}
        # The session's size before its first pair, so the page says "pair k of <count>" while the pairs upload (one
        # try with the progress client's 2 s timeout: with --feedback-async the trainer never waits long on a hung
        # server; without the size the page counts uploads).
        with contextlib.suppress(FeedbackServerError):
            report = self.progress_report("labelling") | {"session": session, "session_size": count}
            self.progress_client.report_progress(self.run_id, report, retry=False)
        if self.worker is None or not self.worker.is_alive():
            self.stop_upload, self.upload_errors = threading.Event(), []
            upload = (segments, session, self.open["query_ids"], self.stop_upload, self.upload_errors)
            self.worker = threading.Thread(target=self._render_and_upload, args=upload, daemon=True)
            self.worker.start()
        return self.open["query_ids"]

    def poll(self, retry: bool = True) -> tuple[np.ndarray, list[str], np.ndarray]:
        """Reads the answers given since the last read (retry=False: one request, FeedbackServerUnreachable if the
        server does not answer). Returns the open session's labels (nan: skipped or not answered), annotators and a
        mask of the pairs answered."""
        if self.upload_errors:
            raise self.upload_errors[0]
        self._read_new_answers(retry)
        query_ids = self.open["query_ids"]
        labels, annotators = self._labels_of(query_ids)
        return labels, annotators, np.array([qid is not None and qid in self.answers for qid in query_ids])

    def pair_ids(self, session: int, count: int) -> list[int | None]:
        return [self.pair_query.get((session, i)) for i in range(count)]

    def server_away(self, failure: str) -> None:
        """A request found the server away: the one this run started is started again on the same data (nothing a
        person gave is lost, and the page works again as soon as it answers); another is waited for, on the terminal."""
        with self.outage_lock:  # the training loop, the upload thread and the page worker may all find it away
            if time.monotonic() - self.outage_said < 60:
                return
            self.outage_said = time.monotonic()
            self._after_outage(failure)

    def _after_outage(self, failure: str) -> None:
        if self.server_process is not None and self.server_process.poll() is not None and self.restart_server is not None:
            print(f"\nfeedback server: the server this run started stopped (exit code {self.server_process.returncode}); starting it again")
            try:
                self.server_process = self.restart_server()
                print(f"feedback server: answering again at {self.client.url}/; labels given so far are kept", flush=True)
            except FeedbackServerError as error:
                print(f"feedback server: could not start it again ({error}); the run keeps asking", flush=True)
            return
        print(f"\nfeedback server: {self.client.url} does not answer ({failure}); the run asks again and again, and keeps "
              "every label it has", flush=True)  # fmt: skip

    def latest_labels(self, pairs: list[tuple[int, int]]) -> tuple[np.ndarray, list[str]] | None:
        """The answers now on the server (one request without retries; None when it does not answer, so that nothing
        is taken for undone while the server is away)."""
        try:
            self._read_new_answers(retry=False)
        except FeedbackServerError:
            return None
        return self._labels_of([self.pair_query.get(pair) for pair in pairs], pairs)

    def finish(self) -> None:
        """The open session is answered: its upload thread (done by now) is told to stop, and the session closed."""
        self.measured_query_ids = list(self.open["query_ids"]) if self.open else []
        self.stop_upload.set()
        self.open = None

    def _labels_of(self, query_ids: list, pairs: list | None = None) -> tuple[np.ndarray, list[str]]:
        """The latest answers' labels of `query_ids` (nan: none); of a reorder of the check, the label of each pair's
        subset of its clips (reorder_label)."""
        labels, annotators = np.full(len(query_ids), np.nan, dtype=np.float32), [""] * len(query_ids)
        for i, qid in enumerate(query_ids):
            if qid is not None and qid in self.answers:
                answer, subset = self.answers[qid], self.check_subsets.get(pairs[i]) if pairs else None
                label = answer_label(answer, self.rating_scale) if subset is None else reorder_label(answer, subset)
                labels[i], annotators[i] = label, answer["annotator"]
        return labels, annotators

    EVALUATION_CLIP_STEPS = 300  # steps of an evaluation episode's start shown on the page (Hopper: 2.4 s)

    def show_reward_check(self, states, masks, predicted_returns, step: int, segment_ids=None, subsets=()) -> None:
        """Clips with the reward model's predicted return, shown ranked on the page's reward view: a person can compare
        the model's ranking with their own (states (N, L, S), masks (N, L)). Rendered and uploaded by the page worker:
        training goes on meanwhile. With `subsets` (the clips' positions each label of a reorder orders, one key
        (-step, i) each) the clips also go up as a query a person may reorder from that view (segment ids (N,))."""
        names = [f"run{self.run_id}_check_{step}_{i}.mp4" for i in range(len(states))]
        reorder = None
        if subsets:
            self.check_subsets |= {(-step, i): tuple(positions) for i, positions in enumerate(subsets)}
            reorder = {"segment_ids": [int(segment) for segment in segment_ids], "pairs": len(subsets)}
        clips = [*zip(names, states, masks, map(float, predicted_returns), strict=True)]
        self.page_jobs.put((clips, step, "check", reorder))

    def show_evaluation(self, states: np.ndarray, step: int, mean_return: float) -> None:
        """The start of an evaluation episode beside the pairs: what the agent does now (the page worker renders it)."""
        states = states[: self.EVALUATION_CLIP_STEPS]
        self.page_jobs.put(([(f"run{self.run_id}_eval_{step}.mp4", states, np.ones(len(states), bool), mean_return)], step, "agent", None))

    def show_agreement(self, pairs: list[tuple[int, int]], agree: np.ndarray) -> None:
        """Each person's share of labels the reward model agrees with, on the page's run panel (the next progress news)."""
        people = [self.answers.get(self.pair_query.get(pair), {}).get("annotator") for pair in pairs]
        shares = {person: float(np.mean([a for a, p in zip(agree, people) if p == person])) for person in set(people) if person}
        self.agreement, self.next_report = shares, 0.0

    def _show_on_page(self) -> None:
        """The page worker: renders and uploads each job in order, while the training loop runs on (a job the server
        refuses or an unreachable server costs the page a clip, never the run)."""
        while (job := self.page_jobs.get()) is not None:
            clips, step, kind, reorder = job
            try:
                paths = {name: self.render_clip(name, states, mask) for name, states, mask, _ in clips}
                entries = [{"clip": name, "predicted_return": value, "step": step, "kind": kind} for name, _, _, value in clips]
                self.client.upload_evaluations(self.run_id, entries, paths)
                if reorder:  # the same clips as a query to reorder; its labels are read as the pairs' (check_subsets)
                    query = {"clips": list(paths), "segment_ids": reorder["segment_ids"], "session": f"check-{step}", "check_step": step}
                    (query_id,) = self.client.upload_queries(self.run_id, [query], paths)
                    self.pair_query |= {(-step, i): query_id for i in range(reorder["pairs"])}
            except Exception as error:  # noqa: BLE001 (the page's news: training goes on whatever happened to it)
                what = "an evaluation clip" if kind == "agent" else "a reward-check clip"
                print(f"feedback server: {what} of step {step} did not reach the page ({error})", flush=True)
            finally:
                self.page_jobs.task_done()

    def state_dict(self) -> dict:
        """The answers cursor, the open session's query ids, every uploaded pair's query id and the answers read (a
        resumed run sees later changes to earlier sessions' answers against them)."""
        opened = None if self.open is None else {"session": self.open["session"], "query_ids": list(self.open["query_ids"])}
        pairs = [[session, index, qid] for (session, index), qid in self.pair_query.items()]
        state = {"cursor": self.cursor, "open": opened, "answers": copy.deepcopy(self.answers), "pairs": pairs}
        state["check_subsets"] = [[session, index, list(positions)] for (session, index), positions in self.check_subsets.items()]
        return state | {"step": int(self.step), "sessions_done": int(self.sessions_done)}  # a resumed run's first news

    def load_state_dict(self, state: dict) -> None:
        self.cursor, self.open = state["cursor"], copy.deepcopy(state.get("open"))
        self.step, self.sessions_done = state.get("step", 0), state.get("sessions_done", 0)
        self.answers = copy.deepcopy(state.get("answers", {}))
        self.pair_query = {(session, index): qid for session, index, qid in state.get("pairs", [])}
        self.check_subsets = {(session, index): tuple(positions) for session, index, positions in state.get("check_subsets", [])}

    def stop_learning(self) -> bool:
        """The last news before the last read of answers: the run has ended (an answer given now is not learned from),
        or stopped before its end (its resume will learn it); the page says which when a person changes an answer. A
        finished run reads answers up to that news and no further (read_until). Said once."""
        finished = bool(self.total_steps) and self.step >= self.total_steps
        if self.next_report == float("inf"):
            return finished
        self.next_report = float("inf")
        with contextlib.suppress(Exception):
            report = self.progress_report("finished" if finished else "stopped")
            reply = self.progress_client.report_progress(self.run_id, report, retry=False)
            if finished:
                self.read_until = int(reply["label_seq"])
        return finished

    def close(self) -> None:
        self.stop_learning()
        self.page_jobs.put(None)
        self.page_worker.join(timeout=60)  # the last clips reach the page, unless the server keeps them waiting
        self.renderer.close()
        if self.server_process is not None:
            self.server_process.terminate()
            self.server_process.wait(timeout=10)


class FileTeacher(Teacher):
    """Replays the labelled pairs of an earlier run's labels.sqlite, in the order they were obtained. It answers
    with its recorded pairs, not with the pairs this run selected: `label` replaces the arrays of `segments` in
    place with the next recorded ones (fewer once the file runs out), so that what is stored matches the labels."""

    labels_are_free = False  # the file holds a fixed number of labels

    def __init__(self, path: str | Path):
        self.segments, self.labels = read_label_file(path)
        self.position = 0

    def label(self, segments: dict, session: int) -> tuple[np.ndarray, list[str]]:
        start, stop = self.position, min(self.position + len(segments["segment_ids"]), len(self.labels))
        self.position = stop
        segments.update({name: values[start:stop] for name, values in self.segments.items()})
        segments["segment_ids"] = np.full((stop - start, segments["segment_ids"].shape[1]), -1)  # not this run's
        return self.labels[start:stop], ["file"] * (stop - start)

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


class LabelLog:
    """Every label a run obtains, with its segments, in runs/<run>/labels.sqlite, so a later run can train from it:
    --teacher-feedback-mode file --feedback-file PATH. Each label has a key, its session and a hash of its pair's
    segments (the same bytes when a resumed run gathers them again from its saved replay buffer): writing a label again
    (a resumed run re-reads the server's answers, or redoes a session it had not checkpointed) adds nothing. A file of
    an older version gets the keys when opened, and loses the duplicates older resumes wrote."""

    ARRAYS = ("obs_actions", "masks", "true_rewards", "physics_states")

    def __init__(self, path: Path, rating_scale: int = 0):
        import sqlite3

        self.rating_scale = rating_scale  # each row's: 0, compared or ranked; else its clips' ratings

        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(path)
        self.db.execute("PRAGMA journal_mode=WAL")
        with self.db:
            self.db.execute(
                "CREATE TABLE IF NOT EXISTS labels (id INTEGER PRIMARY KEY, global_step INTEGER, session INTEGER, label REAL, annotator TEXT,"
                " obs_actions BLOB, masks BLOB, true_rewards BLOB, physics_states BLOB, shapes TEXT, pair_key TEXT, query_id INTEGER)"
            )
            columns = [row[1] for row in self.db.execute("PRAGMA table_info(labels)")]
            if "pair_key" not in columns:
                self.migrate()
            if "query_id" not in columns:  # the feedback server's query of each person's label
                self.db.execute("ALTER TABLE labels ADD COLUMN query_id INTEGER")
            if "rating_scale" not in columns:  # the scale a label's ratings are on (0: compared or ranked)
                self.db.execute("ALTER TABLE labels ADD COLUMN rating_scale INTEGER NOT NULL DEFAULT 0")
            self.db.execute("CREATE UNIQUE INDEX IF NOT EXISTS labels_pair_key ON labels (pair_key)")

    @staticmethod
    def key(session: int, obs_actions: bytes, masks: bytes) -> str:
        import hashlib

        return f"{session}:{hashlib.sha256(obs_actions + masks).hexdigest()}"

    def migrate(self) -> None:
        """A labels.sqlite of an older version: adds the key column and fills it; a row repeating an earlier one of
        the same session (a resume's duplicate) is dropped."""
        self.db.execute("ALTER TABLE labels ADD COLUMN pair_key TEXT")
        rows = self.db.execute("SELECT id, session, obs_actions, masks FROM labels ORDER BY id").fetchall()
        seen = set()
        for row_id, session, obs_actions, masks in rows:
            key = self.key(session, obs_actions, masks)
            if key in seen:
                self.db.execute("DELETE FROM labels WHERE id = ?", (row_id,))
            else:
                seen.add(key)
                self.db.execute("UPDATE labels SET pair_key = ? WHERE id = ?", (key, row_id))

    def append(self, segments: dict, labels: np.ndarray, annotators: list[str], session: int, global_step: int, query_ids=None) -> None:
        """A session's pairs with labels (N,): those not nan (skipped or not answered) are written in one transaction,
        each once, with the feedback server's query id where the labels are people's (query_ids, N)."""
        rows = []
        for i in np.flatnonzero(~np.isnan(labels)):
            arrays = {name: np.ascontiguousarray(segments[name][i]) for name in self.ARRAYS}
            shapes = json.dumps({name: [list(a.shape), str(a.dtype)] for name, a in arrays.items()})
            blobs = [a.tobytes() for a in arrays.values()]
            query = None if query_ids is None else query_ids[i]
            key = self.key(session, *blobs[:2])
            rows.append((global_step, session, float(labels[i]), annotators[i], *blobs, shapes, key, query, self.rating_scale))
        with self.db:
            self.db.executemany(
                "INSERT OR IGNORE INTO labels (global_step, session, label, annotator, obs_actions, masks, true_rewards, physics_states,"
                " shapes, pair_key, query_id, rating_scale) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                rows,
            )

    def correct(self, session: int, obs_actions: np.ndarray, masks: np.ndarray, label: float, annotator: str) -> None:
        """The label of a recorded pair changed: its new value, or (label nan: the answer was taken back) no row."""
        key = self.key(session, np.ascontiguousarray(obs_actions).tobytes(), np.ascontiguousarray(masks).tobytes())
        with self.db:
            if np.isnan(label):
                self.db.execute("DELETE FROM labels WHERE pair_key = ?", (key,))
            else:
                self.db.execute("UPDATE labels SET label = ?, annotator = ? WHERE pair_key = ?", (float(label), annotator, key))

    def close(self) -> None:
        self.db.close()


class FeedbackSession:
    """The feedback session in progress: its pairs, the answers in so far, which of them the preference buffer holds,
    and the time the trainer and people spent waiting for each other. Part of every checkpoint, so that a resumed run
    finishes an open session with the same pairs. The record of its answers, the reward update, the relabel and what
    follows them (`with session.update(...)`) form one unit: a checkpoint written inside it holds the training state
    from before it, so the resumed run redoes the update rather than asking the next session early. With
    --feedback-async the next session's pairs can go up before that unit (`stage`), so that people label on while the
    reward model learns; they are checkpointed too, and `take_staged` hands them to `start`."""

    def __init__(self, teacher=None, label_log: "LabelLog | None" = None, args=None):
        self.teacher, self.label_log, self.args = teacher, label_log, args  # whom it asks, where answers go, settings
        self.number, self.segments, self.before = 0, None, None
        self.trainer_idle = self.people_idle = self.session_trainer_idle = 0.0
        self.opened_at = self.completed_at = None
        self.last_answer_at = 0.0  # when the open session last got a new answer (--feedback-async: left, give way)
        self.uploading, self.next_poll = False, 0
        self.staged: dict | None = None  # {"number": n, "segments": ...}: the next session's pairs, already put up
        self.staged_here = False  # staged by this process, whose upload runs; after a resume the teacher is asked again
        self.people_answer = False  # the teacher asked last is people (the time each side waits is measured)
        self.closing = False  # --feedback-async: the open session gives way to the next one, answered or not
        self.corrections = 0  # labels of earlier sessions changed at the last record (people changed their minds)
        self.rows: dict[tuple[int, int], int] = {}  # (session, pair) -> preference-buffer row of each label recorded
        self.unlabelled: dict[tuple[int, int], dict] = {}  # (session, pair) -> arrays of a person's pair without a label
        self.step_wait = self.longest_wait = (-1, 0.0)  # (step, seconds on feedback): the current step's, the longest's
        self.open_labels_kept = 0  # labels of the open session written to the label log when a stop cut it short

    @property
    def open(self) -> bool:
        return self.segments is not None

    def answers_in(self, step: int, last: bool, due: int, choose_pairs) -> bool:
        """Whether the reward model is to learn from the open session's answers now: the teacher is asked (`ask`: a
        synthetic teacher or a file answers at once, people are waited for, or with --feedback-async read now and then
        without waiting, and a resumed half-answered session asks its remaining pairs). `due`: how many sessions' steps
        have come. With --feedback-async a session people left gives way once the next one is due, and once all answers
        are in, the next session's pairs go up if it is due (`choose_pairs(number)`), so that people label them while
        the reward model learns. The time it takes counts as the step's wait on feedback (`waited`), but at the run's
        last step, where the run waits for the open session by design."""
        begun = time.perf_counter()
        try:
            return self._answers_in(step, last, due, choose_pairs)
        finally:
            if not last:
                self.waited(time.perf_counter() - begun, step)

    def waited(self, seconds: float, step: int) -> None:
        """`seconds` of training step `step` spent on feedback (asking, reading answers, putting pairs up): the longest
        step's total is reported with the run (--feedback-async promises it stays short)."""
        so_far = self.step_wait[1] if self.step_wait[0] == step else 0.0
        self.step_wait = (step, so_far + seconds)
        if self.step_wait[1] > self.longest_wait[1]:
            self.longest_wait = self.step_wait

    def _answers_in(self, step: int, last: bool, due: int, choose_pairs) -> bool:
        teacher, args = self.teacher, self.args
        if args.feedback_async and self.number < due and self.left(teacher):
            self.closing = True  # the next session is due: learn from what is in and ask newer pairs (late answers count)
            teacher.finish()
            return True
        if not self.ask(teacher, self.label_log, args, step, last):
            return False
        if self.stages_next(args, last) and self.number < due:
            self.stage(choose_pairs(self.number + 1), self.number + 1, teacher)
        return True

    GIVE_WAY_SECONDS = 60.0  # --feedback-async: a session nobody answered for this long, all its pairs up, gives way

    def left(self, teacher) -> bool:
        """Whether people left the open session: some of its pairs unanswered, though all are on the page, and no new
        answer for GIVE_WAY_SECONDS. People still at work finish it; a session left gives way to the next one when that
        is due, so that someone who comes back finds pairs of the policy as it is now."""
        if self.answered.all() or None in teacher.pair_ids(self.number, len(self.labels)):
            return False
        return time.time() - max(self.opened_at, self.last_answer_at) > self.GIVE_WAY_SECONDS

    def stages_next(self, args, last: bool) -> bool:
        """Whether the next session's pairs are to go up now, before the reward model learns from this session's
        answers (`stage`): with --feedback-async, once all are in (not at the run's last step, and not twice: a resumed
        run redoing the update has them already). The caller adds whether that session exists and is due."""
        return args.feedback_async and not last and bool(self.answered.all()) and self.staged is None

    def stage(self, segments: dict, number: int, teacher) -> None:
        """Puts session `number`'s pairs up now (the teacher uploads them from its thread and returns at once): people
        label them while the trainer updates the reward model, instead of waiting for the update, the selection and the
        first clip."""
        self.staged, self.staged_here = {"number": number, "segments": segments}, True
        teacher.start(segments, number)
        if self.completed_at is not None:  # people waited from the last answer to now only
            self.people_idle, self.completed_at = self.people_idle + time.time() - self.completed_at, None

    def take_staged(self, number: int) -> dict | None:
        """The pairs staged for session `number` (handed out once), or None: the caller selects them then."""
        if self.staged is None or self.staged["number"] != number:
            return None
        segments, self.staged = self.staged["segments"], None
        self.uploading, self.staged_here = self.staged_here, False  # resumed: ask() asks the teacher, who keeps the query ids
        return segments

    def start(self, segments: dict, number: int) -> None:
        """Session `number` asks these pairs (segments: rb.gather_segments); people had nothing to label since the
        previous session's last answer was read (or since the pairs were staged)."""
        count = len(segments["segment_ids"])
        self.number, self.segments, self.annotators = number, segments, [""] * count
        self.labels, self.answered, self.recorded = np.full(count, np.nan, np.float32), np.zeros(count, bool), np.zeros(count, bool)
        self.opened_at, self.session_trainer_idle, self.last_answer_at = time.time(), 0.0, 0.0
        if self.completed_at is not None:
            self.people_idle += self.opened_at - self.completed_at

    def ask(self, teacher, label_log: "LabelLog", args, step: int, last: bool = False) -> bool:
        """Whether the reward model is to learn from the session's answers now. Without --feedback-async (or at the
        run's last step) the teacher is asked for every answer and the trainer waits; Ctrl-C keeps the answers given so
        far in the label log (with their annotators) and the session open in the checkpoint. With --feedback-async the
        pairs are uploaded once and the answers read every --feedback-async-poll-steps steps, never waiting: True once
        all are in, or --feedback-async-update-every new ones."""
        self.people_answer = teacher.people_answer
        if self.answered.all():  # a resumed session whose update was cut short: redo it
            return True
        waited = time.time()
        try:
            if not args.feedback_async or last:
                try:
                    labels, annotators = teacher.label(self.segments, self.number)
                except SessionInterrupted as partial:
                    query_ids = teacher.pair_ids(self.number, len(partial.labels))
                    label_log.append(self.segments, partial.labels, partial.annotators, self.number, step, query_ids)
                    self.open_labels_kept = int(np.count_nonzero(~np.isnan(partial.labels)))
                    raise
                self.labels, self.annotators, self.answered = labels, list(annotators), np.ones(len(labels), bool)
                self.recorded = self.recorded[: len(labels)]  # a file teacher may answer fewer pairs than asked
            else:
                if not self.uploading:
                    teacher.start(self.segments, self.number)
                    self.uploading = True
                if step < self.next_poll:
                    return False
                self.next_poll = step + args.feedback_async_poll_steps
                try:
                    labels, annotators, answered = teacher.poll(retry=False)
                except FeedbackServerUnreachable:  # the server is away: training goes on, the answers are read later
                    return False
                waiting = ~self.recorded  # the latest answer of each pair not learned from yet (an undo takes one back)
                if (answered[waiting] & ~self.answered[waiting]).any():
                    self.last_answer_at = time.time()
                self.labels[waiting], self.answered[waiting] = labels[waiting], answered[waiting]
                self.annotators = [a if wait else old for a, old, wait in zip(annotators, self.annotators, waiting)]
                if self.answered.all():
                    teacher.finish()
        finally:
            if teacher.people_answer:  # time the trainer waited for people (other teachers answer at once)
                waited = time.time() - waited
                self.session_trainer_idle, self.trainer_idle = self.session_trainer_idle + waited, self.trainer_idle + waited
        if self.answered.all():
            self.completed_at = time.time()
        return self.answered.all() or 0 < args.feedback_async_update_every <= (self.answered & ~self.recorded).sum()

    @contextlib.contextmanager
    def update(self, parts: dict, rng, loop):
        """The unit of record + reward update + relabel: until it ends, `rollback()` is the training state from before
        it (parts' states but the teacher's, which keeps the answers it read; the RNGs; the loop's counters)."""
        self.before = copy.deepcopy(training_state({k: v for k, v in parts.items() if k != "teacher"}, rng) | {"loop": asdict(loop)})
        with stoppable_at_once():  # it may take minutes, and the checkpoint sets it aside exactly: Ctrl-C stops it at once
            yield
        self.before = None
        if self.answered.all() or self.closing:
            self.segments, self.uploading, self.next_poll, self.closing = None, False, 0, False

    def rollback(self) -> dict:
        """What a checkpoint written now takes instead of the live training state: the state from before the running
        update, or nothing."""
        return self.before or {}

    def reconcile(self, teacher, prefs, label_log: "LabelLog", loop, heldout_fraction: float, rng) -> int:
        """Brings the preference buffer and the label log to the teacher's latest answers for the pairs of sessions
        already learned from: an edited answer replaces its label, one taken back (undone) takes its label out (the
        pair is kept, should it be answered again), and a pair skipped or undone that has an answer now goes in.
        Returns how many labels changed; a teacher whose labels never change (latest_labels None) changes none."""
        pairs = [*self.rows, *self.unlabelled]
        latest = teacher.latest_labels(pairs) if pairs else None
        if latest is None:
            return 0
        labels, annotators = latest
        changed, dropped, added = 0, [], []
        for pair, label, annotator in zip(pairs, labels, annotators):
            row = self.rows.get(pair)
            if row is None:
                if not np.isnan(label):
                    added.append((pair, label, annotator))
                continue
            if np.isnan(label) or label != prefs.labels[row]:
                label_log.correct(pair[0], prefs.obs_actions[row], prefs.masks[row], label, annotator)
                changed += 1
            if np.isnan(label):
                dropped.append(pair)
            elif label != prefs.labels[row]:
                prefs.labels[row] = label
        if dropped:
            self.drop(dropped, prefs)
        for pair, label, annotator in added:
            arrays = self.unlabelled.pop(pair)
            heldout = np.array([rng.random() < heldout_fraction])
            prefs.add(*(arrays[name][None] for name in LabelLog.ARRAYS), np.array([label], np.float32), heldout, loop.global_step)
            self.rows[pair] = len(prefs) - 1
            single = {name: arrays[name][None] for name in LabelLog.ARRAYS}
            label_log.append(single, np.array([label]), [annotator], pair[0], loop.global_step, teacher.pair_ids(pair[0], pair[1] + 1)[-1:])
        loop.labels_obtained += len(added) - len(dropped)
        return changed + len(added)

    def settle(self, teacher, prefs, label_log: "LabelLog", loop, heldout_fraction: float, rng) -> bool:
        """At the run's end: people's latest answers into the label log and the preference buffer (reconcile), and one
        line saying whether the run keeps the labels the feedback server has. A finished run reads the answers given up
        to the moment it told the server so (what the page told each person, learned or not, is what happens) and
        returns whether they changed its labels since its last reward update: the caller then fits the reward model once
        more and saves it, so that the final model learns them."""
        if not self.people_answer:
            return False
        finished = teacher.stop_learning()
        changed = self.reconcile(teacher, prefs, label_log, loop, heldout_fraction, rng)
        latest = teacher.latest_labels(list(self.rows))
        open_kept = f" ({self.open_labels_kept} of the open session, which --resume finishes)" if self.open_labels_kept else ""
        kept = f"{len(self.rows) + self.open_labels_kept} labels{open_kept}"
        if latest is None:
            print(f"labels: the run keeps {kept}; the feedback server did not answer at the end, toolbox/labels.py check "
                  "<run folder> compares them later")  # fmt: skip
        else:
            differ = [pair for pair, label in zip(self.rows, latest[0]) if label != prefs.labels[self.rows[pair]]]
            print(f"labels: the run keeps {kept}, each as the feedback server has it" if not differ else
                  f"labels: {len(differ)} of the run's {kept} differ from the feedback server's; toolbox/labels.py check names them")  # fmt: skip
        if finished and changed:
            print(f"labels: {changed} changed after the last reward update; the reward model learns them in one more fit")
        return finished and changed > 0

    def drop(self, pairs: list[tuple[int, int]], prefs) -> None:
        """Takes the labels of `pairs` out of the preference buffer, keeping each pair's arrays (unlabelled)."""
        rows = np.array(sorted(self.rows[pair] for pair in pairs))
        for pair in pairs:
            row = self.rows.pop(pair)
            self.unlabelled[pair] = {name: getattr(prefs, name)[row].copy() for name in LabelLog.ARRAYS}
        prefs.load_state_dict({name: np.delete(values, rows, axis=0) for name, values in prefs.state_dict().items()})
        self.rows = {pair: row - int(np.searchsorted(rows, row)) for pair, row in self.rows.items()}

    def idle_seconds(self) -> dict:
        """Seconds the trainer waited for people and people for the trainer, in all; nothing where no person answers."""
        if not self.people_answer:
            return {}
        longest = {"feedback_longest_step_wait_seconds": self.longest_wait[1], "feedback_longest_step_wait_step": self.longest_wait[0]}
        return {"trainer_idle_seconds": self.trainer_idle, "people_idle_seconds": self.people_idle} | longest

    def state_dict(self) -> dict:
        state = {"number": self.number, "segments": self.segments, "trainer_idle": self.trainer_idle, "people_idle": self.people_idle}
        state |= {
            "staged": self.staged,
            "closing": self.closing,
            "unlabelled": [[*pair, arrays] for pair, arrays in self.unlabelled.items()],
        }
        state["rows"] = [[*pair, row] for pair, row in self.rows.items()]
        state["longest_wait"] = list(self.longest_wait)
        if self.open:
            state |= {"labels": self.labels, "annotators": self.annotators, "answered": self.answered, "recorded": self.recorded}
        return copy.deepcopy(state)

    def load_state_dict(self, state: dict) -> None:
        state = copy.deepcopy(state)
        self.number, self.segments = state["number"], state["segments"]
        self.trainer_idle, self.people_idle, self.opened_at = state["trainer_idle"], state["people_idle"], time.time()
        self.staged, self.staged_here = state.get("staged"), False  # a checkpoint of an older version staged nothing
        self.closing = state.get("closing", False)
        self.longest_wait = tuple(state.get("longest_wait", (-1, 0.0)))
        self.rows = {(session, index): row for session, index, row in state.get("rows", [])}
        self.unlabelled = {(session, index): arrays for session, index, arrays in state.get("unlabelled", [])}
        if self.open:
            self.labels, self.annotators, self.answered, self.recorded = (
                state[k] for k in ("labels", "annotators", "answered", "recorded")
            )


def record_labels(prefs, label_log: LabelLog, session: FeedbackSession, loop, heldout_fraction: float, rng, teacher) -> int:
    """The session's answers not recorded yet into the preference buffer (a random heldout_fraction of them held out
    for validation) and into runs/<run>/labels.sqlite; skipped ones (nan) are only counted. Returns 1 when the session
    is complete, all its answers recorded (or it gave way to the next one: its unanswered pairs wait, unlabelled, for
    a late answer), else 0: what the training loop adds to the sessions done. Earlier sessions' labels are first brought to the teacher's latest answers (reconcile; how many
    changed is logged with the session)."""
    begun = time.perf_counter()
    session.corrections = session.reconcile(teacher, prefs, label_log, loop, heldout_fraction, rng)
    session.waited(time.perf_counter() - begun, loop.global_step)
    new = session.answered & ~session.recorded
    labels = np.where(new, session.labels, np.nan).astype(np.float32)
    answered = ~np.isnan(labels)
    heldout = np.zeros(len(labels), bool)
    heldout[new] = rng.random(int(new.sum())) < heldout_fraction
    kept = {name: session.segments[name][answered] for name in LabelLog.ARRAYS}
    first_row = len(prefs)
    prefs.add(*kept.values(), labels[answered], heldout[answered], loop.global_step)
    query_ids = teacher.pair_ids(session.number, len(labels))
    label_log.append(session.segments, labels, session.annotators, session.number, loop.global_step, query_ids)
    session.rows |= {(session.number, int(i)): first_row + k for k, i in enumerate(np.flatnonzero(answered))}
    if session.people_answer:  # a person may answer a skipped (or, given way, an unanswered) pair later
        waiting = np.flatnonzero(~session.recorded & ~answered & (session.answered | session.closing))
        session.unlabelled |= {(session.number, int(i)): {name: session.segments[name][i] for name in LabelLog.ARRAYS} for i in waiting}
    loop.labels_obtained += int(answered.sum())
    loop.queries_skipped += int((new & ~answered).sum())
    session.recorded |= new | session.closing
    return int(session.recorded.all())


def read_label_file(path: str | Path) -> tuple[dict, np.ndarray]:
    """Segments and labels of a labels.sqlite written by LabelLog, in the order they were obtained."""
    import sqlite3

    db = sqlite3.connect(f"file:{Path(path).resolve()}?mode=ro", uri=True)
    rows = db.execute("SELECT label, obs_actions, masks, true_rewards, physics_states, shapes FROM labels ORDER BY id").fetchall()
    db.close()
    segments = {name: [] for name in LabelLog.ARRAYS}
    for row in rows:
        shapes = json.loads(row[5])
        for name, blob in zip(LabelLog.ARRAYS, row[1:5]):
            shape, dtype = shapes[name]
            segments[name].append(np.frombuffer(blob, dtype=dtype).reshape(shape))
    stacked = {name: np.stack(values) if values else np.zeros(0) for name, values in segments.items()}
    return stacked, np.array([row[0] for row in rows], dtype=np.float32)


NO_SERVER_SECONDS = 10.0  # how long a human run waits for a server it does not start itself before it stops


def wait_for_server(client: FeedbackClient) -> None:
    """A server the run does not start must answer: when nothing does, the run says so at once, waits NO_SERVER_SECONDS
    (for one being started meanwhile) and stops in one line, before it has built anything."""
    if client.alive():
        return
    print(
        f"feedback server: nothing answers at {client.url}; start one (cleanrlhf-feedback-server, its token for the run in "
        f"{protocol.TOKEN_ENV}) or add --feedback-server-autostart to let the run start its own; waiting {NO_SERVER_SECONDS:g} s",
        flush=True,
    )
    deadline = time.monotonic() + NO_SERVER_SECONDS
    while time.monotonic() < deadline:
        time.sleep(0.5)
        if client.alive():
            return
    raise FeedbackServerError(f"no feedback server answers at {client.url}: start one, or add --feedback-server-autostart")


def connect_human_teacher(args, run_name: str, run_dir: Path, clip_dir: Path, objective_returns=None) -> HumanTeacher:
    """A HumanTeacher for this run: the feedback server (started as a child process with
    --feedback-server-autostart when none answers there), this run registered on it, and a renderer for clips.
    `objective_returns` (segments -> (N, 2)): --teacher-objective's segment returns, only measured against the answers."""
    probe = make_env(args.env_id, args.seed)()
    stateless = get_physics_state(probe).size == 0
    probe.close()
    need(
        not stateless,
        f"--teacher-feedback-mode human: --env-id {args.env_id} exposes no simulator state (MuJoCo's model and data, dm_control's "
        "physics or a classic-control `state`), and the page's clips are re-rendered from states; train it with the synthetic "
        "teacher or --teacher-feedback-mode file",
    )
    server_process = None
    token = feedback_token(args, run_dir)
    client = FeedbackClient(args.feedback_server_url, token)
    if args.feedback_server_autostart:
        data_dir = Path(args.feedback_server_data_dir) if args.feedback_server_data_dir else run_dir / "feedback_data"
        server_process = start_feedback_server(args.feedback_server_url, run_dir / "feedback_server.log", token, data_dir)
    else:
        wait_for_server(client)
    renderer = SegmentRenderer(args.env_id, args.clip_width, args.clip_height, shadows=False)  # 3x faster with software GL
    fps = args.clip_fps or real_time_fps(renderer.env)
    meta = {"seed": args.seed, "segment_length": args.segment_length, "instructions": args.feedback_instructions.strip()}
    run_id = client.create_run(run_name, args.env_id, meta | {"clip_fps": fps, "clip_seconds": round(args.segment_length / fps, 3)})
    if token is None:
        print(f"feedback server: label at {args.feedback_server_url}/ (run {run_id})")
    elif getattr(args, "resume", None) and not args.feedback_login_link:  # browsers logged in before stay logged in
        print(f"feedback server: label at {args.feedback_server_url}/ (run {run_id}); a new login link: --feedback-login-link")
    else:  # one-time and short-lived: once opened or expired, a copy of the line in a log lets nobody in
        link, seconds = client.login_link()
        print(f"feedback server: log in at {link} (the link works once, within {seconds / 60:g} min; run {run_id})")
    restart = None
    if server_process is not None:
        restart = functools.partial(start_feedback_server, args.feedback_server_url, run_dir / "feedback_server.log", token, data_dir)
    teacher = HumanTeacher(
        client, run_id, renderer, clip_dir, fps, server_process=server_process,
        pair_log=run_dir / "shown_pairs.jsonl", objective_returns=objective_returns, restart_server=restart,
        rating_scale=args.rating_scale,
    )  # fmt: skip
    # when sessions come, for the page's "next session in about ..." (PrefPPO's come after the rollout that reaches the step)
    teacher.total_steps, teacher.session_frequency = args.total_timesteps, args.teacher_feedback_frequency
    teacher.first_session_step = args.total_explore_steps if args.unsupervised_exploration else getattr(args, "learning_starts", 0)
    return teacher


TOKEN_FILE = "feedback_token"  # runs/<run>/feedback_token: the token of the run's feedback server (mode 0600)


def feedback_token(args, run_dir: Path) -> str | None:
    """The feedback server's token for this run: --feedback-server-token, else FEEDBACK_SERVER_TOKEN, else the one kept in
    runs/<run>/feedback_token by the run's earlier start (a resumed run: its `to resume:` line never carries the token),
    else, when the run starts the server itself, a new one. A token in use is kept in that file (mode 0600; never in
    args.json), so that a resumed run starts its server with the same token and logged-in browsers stay logged in."""
    import secrets

    path = run_dir / TOKEN_FILE
    token = args.feedback_server_token or os.environ.get(protocol.TOKEN_ENV) or protocol.read_token_file(path)
    if token is None and args.feedback_server_autostart:
        token = secrets.token_urlsafe(32)
    if token is not None and protocol.read_token_file(path) != token:
        protocol.write_token_file(path, token)
    return token


def real_time_fps(env) -> float:
    """Environment steps per second of simulated time, 1/dt: Gymnasium MuJoCo's dt, dm_control's control timestep."""
    dt = getattr(env.unwrapped, "dt", None)
    if dt is None and hasattr(env.unwrapped, "_env") and hasattr(env.unwrapped._env, "control_timestep"):
        dt = env.unwrapped._env.control_timestep()
    return 1.0 / float(dt) if dt else float(env.metadata.get("render_fps", 30))


class SyntheticTeacher(Teacher):
    """B-Pref's simulated teacher (Lee et al. 2021): labels pairs by their true return, or with --teacher-objective by
    the objective's, with B-Pref's irrationalities (rationality beta, myopia gamma, mistakes, skips, ties). Its own
    seeded RNG. The skip and tie thresholds are fractions of the average segment return: the replay buffer's true
    reward, or the objective's over the session's segments."""

    labels_are_free = True  # held-out accuracy is measured on fresh pairs, not on labels of the budget

    def __init__(
        self, beta: float, gamma: float, eps_mistake: float, eps_skip: float, eps_equal: float, seed: int, rb=None, objective=None,
        rating_scale: int = 0,
    ):  # fmt: skip
        self.objective, self.rb = objective, rb
        self.beta, self.gamma = beta, gamma
        self.eps_mistake, self.eps_skip, self.eps_equal = eps_mistake, eps_skip, eps_equal
        self.rng = np.random.default_rng(seed)
        self.threshold_skip = self.threshold_equal = 0.0
        self.rating_scale = rating_scale  # 0: compares or ranks; else rates each clip 1 .. it (rate_true_rewards)
        self.rated_range = [math.inf, -math.inf]  # the lowest and highest (discounted) return of a clip it has rated

    def set_margin(self, average_segment_return: float) -> None:
        """Thresholds are fractions of the average true return of a segment (segment length x mean reward)."""
        self.threshold_skip = self.eps_skip * average_segment_return
        self.threshold_equal = self.eps_equal * average_segment_return

    def label(self, segments: dict, session: int) -> tuple[np.ndarray, list[str]]:
        if self.objective is not None:  # one vectorised call over the session's segments
            true_rewards = segment_rewards(self.objective, segments, self.rb.obs.shape[-1])
            self.set_margin(true_rewards.shape[-1] * float(true_rewards.sum() / max(1, segments["masks"].sum())))
            return self.label_true_rewards(true_rewards), ["synthetic"] * len(true_rewards)
        true_rewards = segments["true_rewards"]
        if self.rb is not None:
            self.set_margin(true_rewards.shape[-1] * float(self.rb.true_rewards[: self.rb.size].mean()))
        return self.label_true_rewards(true_rewards), ["synthetic"] * len(true_rewards)

    def label_true_rewards(self, true_rewards: np.ndarray) -> np.ndarray:
        """true_rewards (N, 2, L), zero on masked steps -> labels (N,): 1 = segment 1 preferred, 0 = segment 0,
        0.5 = tie, nan = skipped. Of k > 2 clips, (N, k, L): rankings (rank_true_rewards); with a rating scale, the
        clips' ratings (rate_true_rewards)."""
        if self.rating_scale:
            return self.rate_true_rewards(true_rewards)
        if true_rewards.shape[1] > 2:
            return self.rank_true_rewards(true_rewards)
        returns = true_rewards.sum(-1)
        weights = self.gamma ** np.arange(true_rewards.shape[-1] - 1, -1, -1)  # myopia: the last step weighs most
        discounted = (true_rewards * weights).sum(-1)
        diff = discounted[:, 1] - discounted[:, 0]
        if self.beta >= 0:
            p_second = 1.0 / (1.0 + np.exp(-self.beta * diff))
            labels = (self.rng.random(len(diff)) < p_second).astype(np.float32)
        else:  # a perfect teacher prefers neither of two segments worth the same: a tie, not "the first one"
            labels = np.where(diff == 0, 0.5, diff > 0).astype(np.float32)
        flip = self.rng.random(len(labels)) < self.eps_mistake
        labels[flip] = 1.0 - labels[flip]
        if self.eps_equal > 0:
            labels[np.abs(returns[:, 1] - returns[:, 0]) < self.threshold_equal] = 0.5
        if self.eps_skip > 0:
            labels[returns.max(1) < self.threshold_skip] = np.nan
        return labels

    def rank_true_rewards(self, true_rewards: np.ndarray) -> np.ndarray:
        """true_rewards (N, k, L), zero on masked steps -> rankings (N,), each its order's index
        (cleanrlhf_utils.rankings), nan = skipped; B-Pref's noise as for pairs, of which it is the k-clip form: myopia
        weighs step t by gamma^(L-1-t); a rational teacher (beta >= 0) draws the ranking from Plackett-Luce at
        temperature beta (sorting beta R plus Gumbel noise), a perfect one sorts by R (equal returns in random order);
        a mistake replaces the ranking by one of the others, drawn uniformly (a pair's flip); a query whose returns all
        lie below the skip threshold is skipped. A ranking has no ties (check_clips_per_query refuses eps_equal)."""
        returns = true_rewards.sum(-1)
        weights = self.gamma ** np.arange(true_rewards.shape[-1] - 1, -1, -1)  # myopia: the last step weighs most
        discounted = (true_rewards * weights).sum(-1)
        if self.beta >= 0:
            ranked = np.argsort(-(self.beta * discounted + self.rng.gumbel(size=discounted.shape)), axis=-1)
        else:
            ranked = np.lexsort((self.rng.random(discounted.shape), -discounted), axis=-1)
        labels = order_labels(ranked).astype(np.float32)
        flip = self.rng.random(len(labels)) < self.eps_mistake
        others = math.factorial(true_rewards.shape[1]) - 1
        labels[flip] = (labels[flip] + self.rng.integers(1, others + 1, size=int(flip.sum()))) % (others + 1)
        if self.eps_skip > 0:
            labels[returns.max(1) < self.threshold_skip] = np.nan
        return labels

    def rate_true_rewards(self, true_rewards: np.ndarray) -> np.ndarray:
        """true_rewards (N, k, L), zero on masked steps -> the ratings of each query's clips (N,), as
        cleanrlhf_utils.ratings writes them, nan = skipped. A person anchors a scale on the worst and the best they have
        seen: the teacher rates a clip by where its return (discounted by myopia as for pairs) lies between the lowest
        and highest of every clip it has rated, this query's included, on `rating_scale` equal bins, so an early clip
        rated 5 may rate 3 once better ones have been shown. A rational teacher (beta >= 0) draws the rating from the
        ordered logit at temperature beta with the bins' edges as cut points (logistic noise of scale 1 / beta added to
        the return; beta 0: a rating drawn uniformly); a mistake replaces a clip's rating by another drawn uniformly; a
        query whose returns all lie below the skip threshold is skipped. Ratings have no ties (check_query_kind refuses
        eps_equal)."""
        scale, returns = self.rating_scale, true_rewards.sum(-1)
        weights = self.gamma ** np.arange(true_rewards.shape[-1] - 1, -1, -1)  # myopia: the last step weighs most
        discounted = (true_rewards * weights).sum(-1)  # (N, k)
        low = self.rated_range[0] = min(self.rated_range[0], float(discounted.min()))
        high = self.rated_range[1] = max(self.rated_range[1], float(discounted.max()))
        if self.beta > 0:
            discounted = discounted + self.rng.logistic(size=discounted.shape) / self.beta
        position = (discounted - low) / (high - low) if high > low else np.full(discounted.shape, 0.5)
        ratings = np.clip(np.floor(position * scale), 0, scale - 1).astype(np.int64)
        if self.beta == 0:
            ratings = self.rng.integers(0, scale, size=ratings.shape)
        flip = self.rng.random(ratings.shape) < self.eps_mistake
        ratings[flip] = (ratings[flip] + self.rng.integers(1, scale, size=int(flip.sum()))) % scale
        labels = rating_labels(ratings, scale)
        if self.eps_skip > 0:
            labels[returns.max(1) < self.threshold_skip] = np.nan
        return labels

    def state_dict(self) -> dict:
        return {"rng": self.rng.bit_generator.state, "rated_range": list(self.rated_range)}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.rated_range = list(state.get("rated_range", [math.inf, -math.inf]))  # a checkpoint from before ratings


def check_teacher_objective(args, obs_dim: int, action_dim: int, state_dim: int):
    """--teacher-objective, called once on zeros of the run's shapes: a function that fails or returns the wrong shape
    is refused in one line (main checks it before anything of the run is written). Returns the objective, or None."""
    objective = load_objective(args.teacher_objective)
    if objective is not None:
        check_objective(objective, obs_dim, action_dim, state_dim)
    return objective


def make_teacher(args, rb, run_name: str, run_dir: Path, video_dir: Path) -> Teacher:
    """The one place --teacher-feedback-mode is read: the synthetic teacher (seeded with --seed + 1), people through the
    feedback server, or an earlier run's labels. --teacher-objective is checked on the run's shapes here; only the
    synthetic teacher labels by it (people and a file are measured against it)."""
    objective = check_teacher_objective(args, rb.obs.shape[-1], rb.actions.shape[-1], rb.physics_states.shape[-1])
    if args.teacher_feedback_mode == "human":
        measure = None if objective is None else lambda segments: segment_rewards(objective, segments, rb.obs.shape[-1]).sum(-1)
        return connect_human_teacher(args, run_name, run_dir, video_dir / "clips", measure)
    if args.teacher_feedback_mode == "file":
        return FileTeacher(args.feedback_file)
    eps = (args.teacher_eps_mistake, args.teacher_eps_skip, args.teacher_eps_equal)
    return SyntheticTeacher(
        args.teacher_beta, args.teacher_gamma, *eps, seed=args.seed + 1, rb=rb, objective=objective, rating_scale=args.rating_scale
    )


def query_pair_labels(labels: np.ndarray, clips: int, rating_scale: int) -> np.ndarray:
    """What each label (N,) says of each pair of its query's clips (N, P), in rankings.clip_pairs order: a pair's own
    label, a ranking's orders, ratings' comparisons (0.5 where two clips are rated alike)."""
    return rating_pair_labels(labels, clips, rating_scale) if rating_scale else pair_labels(labels, clips)


def show_reward_model(teacher: Teacher, session: FeedbackSession, prefs, rb, predict, args, rng: np.random.Generator, step: int) -> None:
    """Human mode, after a reward update: how often the reward model (`predict`: obs_actions (N, D) -> (mean, std)
    arrays) prefers the clip each person preferred, over their labels so far, and --feedback-check-clips random
    segments with its predicted return, which people see ranked on the page beside their own ranking."""
    if not teacher.people_answer:
        return
    if session.rows:
        pairs, rows = list(session.rows), np.fromiter(session.rows.values(), int)
        decided = prefs.labels[rows] != 0.5
        segments, masks = prefs.obs_actions[rows[decided]], prefs.masks[rows[decided]]
        returns = (predict(segments.reshape(-1, segments.shape[-1]))[0].reshape(masks.shape) * masks).sum(-1)
        first, second = clip_pairs(prefs.clips)  # a ranking: the share of its pairs of clips the model orders as given
        given = query_pair_labels(prefs.labels[rows[decided]], prefs.clips, args.rating_scale).reshape(len(returns), -1)
        # of ratings: of its pairs of clips rated differently (all rated alike: no agreement to measure, nan)
        ordered = np.where(given == 0.5, np.nan, (returns[:, second] > returns[:, first]) == (given > 0.5))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a query whose clips were all rated alike
            agree = np.nanmean(ordered, -1)
        shown = [pair for pair, keep in zip(pairs, decided) if keep]
        teacher.show_agreement([pair for pair, value in zip(shown, agree) if not np.isnan(value)], agree[~np.isnan(agree)])
    if args.feedback_check_clips == 0:
        return
    idx, mask = rb.sample_segment_pairs(args.feedback_check_clips, args.segment_length, rng)
    idx, mask = idx[:, 0], mask[:, 0]
    mean, _ = predict(rb.obs_actions(idx))
    subsets = []
    if reorderable(args) and not any(key[0] == -step for key in (*session.unlabelled, *session.rows)):  # once a step
        # a person's reorder of these clips is learned as every set of --clips-per-query of them in the order the person
        # gave it (as InstructGPT learns a ranking of K answers as its K (K - 1) / 2 comparisons): each such set waits,
        # unlabelled, until a reorder answers it (FeedbackSession.reconcile)
        subsets = list(itertools.combinations(range(len(idx)), args.clips_per_query))
        segments = rb.gather_segments(idx, mask)
        for i, positions in enumerate(subsets):
            session.unlabelled[(-step, i)] = {name: segments[name][list(positions)] for name in LabelLog.ARRAYS}
    teacher.show_reward_check(rb.physics_states[idx], mask, (mean * mask).sum(-1), step, idx[:, 0], subsets)
