"""Teachers other than the synthetic one: people answering in the browser through the feedback server
(humanFeedback/feedback_server.py), and the labels an earlier run saved. Also the log every run keeps of its
labels (runs/<run>/labels.sqlite), which is what file mode reads back.

Every teacher answers `label(segments, session) -> (labels, annotators)`: `segments` holds the pairs' arrays
(obs_actions, masks, true_rewards, physics_states: (N, 2, L, ...)) and their replay-buffer start indices
(segment_ids: (N, 2)); labels (N,) are 1 = segment 1 preferred, 0 = segment 0, 0.5 = tie, nan = skipped."""

import contextlib
import copy
import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, Protocol

import numpy as np

from . import protocol
from .checkpoints import training_state
from .envs import SegmentRenderer, check_can_render, get_physics_state, make_env, segment_frames, write_mp4
from .errors import need
from .stopping import stoppable_at_once


@dataclass
class FeedbackArgs:
    """Who labels, and how people are reached: the feedback server, its clips, or an earlier run's labels."""

    teacher_feedback_mode: Literal["simulated", "human", "file"] = "simulated"
    """who labels: `simulated` (synthetic teacher on the true reward), `human` (people in the browser, through
    the feedback server), `file` (the labels an earlier run saved, --feedback-file)"""
    feedback_server_url: str = "http://localhost:5001"
    """address of the feedback server (human mode)"""
    feedback_server_autostart: bool = False
    """start the feedback server as a child process if none answers at --feedback-server-url"""
    feedback_server_token: str | None = None
    """shared secret of the feedback server, if it was started with --token; default: the FEEDBACK_SERVER_TOKEN
    environment variable, which keeps it off the command line (visible to every user in ps)"""
    feedback_server_data_dir: str | None = None
    """database and clips of an autostarted server (--feedback-server-autostart); default runs/<run>/feedback_data, one
    per run. Give several runs the same folder (and URL) to label them all on one page"""
    feedback_instructions: str = "Which clip shows the agent doing its task better?"
    """the question shown above every pair of this run's clips, e.g. "which one moves forward better?" """
    feedback_file: str | None = None
    """labels.sqlite of an earlier run (runs/<run>/labels.sqlite) to train from in file mode"""
    feedback_poll_seconds: float = 1.0
    """how often the trainer asks the server for new answers while a session is open"""
    feedback_check_clips: int = 5
    """human mode: clips with the reward model's predicted return uploaded after each reward update"""
    clip_fps: float | None = None
    """frame rate of the clips shown to people (one frame per environment step); default the environment's real time,
    1/dt (Hopper 125, dm_control walker 40), so a clip lasts segment_length * dt seconds (the page loops it)"""
    clip_width: int = 576
    clip_height: int = 432
    """size of the clips shown to people: the page shows two side by side at 576 px at most, so they are rendered at
    the size they are seen (the page never enlarges a clip beyond its own size); at most 640x480, MuJoCo's offscreen buffer"""
    clip_shadows: bool = False
    """render shadows and reflections in the clips (about 3x slower with software rendering)"""
    feedback_async: bool = False
    """human mode: keep training on the current reward model while people label. A session's pairs are uploaded and
    its answers read every --feedback-async-poll-steps steps without waiting; the reward model learns from them (and
    the replay buffer is relabelled) when they are all in, or every --feedback-async-update-every labels, and the next
    session's pairs are selected then. The run waits for the open session only at its last step"""
    feedback_async_poll_steps: int = 200
    """--feedback-async: environment steps between two reads of the server's answers (one short request each)"""
    feedback_async_update_every: int = 0
    """--feedback-async: update the reward model every this many new labels of the open session (0: once all are in)"""


def need_no_teacher(args: FeedbackArgs, flag: str, why: str) -> None:
    """A run that asks no teacher (`flag`, for `why`) refuses a human or file one in one line instead of starting it."""
    mode = args.teacher_feedback_mode
    need(mode == "simulated", f"{flag} {why} and asks no teacher: drop --teacher-feedback-mode {mode}")


def validate_feedback_args(args: FeedbackArgs) -> None:
    """The teacher's settings: --teacher-feedback-mode human|file and how the server and its clips are reached."""
    if args.teacher_feedback_mode == "file":
        need(args.feedback_file is not None, "--teacher-feedback-mode file needs --feedback-file PATH (a runs/<run>/labels.sqlite)")
        need(Path(args.feedback_file).is_file(), f"--feedback-file {args.feedback_file} does not exist")
    if args.teacher_feedback_mode == "human":
        check_can_render(args.env_id, "--teacher-feedback-mode human")
    need(args.feedback_poll_seconds > 0, f"--feedback-poll-seconds must be > 0, got {args.feedback_poll_seconds}")
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


# What each of the protocol's choices means as a label (the left clip is segment 0).
CHOICE_LABELS = dict(zip(protocol.CHOICES, (0.0, 1.0, 0.5, float("nan")), strict=True))


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

    def __init__(self, url: str, token: str | None = None, retry_seconds: float = 600.0, timeout: float = 30.0):
        self.url, self.token, self.retry_seconds, self.timeout = url.rstrip("/"), token, retry_seconds, timeout

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
                req = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
                with urllib.request.urlopen(req, timeout=self.timeout) as response:
                    return json.loads(response.read() or b"{}")
            except urllib.error.HTTPError as error:
                if error.code < 500:
                    try:
                        reason = json.loads(error.read()).get("error", "")
                    except ValueError:
                        reason = ""
                    raise FeedbackServerError(f"{method} {path}: HTTP {error.code} {reason}") from None
                failure = f"HTTP {error.code}"
            except (urllib.error.URLError, ConnectionError, TimeoutError, http.client.HTTPException, ValueError) as error:
                # ValueError: a reply cut short by a dying server; every request is idempotent, so re-send it.
                failure = str(getattr(error, "reason", error)) or type(error).__name__
            if not retry or time.monotonic() + delay > deadline:
                raise FeedbackServerUnreachable(f"feedback server {self.url} unreachable ({failure})")
            time.sleep(delay)
            delay = min(delay * 2, 10.0)

    def alive(self) -> bool:
        try:
            self.request("GET", protocol.CONFIG, retry=False)
            return True
        except FeedbackServerError as error:
            return "HTTP" in str(error) and "401" not in str(error) and "403" not in str(error)

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

    def report_progress(self, run_id: int, report: dict, retry: bool = True) -> None:
        self.request("POST", protocol.path(protocol.RUN_PROGRESS, run_id=run_id), json_body=report, retry=retry)


def start_feedback_server(url: str, log_path: Path, token: str | None = None, data_dir: Path | None = None):
    """Starts the feedback server (the installed humanFeedback package, as `python -m humanFeedback.feedback_server`)
    on the URL's port unless a server already answers there; its database and clips go to data_dir (default:
    feedback_data in the current directory)."""
    import subprocess
    from urllib.parse import urlparse

    client = FeedbackClient(url, token)
    if client.alive():
        return None
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", str(parsed.port or 5001)
    command = [sys.executable, "-m", "humanFeedback.feedback_server", "--host", host, "--port", port]
    if data_dir is not None:
        command += ["--data-dir", str(data_dir)]
    env = {key: value for key, value in os.environ.items() if key != protocol.TOKEN_ENV}
    if token:
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
    """Whoever labels a run's pairs: the synthetic teacher (in each algorithm script), people (HumanTeacher) or an
    earlier run's labels (FileTeacher). `make_teacher` in each script is the one place that picks one, by
    --teacher-feedback-mode; the training loop only ever talks to this interface. A teacher subclasses it to take the
    defaults of what it does not need (progress reports, closing)."""

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

    def show_reward_check(self, states: np.ndarray, masks: np.ndarray, predicted_returns: np.ndarray, step: int) -> None:
        """Segments with the reward model's predicted return, for people to compare with their own ranking."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def session_measures(self) -> dict[str, float]:
        """What the teacher measured about the answers of the session just learned from, logged under feedback/ (e.g.
        how often people agreed with --teacher-objective); empty by default."""
        return {}

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
        poll_seconds: float = 1.0,
        server_process=None,
        pair_log: Path | None = None,
        objective_returns=None,
    ):
        self.client, self.run_id, self.renderer, self.clip_dir, self.fps = client, run_id, renderer, clip_dir, fps
        # runs/<run>/shown_pairs.jsonl: one line per uploaded pair (query id, segment ids, env returns and, with
        # --teacher-objective, the objective's returns), so what people answered can be set against what they saw.
        self.pair_log, self.objective_returns = pair_log, objective_returns  # segments -> (N, 2) objective returns
        self.shown: dict[int, list[float]] = {}  # query id -> the objective's [left, right] returns (with an objective)
        self.measured_query_ids: list = []  # the query ids of the latest session that started (session_measures)
        self.cursor, self.poll_seconds = cursor, poll_seconds
        self.server_process = server_process  # the feedback server this teacher started, stopped with it
        self.answers: dict[int, dict] = {}  # query id -> latest answer; survives an interrupted session
        self.open: dict | None = None  # the open session: {"session": n, "query_ids": [id or None per pair]}
        self.worker, self.stop_upload, self.upload_errors = None, threading.Event(), []
        self.render_lock = threading.Lock()  # --feedback-async: the next session's clips render during the reward check's
        # The trainer's news for the page (report_progress): when sessions come, how fast steps go, the last sent.
        self.total_steps, self.first_session_step, self.session_frequency = 0, 0, 1
        self.step, self.sessions_done, self.sessions_total = 0, 0, 0
        self.progress_client = FeedbackClient(client.url, client.token, retry_seconds=0, timeout=2.0)
        self.next_report, self.reporter, self.rate_mark, self.steps_per_second = 0.0, None, None, None

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
            for i, (left_id, right_id) in enumerate(segments["segment_ids"].tolist()):
                if stop.is_set():
                    return
                if query_ids[i] is not None:  # uploaded before the run was resumed (and logged then)
                    if objective is not None:
                        self.shown[query_ids[i]] = objective[i]
                    continue
                stem = f"run{self.run_id}_s{session}_q{i}_{left_id}_{right_id}"
                clips = {
                    side: self.render_clip(f"{stem}_{side}.mp4", segments["physics_states"][i, k], segments["masks"][i, k])
                    for k, side in enumerate(("left", "right"))
                }
                query = {
                    "left_clip": clips["left"].name,
                    "right_clip": clips["right"].name,
                    "left_segment_id": left_id,
                    "right_segment_id": right_id,
                    "session": session,
                }
                query_ids[i] = self.client.upload_queries(self.run_id, [query], {path.name: path for path in clips.values()})[0]
                pair_returns = None if env_returns is None else env_returns[i]
                self.log_shown_pair(query_ids[i], session, i, query, pair_returns, None if objective is None else objective[i])
        except BaseException as error:  # reported by the waiting thread
            errors.append(error)

    def log_shown_pair(self, query_id: int, session: int, pair: int, query: dict, env_returns: list | None, objective: list | None) -> None:
        if objective is not None:
            self.shown[query_id] = objective
        if self.pair_log is None:
            return
        line = {"query_id": query_id, "session": session, "pair": pair, "left_segment_id": query["left_segment_id"]}
        line["right_segment_id"] = query["right_segment_id"]
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
                while True:
                    labels, annotators, answered = self.poll()
                    uploaded = sum(q is not None for q in query_ids)
                    print(f"\rfeedback session {session}: {answered.sum()}/{count} answered, {uploaded} uploaded", end="", flush=True)
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

    def finish(self) -> None:
        """The open session is answered: its upload thread (done by now) is told to stop, and the session closed."""
        self.measured_query_ids = list(self.open["query_ids"]) if self.open else []
        self.stop_upload.set()
        self.open = None

    def _labels_of(self, query_ids: list) -> tuple[np.ndarray, list[str]]:
        labels, annotators = np.full(len(query_ids), np.nan, dtype=np.float32), [""] * len(query_ids)
        for i, qid in enumerate(query_ids):
            if qid is not None and qid in self.answers:
                labels[i], annotators[i] = CHOICE_LABELS[self.answers[qid]["choice"]], self.answers[qid]["annotator"]
        return labels, annotators

    def show_reward_check(self, states: np.ndarray, masks: np.ndarray, predicted_returns: np.ndarray, step: int) -> None:
        """Clips with the reward model's predicted return, shown ranked on the page's reward view: a person can
        compare the model's ranking with their own (states (N, L, S), masks (N, L))."""
        clips, evaluations = {}, []
        for i in range(len(states)):
            path = self.render_clip(f"run{self.run_id}_check_{step}_{i}.mp4", states[i], masks[i])
            clips[path.name] = path
            evaluations.append({"clip": path.name, "predicted_return": float(predicted_returns[i]), "step": step})
        self.client.upload_evaluations(self.run_id, evaluations, clips)

    def state_dict(self) -> dict:
        """The answers cursor, and the open session's query ids and the answers read for them (a checkpoint of an
        older version has only the cursor)."""
        if self.open is None:
            return {"cursor": self.cursor, "open": None, "answers": {}}
        query_ids = list(self.open["query_ids"])
        answers = {qid: dict(self.answers[qid]) for qid in query_ids if qid in self.answers}
        return {"cursor": self.cursor, "open": {"session": self.open["session"], "query_ids": query_ids}, "answers": answers}

    def load_state_dict(self, state: dict) -> None:
        self.cursor, self.open = state["cursor"], copy.deepcopy(state.get("open"))
        self.answers = copy.deepcopy(state.get("answers", {}))

    def close(self) -> None:
        self.next_report = float("inf")  # the last news: the run has ended, or stopped before its end
        with contextlib.suppress(Exception):
            phase = "finished" if self.total_steps and self.step >= self.total_steps else "stopped"
            self.progress_client.report_progress(self.run_id, self.progress_report(phase), retry=False)
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
        segments["segment_ids"] = np.full((stop - start, 2), -1)  # not from this run's replay buffer
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

    def __init__(self, path: Path):
        import sqlite3

        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(path)
        self.db.execute("PRAGMA journal_mode=WAL")
        with self.db:
            self.db.execute(
                "CREATE TABLE IF NOT EXISTS labels (id INTEGER PRIMARY KEY, global_step INTEGER, session INTEGER, label REAL, annotator TEXT,"
                " obs_actions BLOB, masks BLOB, true_rewards BLOB, physics_states BLOB, shapes TEXT, pair_key TEXT)"
            )
            if "pair_key" not in [row[1] for row in self.db.execute("PRAGMA table_info(labels)")]:
                self.migrate()
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

    def append(self, segments: dict, labels: np.ndarray, annotators: list[str], session: int, global_step: int) -> None:
        """A session's pairs with labels (N,): those not nan (skipped or not answered) are written in one transaction,
        each once."""
        rows = []
        for i in np.flatnonzero(~np.isnan(labels)):
            arrays = {name: np.ascontiguousarray(segments[name][i]) for name in self.ARRAYS}
            shapes = json.dumps({name: [list(a.shape), str(a.dtype)] for name, a in arrays.items()})
            blobs = [a.tobytes() for a in arrays.values()]
            rows.append((global_step, session, float(labels[i]), annotators[i], *blobs, shapes, self.key(session, *blobs[:2])))
        with self.db:
            self.db.executemany(
                "INSERT OR IGNORE INTO labels (global_step, session, label, annotator, obs_actions, masks, true_rewards, physics_states,"
                " shapes, pair_key) VALUES (?,?,?,?,?,?,?,?,?,?)",
                rows,
            )

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

    def __init__(self):
        self.number, self.segments, self.before = 0, None, None
        self.trainer_idle = self.people_idle = self.session_trainer_idle = 0.0
        self.opened_at = self.completed_at = None
        self.uploading, self.next_poll = False, 0
        self.staged: dict | None = None  # {"number": n, "segments": ...}: the next session's pairs, already put up
        self.staged_here = False  # staged by this process, whose upload runs; after a resume the teacher is asked again

    @property
    def open(self) -> bool:
        return self.segments is not None

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
        self.opened_at, self.session_trainer_idle = time.time(), 0.0
        if self.completed_at is not None:
            self.people_idle += self.opened_at - self.completed_at

    def ask(self, teacher, label_log: "LabelLog", args, step: int, last: bool = False) -> bool:
        """Whether the reward model is to learn from the session's answers now. Without --feedback-async (or at the
        run's last step) the teacher is asked for every answer and the trainer waits; Ctrl-C keeps the answers given so
        far in the label log (with their annotators) and the session open in the checkpoint. With --feedback-async the
        pairs are uploaded once and the answers read every --feedback-async-poll-steps steps, never waiting: True once
        all are in, or --feedback-async-update-every new ones."""
        if self.answered.all():  # a resumed session whose update was cut short: redo it
            return True
        waited = time.time()
        try:
            if not args.feedback_async or last:
                try:
                    labels, annotators = teacher.label(self.segments, self.number)
                except SessionInterrupted as partial:
                    label_log.append(self.segments, partial.labels, partial.annotators, self.number, step)
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
                new = answered & ~self.answered  # an answer once read stays (a later edit is not learned from twice)
                self.labels[new], self.answered = labels[new], self.answered | new
                self.annotators = [a if ok else old for a, old, ok in zip(annotators, self.annotators, new)]
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
        if self.answered.all():
            self.segments, self.uploading, self.next_poll = None, False, 0

    def rollback(self) -> dict:
        """What a checkpoint written now takes instead of the live training state: the state from before the running
        update, or nothing."""
        return self.before or {}

    def idle_seconds(self) -> dict:
        return {"trainer_idle_seconds": self.trainer_idle, "people_idle_seconds": self.people_idle}

    def state_dict(self) -> dict:
        state = {"number": self.number, "segments": self.segments, "trainer_idle": self.trainer_idle, "people_idle": self.people_idle}
        state["staged"] = self.staged
        if self.open:
            state |= {"labels": self.labels, "annotators": self.annotators, "answered": self.answered, "recorded": self.recorded}
        return copy.deepcopy(state)

    def load_state_dict(self, state: dict) -> None:
        state = copy.deepcopy(state)
        self.number, self.segments = state["number"], state["segments"]
        self.trainer_idle, self.people_idle, self.opened_at = state["trainer_idle"], state["people_idle"], time.time()
        self.staged, self.staged_here = state.get("staged"), False  # a checkpoint of an older version staged nothing
        if self.open:
            self.labels, self.annotators, self.answered, self.recorded = (
                state[k] for k in ("labels", "annotators", "answered", "recorded")
            )


def record_labels(prefs, label_log: LabelLog, session: FeedbackSession, loop, heldout_fraction: float, rng) -> None:
    """The session's answers not recorded yet into the preference buffer (a random heldout_fraction of them held out
    for validation) and into runs/<run>/labels.sqlite; skipped ones (nan) are only counted. The session counts as
    done once all its answers are recorded."""
    new = session.answered & ~session.recorded
    labels = np.where(new, session.labels, np.nan).astype(np.float32)
    answered = ~np.isnan(labels)
    heldout = np.zeros(len(labels), bool)
    heldout[new] = rng.random(int(new.sum())) < heldout_fraction
    kept = {name: session.segments[name][answered] for name in LabelLog.ARRAYS}
    prefs.add(*kept.values(), labels[answered], heldout[answered], loop.global_step)
    label_log.append(session.segments, labels, session.annotators, session.number, loop.global_step)
    loop.labels_obtained += int(answered.sum())
    loop.queries_skipped += int((new & ~answered).sum())
    session.recorded |= new
    loop.sessions_done += int(session.recorded.all())


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
    token = args.feedback_server_token or os.environ.get(protocol.TOKEN_ENV) or None
    if args.feedback_server_autostart:
        data_dir = Path(args.feedback_server_data_dir) if args.feedback_server_data_dir else run_dir / "feedback_data"
        server_process = start_feedback_server(args.feedback_server_url, run_dir / "feedback_server.log", token, data_dir)
    client = FeedbackClient(args.feedback_server_url, token)
    renderer = SegmentRenderer(args.env_id, args.clip_width, args.clip_height, shadows=args.clip_shadows)
    fps = args.clip_fps or real_time_fps(renderer.env)
    meta = {"seed": args.seed, "segment_length": args.segment_length, "instructions": args.feedback_instructions.strip()}
    run_id = client.create_run(run_name, args.env_id, meta | {"clip_fps": fps, "clip_seconds": round(args.segment_length / fps, 3)})
    print(f"feedback server: label at {args.feedback_server_url}/ (run {run_id})")
    teacher = HumanTeacher(
        client, run_id, renderer, clip_dir, fps, poll_seconds=args.feedback_poll_seconds, server_process=server_process,
        pair_log=run_dir / "shown_pairs.jsonl", objective_returns=objective_returns,
    )  # fmt: skip
    # when sessions come, for the page's "next session in about ..." (PrefPPO's come after the rollout that reaches the step)
    teacher.total_steps, teacher.session_frequency = args.total_timesteps, args.teacher_feedback_frequency
    teacher.first_session_step = args.total_explore_steps if args.unsupervised_exploration else getattr(args, "learning_starts", 0)
    return teacher


def real_time_fps(env) -> float:
    """Environment steps per second of simulated time, 1/dt: Gymnasium MuJoCo's dt, dm_control's control timestep."""
    dt = getattr(env.unwrapped, "dt", None)
    if dt is None and hasattr(env.unwrapped, "_env") and hasattr(env.unwrapped._env, "control_timestep"):
        dt = env.unwrapped._env.control_timestep()
    return 1.0 / float(dt) if dt else float(env.metadata.get("render_fps", 30))
