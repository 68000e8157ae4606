"""Human feedback server: people compare two clips of an agent (left / right / tie / skip) or rank several, best first.

Run:  python humanFeedback/feedback_server.py --port 5001 --data-dir ./feedback_data [--token SECRET] [--threads 8]
      (or FEEDBACK_SERVER_TOKEN=SECRET in the environment instead of --token, to keep it out of ps; with neither, the
      server makes a token and keeps it in <data-dir>/token)

The trainer creates a run, uploads batches of query pairs (clips + segment ids) and reads the answers back with a
cursor; annotators open the page at ``/`` in a browser.  Everything lives in one SQLite database (WAL mode,
synchronous=FULL, schema in ``schema.sql`` next to this file) under ``--data-dir``; every write is committed before the
reply is sent, so an acknowledged label survives a crash.  Uploads write their clips outside any transaction and commit
their rows BATCH_ROWS at a time, so annotators' requests get the write lock in between; one that waits
DB_TIMEOUT_SECONDS for it anyway gets 503 with Retry-After, never a 500.  The app is served by waitress (serving.py:
``--threads`` worker threads, bounded connections, every request judged by its headers before its body is read);
SIGTERM or Ctrl-C lets requests in progress finish (up to 5 s), then exits 0.

Requests (access.py): every one must name a Host this server is reached by and carry the token (the X-Feedback-Token
header) or a browser's session cookie, which the login route makes from a one-time login code (an invitation) or the
token; the routes marked "trainer" below refuse a browser an invitation let in (403); writes must be application/json
(multipart/form-data for the uploads, a form for the login), and a browser's cross-origin write is refused
(check_write_request).  Every field is checked before it is stored: numbers bounded before they are read (ids above
2^63-1 are a 400), text valid UTF-8 without control characters.  A browser's leases and answers are its session's,
whatever name it gives (principal()).

Routes, in four blueprints (errors are 4xx with ``{"error": "..."}`` and change nothing):
  login  GET  /login?code=                       a one-time login code -> the session cookie; without one, the login page
         POST /login                             the login form (token=) -> the session cookie
  page   GET  /                                  the annotation page (``#rewards``: reward-model check view); the login
                                                 page (401) for a browser that is not logged in
  clips  GET  /clips/<run_id>/<name>.mp4         a stored clip (Range requests supported)
  api    GET  /api/proof?nonce=                  {proof}: HMAC of the nonce with the token, a trainer's check (open to all)
         GET  /api/config                        allowed choices, editing flag, playback speed, lease seconds, role
         POST /api/login-codes                   trainer: {} -> 201 {invitation_id, url: "/login?code=...", expires_seconds,
                                                 role: "trainer"}, the trainer's own login link
         POST /api/invitations                   trainer: {name?} -> 201 the same for an annotator
         GET  /api/invitations                   trainer: every invitation, its role, name and state
         POST /api/invitations/<id>/revoke       trainer: {} -> its link dies, its browser is logged out
         GET  /api/runs                          all runs, without their meta
         GET  /api/runs/<run_id>                 trainer: one run, with its meta
         POST /api/runs                          trainer: {name, env_id?, meta? (<= 64 KiB)} -> 201 {run_id} (200 if it exists)
         POST /api/runs/<run_id>/queries         trainer: multipart: 'queries' JSON list + clip files -> 201 {query_ids}; an
                                                 entry is a pair {left_clip, right_clip, left_segment_id, right_segment_id,
                                                 session}, a ranking of 3 to 6 clips {clips, segment_ids, session},
                                                 or 2 to 6 clips to rate {clips, segment_ids, session, rating_scale};
                                                 with check_step, the reward-model check's clips of that step to reorder
                                                 from the check view (never leased; GET .../evaluations names it)
         GET  /api/runs/<run_id>/answers?after=  trainer: {answers, cursor} (see below)
         GET  /api/runs/<run_id>/status          trainer: {queries, labelled, pending, choices}
         POST /api/runs/<run_id>/progress        trainer: its news {step, phase, total_steps?, sessions_done?, sessions_total?,
                                                 next_session_step?, seconds_to_next_session?, steps_per_second?,
                                                 session?, session_size?, agreement?}; session_size declares the session's
                                                 pairs, agreement the reward model's with each annotator ({name: 0..1});
                                                 -> {progress, label_seq}, the last label write before it
         GET  /api/runs/<run_id>/progress        the latest report, with age_seconds and stale (older than 120 s), and the
                                                 run's state: trainer_seen_seconds, pending, total_labelled, total_skipped
         POST /api/runs/<run_id>/evaluations     trainer: multipart: 'evaluations' JSON list + clip files -> 201
         GET  /api/runs/<run_id>/evaluations     evaluation clips sorted by predicted_return, highest first (?latest=1:
                                                 only the newest)
         GET  /api/next?annotator=&run_id=&exclude=   lease the oldest free query (with its run's instructions and
                                                 its session's progress), or {waiting: true, training?: [reports]};
                                                 429 when the asker holds MAX_LEASES_PER_ANNOTATOR pairs already
         POST /api/queries/<query_id>/label      {choice, annotator} (a ranking: {ranking: [clip positions, best first],
                                                 annotator}, or the choice skip; answers carry choice "ranked" and ranking;
                                                 ratings: {ratings: [1 .. rating_scale per clip, in the order shown],
                                                 annotator}, answered as choice "rated" with ratings)
                                                 -> 201 new / 200 same or edited / 409 (labelled or
                                                 leased by someone else, or a browser's pair not leased to it)
         POST /api/queries/<query_id>/undo       {annotator, release?} -> the asker's answer undone, the query pending again
                                                 and leased to the asker within the cap after giving up `release` (429
                                                 past it; 403 with --no-editing)

Cursor semantics of ``GET /api/runs/<run_id>/answers?after=<seq>``: every label write (create,
edit, undo) takes the next value of one global, strictly increasing sequence number ``seq``.
The endpoint returns, in ``seq`` order, the current state of every label whose last change is
newer than ``after``: a created or edited label appears with its choice, an undone label appears
once as a tombstone with ``choice == "undone"``.  ``cursor`` is the largest ``seq`` returned (or
``after`` when nothing is new).  A reader that keys answers by ``query_id`` and lets the latest
entry win (dropping the entry on ``"undone"``) always ends with the stored state.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import re
import signal
import socket
import sqlite3
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import urlsplit

from flask import Blueprint, Flask, Response, current_app, g, jsonify, request, send_from_directory
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from cleanrlhf_utils import protocol
from cleanrlhf_utils.protocol import (
    CHOICES,
    MAX_ANSWERS_LIMIT,
    MAX_ID,
    MAX_INSTRUCTIONS,
    MAX_META_BYTES,
    MAX_TEXT,
    PHASES,
    RANKED,
    RATED,
    TOKEN_ENV,
    TOKEN_HEADER,
)
from cleanrlhf_utils.rankings import MAX_CLIPS, order_problem
from cleanrlhf_utils.ratings import MAX_SCALE, ratings_problem
from humanFeedback import access, serving
from humanFeedback.access import MAX_JSON_BYTES, UPLOAD_ENDPOINTS, Access

# The largest upload a trainer makes is one evaluation episode's clip: 2.3 MB for 1000 steps of dm_control's walker at
# 576x432 (a pair of 50-step clips: at most 0.27 MB); 16 MiB leaves room for 640x480 and busier scenes.
DEFAULT_MAX_UPLOAD_BYTES = 16 * 1024 * 1024
CLIP_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,195}\.mp4$")
CLIP_NAME_RULE = "a plain file name of letters, digits, '_', '-', '.' ending in .mp4 (no '/', '\\', '..' or leading dot)"
STALE_SECONDS = 120  # a progress report older than this is shown as the last news, not as what happens now
# Pairs one annotator may hold (leased, not answered) at once: the one on screen, the next one loading behind it and one
# whose answer is on its way. One person cannot take a session's pairs away from the others.
MAX_LEASES_PER_ANNOTATOR = 3
BATCH_ROWS = 256  # rows of an upload committed per write transaction, so no upload holds the write lock for long
DB_TIMEOUT_SECONDS = 10  # how long a request waits for the write lock before it is answered 503 with Retry-After
UPLOAD_TMP_PREFIX, UPLOAD_TMP_SUFFIX = ".upload-", ".tmp"  # a clip being written; removed on failure and at start
STATIC_DIR = Path(__file__).resolve().parent / "static"
SCHEMA_PATH = Path(__file__).resolve().parent / "schema.sql"


class ApiError(Exception):
    """An error answered as ``{"error": message}`` with a 4xx status; raised before anything is stored."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# --------------------------------------------------------------------------------------------
# Storage
# --------------------------------------------------------------------------------------------


# Columns a database of an older schema lacks: added at start, filled as that version meant them (an old label or lease
# was its annotator's name's, as the token's are now).
MIGRATIONS = (
    ("evaluations", "kind", "TEXT NOT NULL DEFAULT 'check' CHECK (kind IN ('check', 'agent'))", None),
    ("queries", "lease_holder", "TEXT", "UPDATE queries SET lease_holder = 'token:' || lease_annotator WHERE lease_annotator IS NOT NULL"),
    ("labels", "holder", "TEXT", "UPDATE labels SET holder = 'token:' || annotator"),
    ("labels", "ranking", "TEXT", None),
    ("label_tombstones", "ranking", "TEXT", None),
    ("queries", "rating_scale", "INTEGER", None),
    ("queries", "check_step", "INTEGER", None),
    ("labels", "ratings", "TEXT", None),
    ("label_tombstones", "ratings", "TEXT", None),
)
# Tables whose choice CHECK an older schema wrote without 'ranked' or 'rated' (SQLite cannot change a CHECK in place).
CHOICE_TABLES = ("labels", "label_tombstones")


def schema_statements() -> list[str]:
    """schema.sql's statements one by one (executescript would commit the transaction they run in)."""
    statements, pending = [], ""
    for line in SCHEMA_PATH.read_text().splitlines(keepends=True):
        pending += line
        if sqlite3.complete_statement(pending):
            statements.append(pending)
            pending = ""
    return statements


def accept_new_choices(con: sqlite3.Connection) -> None:
    """A database made before rankings or ratings: its labels and tombstones move, rows unchanged, into tables of
    schema.sql (whose CHECK allows 'ranked' and 'rated'), in one transaction."""
    sql = {name: text for name, text in con.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table'")}
    old = [table for table in CHOICE_TABLES if f"'{RANKED}'" not in sql[table] or f"'{RATED}'" not in sql[table]]
    if not old:
        return
    con.execute("BEGIN IMMEDIATE")
    try:
        con.execute("DROP INDEX IF EXISTS tombstones_query")  # made again by the schema, on the new table
        for table in old:
            con.execute(f"ALTER TABLE {table} RENAME TO before_rankings_{table}")
        for statement in schema_statements():
            con.execute(statement)
        for table in old:
            columns = ", ".join(row[1] for row in con.execute(f"PRAGMA table_info(before_rankings_{table})"))
            con.execute(f"INSERT INTO {table} ({columns}) SELECT {columns} FROM before_rankings_{table}")
            con.execute(f"DROP TABLE before_rankings_{table}")
    except BaseException:
        con.execute("ROLLBACK")
        raise
    con.execute("COMMIT")


class Store:
    def __init__(self, data_dir: Path):
        self.data_dir = data_dir
        self.clips_dir = data_dir / "clips"
        self.db_path = data_dir / "feedback.sqlite3"
        self.clips_dir.mkdir(parents=True, exist_ok=True)
        con = self.connect()
        try:
            mode = con.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode.lower() != "wal":
                raise RuntimeError(f"SQLite refused WAL mode for {self.db_path} (got {mode!r})")
            con.executescript(SCHEMA_PATH.read_text())
            for table, column, declaration, fill in MIGRATIONS:
                if column not in [row[1] for row in con.execute(f"PRAGMA table_info({table})")]:
                    con.execute(f"ALTER TABLE {table} ADD COLUMN {column} {declaration}")
                    if fill is not None:
                        con.execute(fill)
            accept_new_choices(con)
            self.remove_orphan_clips(con)
        finally:
            con.close()

    def remove_orphan_clips(self, con: sqlite3.Connection) -> None:
        """At start, before any upload: what a server killed mid-upload left, the temporary files of the clips it was
        writing and clips whose rows it never committed (no query or evaluation names them). The trainer re-sends such
        a batch whole."""
        for partial in self.clips_dir.glob(f"*/{UPLOAD_TMP_PREFIX}*{UPLOAD_TMP_SUFFIX}"):
            with contextlib.suppress(OSError):
                partial.unlink()
        for folder in self.clips_dir.iterdir():
            if not (folder.is_dir() and folder.name.isascii() and folder.name.isdigit() and len(folder.name) <= 19):
                continue  # not a run's folder: not this server's to judge
            run_id = int(folder.name)
            named = {
                row[0]
                for row in con.execute(
                    "SELECT left_clip FROM queries WHERE run_id = :run UNION SELECT right_clip FROM queries WHERE run_id = :run "
                    "UNION SELECT clip FROM evaluations WHERE run_id = :run "
                    "UNION SELECT c.clip FROM query_clips c JOIN queries q ON q.id = c.query_id WHERE q.run_id = :run",
                    {"run": run_id},
                )
            }
            for clip in folder.glob("*.mp4"):
                if clip.name not in named:
                    with contextlib.suppress(OSError):
                        clip.unlink()

    def connect(self) -> sqlite3.Connection:
        con = sqlite3.connect(self.db_path, timeout=DB_TIMEOUT_SECONDS, isolation_level=None, check_same_thread=False)
        con.row_factory = sqlite3.Row
        con.execute("PRAGMA synchronous=FULL")
        con.execute("PRAGMA foreign_keys=ON")
        con.execute(f"PRAGMA busy_timeout={DB_TIMEOUT_SECONDS * 1000}")
        return con

    def clip_path(self, run_id: int, name: str) -> Path:
        return self.clips_dir / str(run_id) / name


def db() -> sqlite3.Connection:
    if "db" not in g:
        g.db = current_app.extensions["feedback"]["store"].connect()
    return g.db


@contextlib.contextmanager
def write_transaction():
    """One IMMEDIATE transaction: writers are serialised; any exception rolls everything back."""
    con = db()
    con.execute("BEGIN IMMEDIATE")
    try:
        yield con
    except BaseException:
        con.execute("ROLLBACK")
        raise
    con.execute("COMMIT")


def next_seq(con: sqlite3.Connection) -> int:
    con.execute("UPDATE sequence SET value = value + 1 WHERE name = 'label'")
    return con.execute("SELECT value FROM sequence WHERE name = 'label'").fetchone()[0]


# --------------------------------------------------------------------------------------------
# Request helpers and validation
# --------------------------------------------------------------------------------------------


def cfg(key: str):
    return current_app.extensions["feedback"][key]


def cfg_of(app: Flask, key: str):
    return app.extensions["feedback"][key]


def now() -> float:
    return cfg("clock")()


SURROGATE_RE = re.compile("[\ud800-\udfff]")  # half of a UTF-16 pair: JSON can write one, UTF-8 cannot store it
CONTROL_RE = re.compile("[\x00-\x1f\x7f-\x9f]")  # a control character: never part of a name a page shows


def check_json_text(value, what: str) -> None:
    """Every string in a parsed JSON value (keys too) is text UTF-8 can store: a lone surrogate is a 400 naming where."""
    stack = [value]
    while stack:  # not recursive: a JSON value may nest as deep as the parser allowed
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str) and SURROGATE_RE.search(item):
            raise ApiError(400, f"{what} holds {item[:40]!r}, with a lone surrogate (half of a UTF-16 pair); send text as valid UTF-8.")


def parse_json(raw: bytes | str, what: str, expected: str):
    """`raw` parsed as JSON, its text checked (check_json_text); a 400 naming `what` and the `expected` value otherwise."""
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"{what} is not valid JSON ({str(e)[:120]}); send {expected}.") from None
    check_json_text(value, what)
    return value


def json_body(allowed: tuple[str, ...]) -> dict:
    """The request's JSON object; a key outside ``allowed`` is refused (400 naming it)."""
    if (request.content_length or 0) > MAX_JSON_BYTES:
        raise ApiError(413, f"The request body is {request.content_length} bytes; JSON bodies may have at most {MAX_JSON_BYTES} bytes.")
    raw = request.get_data(cache=True)
    if not raw:
        raise ApiError(400, "The request body is empty; send a JSON object.")
    body = parse_json(raw, "The request body", "a JSON object")
    if not isinstance(body, dict):
        raise ApiError(400, f"The request body must be a JSON object, got {type(body).__name__}.")
    extra = sorted(set(body) - set(allowed))
    if extra:
        raise ApiError(400, f"Unknown field(s) {', '.join(extra)[:200]}; allowed fields are {', '.join(allowed)}.")
    return body


def plain_text(value, limit: int = MAX_TEXT) -> str | None:
    """`value` stripped if it is a name a page can show: a string of 1 to `limit` characters, valid UTF-8 (no lone
    surrogate) and no control character; else None."""
    if not isinstance(value, str):
        return None
    value = value.strip()
    return value if 0 < len(value) <= limit and not SURROGATE_RE.search(value) and not CONTROL_RE.search(value) else None


def text_field(body: dict, key: str, required: bool = True) -> str | None:
    value = body.get(key)
    if value is None and not required:
        return None
    text = plain_text(value)
    if text is None:
        shown = "missing" if value is None else repr(value)[:60]
        raise ApiError(
            400, f"Field '{key}' is {shown}; it must be a non-empty string of at most {MAX_TEXT} characters, without control characters."
        )
    return text


def annotator_arg(value) -> str:
    text = plain_text(value)
    if text is None:
        shown = "missing" if value is None else repr(value)[:60]
        raise ApiError(
            400, f"annotator is {shown}; it must be a non-empty name of at most {MAX_TEXT} characters, without control characters."
        )
    return text


def id_value(value, what: str):
    """Segment ids and sessions: an integer or a non-empty string (valid UTF-8, no control character)."""
    ok_int = isinstance(value, int) and not isinstance(value, bool) and abs(value) <= MAX_ID
    ok_text = (
        isinstance(value, str) and value and len(value) <= MAX_TEXT and not SURROGATE_RE.search(value) and not CONTROL_RE.search(value)
    )
    if not (ok_int or ok_text):
        shown = repr(value)[:60]
        raise ApiError(400, f"{what} is {shown}; it must be a 64-bit integer or a non-empty string of at most {MAX_TEXT} characters.")
    return value


def check_clip_name(name, what: str) -> str:
    if not isinstance(name, str) or ".." in name or not CLIP_NAME_RE.match(name):
        raise ApiError(400, f"{what} {name!r} is not allowed; use {CLIP_NAME_RULE}.")
    return name


def int_arg(name: str, default: int, minimum: int = 0, maximum: int = MAX_ID) -> int:
    raw = request.args.get(name)
    if raw is None or raw == "":
        return default
    value = int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= len(str(MAX_ID)) else None  # bounded before int()
    if value is None or value < minimum or value > maximum:
        allowed = f"an integer >= {minimum}" + (f" and <= {maximum}" if maximum < MAX_ID else "")
        raise ApiError(400, f"Query parameter {name}={raw[:40]!r} is not allowed; use {allowed}.")
    return value


def require_run(con: sqlite3.Connection, run_id: int) -> sqlite3.Row:
    row = con.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
    if row is None:
        raise ApiError(404, f"Run {run_id} does not exist; create it with POST /api/runs or use an existing run id.")
    return row


def require_query(con: sqlite3.Connection, query_id: int) -> sqlite3.Row:
    row = con.execute("SELECT * FROM queries WHERE id = ?", (query_id,)).fetchone()
    if row is None:
        raise ApiError(404, f"Query {query_id} does not exist; use a query id returned by the server.")
    return row


def clip_url(run_id: int, name: str) -> str:
    return protocol.path(protocol.CLIP, run_id=run_id, name=name)


# --------------------------------------------------------------------------------------------
# Multipart batch uploads (queries and evaluations): a JSON list of entries plus the clips they name
# --------------------------------------------------------------------------------------------


def parse_upload(field: str) -> tuple[list, dict[str, bytes]]:
    """Reads the JSON list in form field ``field`` and the uploaded clip files keyed by filename."""
    if not (request.content_type or "").startswith("multipart/form-data"):
        raise ApiError(
            400,
            f"Content type {request.content_type!r} is not allowed; send multipart/form-data with a '{field}' field and the clip files.",
        )
    raw = request.form.get(field)
    if raw is None:
        raise ApiError(400, f"Form field '{field}' is missing; send it as a JSON list.")
    items = parse_json(raw, f"Form field '{field}'", "a JSON list")
    if not isinstance(items, list) or not items:
        raise ApiError(400, f"Form field '{field}' must be a non-empty JSON list of objects.")
    files: dict[str, bytes] = {}
    for _field, storage in request.files.items(multi=True):
        name = check_clip_name(storage.filename, "Uploaded file name")
        if name in files:
            raise ApiError(400, f"Uploaded file name {name!r} appears twice; upload each clip once.")
        data = storage.read()
        if len(data) < 8 or data[4:8] != b"ftyp":
            raise ApiError(400, f"Uploaded file {name!r} is not an mp4 video (no 'ftyp' box at byte 4); upload mp4 clips only.")
        files[name] = data
    return items, files


def check_item_keys(item, index: int, what: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict:
    keys = ", ".join(required) + "".join(f" (and optionally {key})" for key in optional)
    if not isinstance(item, dict):
        raise ApiError(400, f"{what}[{index}] is {type(item).__name__}; each entry must be an object with keys {keys}.")
    missing = [k for k in required if k not in item]
    extra = sorted(set(item) - set(required) - set(optional))
    if missing or extra:
        problem = f"lacks {', '.join(missing)}" if missing else f"has unknown keys {', '.join(extra)}"
        raise ApiError(400, f"{what}[{index}] {problem}; each entry must have exactly the keys {keys}.")
    return item


def check_files_referenced(files: dict[str, bytes], referenced: set[str]) -> None:
    for name in referenced:
        if name not in files:
            raise ApiError(400, f"Clip {name!r} is referenced but was not uploaded; send it as a file part with that file name.")
    for name in files:
        if name not in referenced:
            raise ApiError(400, f"Uploaded file {name!r} is not referenced by any entry; upload only the clips you reference.")


def write_new_file(path: Path, data: bytes) -> bool:
    """Creates ``path`` with ``data`` (fsynced) unless it exists; True if this call created it.

    The bytes go to a temporary file that is then hard-linked to ``path``, which fails if ``path``
    exists: two uploads racing for one name never overwrite each other.  The caller fsyncs the folder.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=UPLOAD_TMP_PREFIX, suffix=UPLOAD_TMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        return True
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def check_same_clip(path: Path, name: str, run_id: int, data: bytes) -> None:
    if hashlib.sha256(path.read_bytes()).digest() != hashlib.sha256(data).digest():
        raise ApiError(409, f"Clip {name!r} already exists in run {run_id} with different content; give new clips new names.")


def store_clips(run_id: int, files: dict[str, bytes], created: list[Path]) -> None:
    """Writes new clips; an existing clip of the same name must hold the same bytes (409 otherwise).

    Runs outside any transaction (writing thousands of fsynced files must not hold the write lock).
    Paths created are appended to ``created`` so the caller can remove them if the rows are refused.
    """
    store: Store = cfg("store")
    folder = store.clips_dir / str(run_id)
    folder.mkdir(parents=True, exist_ok=True)
    new = {}
    for name, data in files.items():  # every conflict is found before the first file is written
        path = store.clip_path(run_id, name)
        if path.exists():
            check_same_clip(path, name, run_id, data)
        else:
            new[name] = (path, data)

    # fsyncs in parallel share the file system's journal commits: several times faster than one by one
    def write(item):
        try:
            return write_new_file(*item)
        except OSError as e:
            return e

    with ThreadPoolExecutor(max_workers=8) as pool:
        made = list(pool.map(write, new.values()))
    created.extend(path for (path, _), ok in zip(new.values(), made) if ok is True)
    for (name, (path, data)), ok in zip(new.items(), made):
        if isinstance(ok, OSError):
            raise ok
        if not ok:  # another upload created it meanwhile
            check_same_clip(path, name, run_id, data)
    if created:
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def clip_is_referenced(con: sqlite3.Connection, run_id: int, name: str) -> bool:
    return (
        con.execute(
            "SELECT 1 FROM queries WHERE run_id = ? AND (left_clip = ? OR right_clip = ?) "
            "UNION ALL SELECT 1 FROM evaluations WHERE run_id = ? AND clip = ? "
            "UNION ALL SELECT 1 FROM query_clips c JOIN queries q ON q.id = c.query_id WHERE q.run_id = ? AND c.clip = ? LIMIT 1",
            (run_id, name, name, run_id, name, run_id, name),
        ).fetchone()
        is not None
    )


def store_batch(run_id: int, field: str, check_entry, find_entry, insert_entry) -> list[int]:
    """Stores a multipart batch and returns one id per entry.

    ``check_entry(index, entry, clips_named)`` validates one entry of the JSON list in form field
    ``field``, adds the clip names it uses to ``clips_named`` and returns the row to store; every
    uploaded file must be named by an entry and every named clip uploaded.  ``find_entry(con, run_id,
    index, row)`` returns the id of an identical row stored before, None if there is none, and raises
    409 if a stored row differs; ``insert_entry(con, run_id, row, stamp)`` stores a new row.

    Every entry and clip is checked against what is stored before anything is written, so a refused
    batch stores nothing.  The clips are then written outside any transaction, and the rows committed
    BATCH_ROWS at a time, so that a large upload never holds the write lock for long (annotators'
    requests get their turn in between).  A server killed mid-upload may keep the first chunks;
    re-sending the same batch completes it (entries and clips are idempotent).
    """
    con = db()
    require_run(con, run_id)
    entries, files = parse_upload(field)
    clips_named: set[str] = set()
    rows = [check_entry(i, entry, clips_named) for i, entry in enumerate(entries)]
    check_files_referenced(files, clips_named)
    for i, row in enumerate(rows):
        find_entry(con, run_id, i, row)
    created: list[Path] = []
    ids: list[int] = []
    try:
        store_clips(run_id, files, created)
        for start in range(0, len(rows), BATCH_ROWS):
            with write_transaction() as con:
                require_run(con, run_id)
                stamp = utc_now()
                for i in range(start, min(start + BATCH_ROWS, len(rows))):
                    old = find_entry(con, run_id, i, rows[i])
                    ids.append(old if old is not None else insert_entry(con, run_id, rows[i], stamp))
    except BaseException:
        con = db()
        for path in created:  # only clips that no stored row names (a concurrent upload may name the same clip)
            if not clip_is_referenced(con, run_id, path.name):
                with contextlib.suppress(OSError):
                    path.unlink()
        raise
    return ids


PAIR_KEYS = ("left_clip", "right_clip", "left_segment_id", "right_segment_id", "session")
RANKING_KEYS = ("clips", "segment_ids", "session")


def check_rating_scale(i: int, item) -> int | None:
    """A query's rating scale: None for a ranking (no rating_scale), else an integer in [2, MAX_SCALE]."""
    scale = item.get("rating_scale")
    if scale is not None and not (isinstance(scale, int) and not isinstance(scale, bool) and 2 <= scale <= MAX_SCALE):
        raise ApiError(400, f"queries[{i}].rating_scale is {repr(scale)[:40]}; it must be an integer from 2 to {MAX_SCALE}.")
    return scale


def check_step_of(i: int, item) -> int | None:
    """A query of the reward-model check's clips (check_step: the step of the check) or None."""
    step = item.get("check_step")
    if step is not None and not (isinstance(step, int) and not isinstance(step, bool) and 0 <= step <= MAX_ID):
        raise ApiError(400, f"queries[{i}].check_step is {repr(step)[:40]}; it must be the check's step, an integer from 0.")
    if step is not None and item.get("rating_scale") is not None:
        raise ApiError(400, f"queries[{i}] has check_step and rating_scale; the check's clips are reordered, not rated.")
    return step


def check_ranking_entry(i: int, item) -> tuple[tuple, tuple, int | None]:
    """A query of 3 to MAX_CLIPS clips to rank, of 2 to MAX_CLIPS clips to rate (with its rating_scale), or of 2 to
    MAX_CLIPS check clips to reorder (with its check_step): its clip names and segment ids, in the order shown, and its
    scale (None: a ranking or a check)."""
    check_item_keys(item, i, "queries", RANKING_KEYS, optional=("rating_scale", "check_step"))
    names, segments, scale = item["clips"], item["segment_ids"], check_rating_scale(i, item)
    fewest = 3 if scale is None and check_step_of(i, item) is None else 2
    if not (isinstance(names, list) and fewest <= len(names) <= MAX_CLIPS):
        kind = "to rate" if scale else "to reorder" if fewest == 2 else "to rank (a pair sends left_clip and right_clip)"
        raise ApiError(400, f"queries[{i}].clips must be a list of {fewest} to {MAX_CLIPS} clip names {kind}.")
    if not (isinstance(segments, list) and len(segments) == len(names)):
        raise ApiError(400, f"queries[{i}].segment_ids must be a list of one segment id per clip ({len(names)}).")
    names = tuple(check_clip_name(name, f"queries[{i}].clips[{k}]") for k, name in enumerate(names))
    if len(set(names)) < len(names):
        raise ApiError(400, f"queries[{i}].clips names a clip twice; a ranking's clips must differ.")
    return names, tuple(id_value(segment, f"queries[{i}].segment_ids[{k}]") for k, segment in enumerate(segments)), scale


def check_query_entry(i: int, item, clips_named: set[str]) -> tuple:
    """A pair (left_clip, right_clip and their segment ids), a ranking (clips and segment_ids), clips to rate (and
    rating_scale) or check clips to reorder (and check_step): the row to store, the first two clips in the left and
    right columns, a ranking's or rating's clips and segment ids (None for a pair, and for two check clips, which are a
    pair), the rating scale and the check step (None where it has none)."""
    if isinstance(item, dict) and "clips" in item:
        names, segments, scale = check_ranking_entry(i, item)
        clips_named.update(names)
        check_step = check_step_of(i, item)
        listed = (None, None) if check_step is not None and len(names) == 2 else (names, segments)
        return (id_value(item["session"], f"queries[{i}].session"), *names[:2], *segments[:2], *listed, scale, check_step)
    check_item_keys(item, i, "queries", PAIR_KEYS)
    left = check_clip_name(item["left_clip"], f"queries[{i}].left_clip")
    right = check_clip_name(item["right_clip"], f"queries[{i}].right_clip")
    if left == right:
        raise ApiError(400, f"queries[{i}] compares clip {left!r} with itself; left_clip and right_clip must differ.")
    row = (
        id_value(item["session"], f"queries[{i}].session"),
        left,
        right,
        id_value(item["left_segment_id"], f"queries[{i}].left_segment_id"),
        id_value(item["right_segment_id"], f"queries[{i}].right_segment_id"),
        None,
        None,
        None,
        None,
    )
    clips_named.update((left, right))
    return row


def ranked_clips(con: sqlite3.Connection, query_id: int) -> tuple[tuple, tuple] | tuple[None, None]:
    """A ranking's or rating's clip names and segment ids in the order shown; (None, None) for a pair."""
    rows = con.execute("SELECT clip, segment_id FROM query_clips WHERE query_id = ? ORDER BY position", (query_id,)).fetchall()
    if not rows:
        return None, None
    return tuple(r["clip"] for r in rows), tuple(r["segment_id"] for r in rows)


def find_query(con: sqlite3.Connection, run_id: int, i: int, row: tuple) -> int | None:
    session, left, right, lseg, rseg, names, segments, scale, check_step = row
    old = con.execute("SELECT * FROM queries WHERE run_id = ? AND left_clip = ? AND right_clip = ?", (run_id, left, right)).fetchone()
    if old is None:
        return None
    stored = (old["session"], old["left_segment_id"], old["right_segment_id"], *ranked_clips(con, old["id"]), old["rating_scale"])
    if stored + (old["check_step"],) != (session, lseg, rseg, names, segments, scale, check_step):
        raise ApiError(
            409,
            f"queries[{i}] ({left!r} vs {right!r}) already exists as query {old['id']} with session "
            f"{old['session']!r} and segments {old['left_segment_id']!r}/{old['right_segment_id']!r} (or other clips); "
            "re-send identical entries or use new clip names.",
        )
    return old["id"]


def insert_query(con: sqlite3.Connection, run_id: int, row: tuple, stamp: str) -> int:
    session, left, right, lseg, rseg, names, segments, scale, check_step = row
    query_id = con.execute(
        "INSERT INTO queries (run_id, session, left_clip, right_clip, left_segment_id, right_segment_id, created_at, rating_scale, "
        "check_step) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (run_id, session, left, right, lseg, rseg, stamp, scale, check_step),
    ).lastrowid
    if names is not None:
        con.executemany(
            "INSERT INTO query_clips (query_id, position, clip, segment_id) VALUES (?, ?, ?, ?)",
            [(query_id, k, name, segment) for k, (name, segment) in enumerate(zip(names, segments, strict=True))],
        )
    return query_id


EVALUATION_KINDS = ("check", "agent")


def check_evaluation_entry(i: int, item, clips_named: set[str]) -> tuple:
    check_item_keys(item, i, "evaluations", ("clip", "predicted_return", "step"), optional=("kind",))
    name = check_clip_name(item["clip"], f"evaluations[{i}].clip")
    ret, step, kind = item["predicted_return"], item["step"], item.get("kind", "check")
    if kind not in EVALUATION_KINDS:
        raise ApiError(400, f"evaluations[{i}].kind is {kind!r}; it must be one of {', '.join(EVALUATION_KINDS)}.")
    if isinstance(ret, bool) or not isinstance(ret, (int, float)) or not math.isfinite(ret):
        raise ApiError(400, f"evaluations[{i}].predicted_return is {ret!r}; it must be a finite number.")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_ID:
        raise ApiError(400, f"evaluations[{i}].step is {step!r}; it must be an integer >= 0.")
    if name in clips_named:
        raise ApiError(400, f"evaluations[{i}].clip {name!r} appears twice; each clip gets one evaluation.")
    clips_named.add(name)
    return name, float(ret), step, kind


def find_evaluation(con: sqlite3.Connection, run_id: int, i: int, row: tuple) -> int | None:
    name, ret, step, kind = row
    old = con.execute("SELECT * FROM evaluations WHERE run_id = ? AND clip = ?", (run_id, name)).fetchone()
    if old is None:
        return None
    if (old["predicted_return"], old["step"], old["kind"]) != (ret, step, kind):
        raise ApiError(
            409,
            f"evaluations[{i}].clip {name!r} already has predicted_return {old['predicted_return']!r} at step "
            f"{old['step']!r}; re-send identical entries or use a new clip name.",
        )
    return old["id"]


def insert_evaluation(con: sqlite3.Connection, run_id: int, row: tuple, stamp: str) -> int:
    name, ret, step, kind = row
    return con.execute(
        "INSERT INTO evaluations (run_id, clip, predicted_return, step, created_at, kind) VALUES (?, ?, ?, ?, ?, ?)",
        (run_id, name, ret, step, stamp, kind),
    ).lastrowid


# --------------------------------------------------------------------------------------------
# Query / label helpers
# --------------------------------------------------------------------------------------------


def run_counts(con: sqlite3.Connection, run_id: int) -> dict:
    """The run's answers: labels (left, right, tie: what the reward model learns from) and skips, and ``seq``, the
    label sequence when they were counted: of two counts, the one with the larger seq is the newer."""
    labelled, skipped = con.execute(
        "SELECT COALESCE(SUM(l.choice <> 'skip'), 0), COALESCE(SUM(l.choice = 'skip'), 0) "
        "FROM labels l JOIN queries q ON q.id = l.query_id WHERE q.run_id = ?",
        (run_id,),
    ).fetchone()
    seq = con.execute("SELECT value FROM sequence WHERE name = 'label'").fetchone()[0]
    return {"total_labelled": labelled, "total_skipped": skipped, "seq": seq}


def progress_for(con: sqlite3.Connection, run_id: int, session) -> dict:
    """Answered (labelled or skipped) and total pairs of a session, and the run's counts (run_counts).  session_total
    is the size the trainer declared (POST .../progress with session_size) when it did, so it does not grow while
    pairs upload."""
    uploaded, session_answered = con.execute(
        "SELECT COUNT(*), COUNT(l.id) FROM queries q LEFT JOIN labels l ON l.query_id = q.id WHERE q.run_id = ? AND q.session IS ?",
        (run_id, session),
    ).fetchone()
    declared = con.execute("SELECT size FROM session_sizes WHERE run_id = ? AND session IS ?", (run_id, session)).fetchone()
    session_total = max(uploaded, declared[0] if declared else 0)
    return {"session_answered": session_answered, "session_total": session_total, **run_counts(con, run_id)}


def run_instructions(con: sqlite3.Connection, run_id: int) -> dict:
    """What the page shows above a run's clips: its name, the question to judge (meta "instructions") and how long
    a clip lasts in the environment's time (meta "clip_seconds"), as the trainer set them at run creation."""
    run = con.execute("SELECT name, meta FROM runs WHERE id = ?", (run_id,)).fetchone()
    meta = json.loads(run["meta"])
    instructions, seconds = meta.get("instructions"), meta.get("clip_seconds")
    return {
        "run_name": run["name"],
        "instructions": instructions[:MAX_INSTRUCTIONS] if isinstance(instructions, str) and instructions.strip() else None,
        "clip_seconds": seconds if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and seconds > 0 else None,
    }


def query_payload(con: sqlite3.Connection, q: sqlite3.Row) -> dict:
    """What the page shows of a query: its kind ("pair", "ranking" of 3 or more clips, or "rating" of each clip with
    its rating_scale) and every clip's URL in the order shown (a pair's also as left_url and right_url)."""
    names = ranked_clips(con, q["id"])[0] or (q["left_clip"], q["right_clip"])
    kind = "rating" if q["rating_scale"] else "pair" if len(names) == 2 else "ranking"
    return {
        "query_id": q["id"],
        "run_id": q["run_id"],
        **run_instructions(con, q["run_id"]),
        "kind": kind,
        **({"rating_scale": q["rating_scale"]} if q["rating_scale"] else {}),
        **({"check_step": q["check_step"]} if q["check_step"] is not None else {}),
        "clip_urls": [clip_url(q["run_id"], name) for name in names],
        "left_url": clip_url(q["run_id"], q["left_clip"]),
        "right_url": clip_url(q["run_id"], q["right_clip"]),
        "session": q["session"],
        "lease_expires": q["lease_expires"],
        "progress": progress_for(con, q["run_id"], q["session"]),
    }


def principal() -> access.Principal:
    """Whom the request speaks for (access.Access.judge, in check_access)."""
    return g.principal


def lease(con: sqlite3.Connection, query_id: int, annotator: str, holder: str) -> None:
    con.execute(
        "UPDATE queries SET lease_annotator = ?, lease_expires = ?, lease_holder = ? WHERE id = ?",
        (annotator, now() + cfg("lease_seconds"), holder, query_id),
    )


UNLABELLED = "NOT EXISTS (SELECT 1 FROM labels l WHERE l.query_id = q.id)"
ASKED = "q.check_step IS NULL"  # a query the trainer asks (the check's clips are reordered from the check view instead)


def pairs_held(con: sqlite3.Connection, holder: str, besides: int | None = None) -> int:
    """Unanswered pairs leased to `holder` now (the cap counts these), leaving out query `besides`."""
    sql = f"SELECT COUNT(*) FROM queries q WHERE q.lease_holder = ? AND q.lease_expires > ? AND {UNLABELLED} AND q.id IS NOT ?"
    return con.execute(sql, (holder, now(), besides)).fetchone()[0]


def run_payload(r: sqlite3.Row, with_meta: bool = False) -> dict:
    payload = {"run_id": r["id"], "name": r["name"], "env_id": r["env_id"], "created_at": r["created_at"]}
    if with_meta:
        payload["meta"] = json.loads(r["meta"])
    return payload


# --------------------------------------------------------------------------------------------
# Page and clips blueprints
# --------------------------------------------------------------------------------------------

page = Blueprint("page", __name__)
clips = Blueprint("clips", __name__)


@page.get(protocol.PAGE)
def annotation_page():
    resp = send_from_directory(STATIC_DIR, "index.html", mimetype="text/html", max_age=0)
    resp.headers["Cache-Control"] = "no-store"
    return resp


@page.get(protocol.PAGE_SCRIPT)
def page_script(name: str):
    """The page's ES modules (static/js/*.js): served as JavaScript, which a browser requires of a module script."""
    resp = send_from_directory(STATIC_DIR / "js", name, mimetype="text/javascript", max_age=0)
    resp.headers["Cache-Control"] = "no-store"  # a page and its modules always from the same checkout
    return resp


@clips.get(protocol.CLIP)
def serve_clip(run_id: int, name: str):
    check_clip_name(name, "Clip name")
    require_run(db(), run_id)
    run_dir = cfg("store").clips_dir / str(run_id)
    return send_from_directory(run_dir, name, mimetype="video/mp4", conditional=True, max_age=3600)


# --------------------------------------------------------------------------------------------
# API blueprint: config and runs
# --------------------------------------------------------------------------------------------

api = Blueprint("api", __name__)


@api.get(protocol.CONFIG)
def show_config():
    return jsonify(
        choices=cfg("choices"),
        allow_ties="tie" in cfg("choices"),
        allow_skip="skip" in cfg("choices"),
        allow_editing=cfg("allow_editing"),
        playback_speed=cfg("playback_speed"),
        lease_seconds=cfg("lease_seconds"),
        role=principal().role,
    )


@api.get(protocol.SERVER_PROOF)
def server_proof():
    """The answer to a trainer's challenge (protocol.server_proof): it proves this server holds the token without
    showing it, so that a trainer never sends its token to something else squatting on the port."""
    nonce, token = request.args.get("nonce", ""), cfg("token")
    if not protocol.NONCE_PATTERN.fullmatch(nonce):
        raise ApiError(400, f"nonce {nonce[:40]!r} is not allowed; use 16 to 128 letters, digits, '_' or '-'.")
    return jsonify(proof=None if token is None else protocol.server_proof(token, nonce))


def invitation_reply(invitation: int, code: str, role: str, name: str):
    return jsonify(
        invitation_id=invitation, url=access.login_url("", code), expires_seconds=access.LOGIN_CODE_SECONDS, role=role, name=name
    ), 201


@api.post(protocol.LOGIN_CODES)
def make_login_code():
    """The trainer's own one-time login link (the trainer prints one when it starts): a browser with the trainer's role."""
    json_body(())
    invitation, code = access.new_invitation(db(), now(), "trainer", "the trainer's login link")
    return invitation_reply(invitation, code, "trainer", "the trainer's login link")


@api.post(protocol.INVITATIONS)
def make_invitation():
    """A one-time login link for someone else (the page's "Invite someone"): an annotator, who sees pairs and answers them."""
    body = json_body(("name",))
    name = text_field(body, "name", required=False) or ""
    invitation, code = access.new_invitation(db(), now(), "annotator", name)
    return invitation_reply(invitation, code, "annotator", name)


@api.get(protocol.INVITATIONS)
def list_invitations():
    """Every invitation, newest first: its role, name, state (waiting, in use, expired, revoked) and times."""
    rows = db().execute("SELECT * FROM invitations ORDER BY id DESC").fetchall()
    fields = ("role", "name", "created_at", "expires_at", "used_at", "revoked_at")
    return jsonify(
        invitations=[{"invitation_id": r["id"], **{k: r[k] for k in fields}, "state": access.invitation_state(r, now())} for r in rows]
    )


@api.post(protocol.INVITATION_REVOKE)
def revoke_invitation(invitation_id: int):
    """The invitation's code is dead and the browsers it let in are logged out (their next request is a 401); the pairs
    they held are free for others at once."""
    json_body(())
    with write_transaction() as con:
        row = con.execute("SELECT * FROM invitations WHERE id = ?", (invitation_id,)).fetchone()
        if row is None:
            raise ApiError(404, f"Invitation {invitation_id} does not exist; GET {protocol.INVITATIONS} lists them.")
        if row["revoked_at"] is None:
            con.execute("UPDATE invitations SET revoked_at = ? WHERE id = ?", (now(), invitation_id))
        prefix = access.grant_of(row["role"], invitation_id) + ":"
        con.execute(
            "UPDATE queries SET lease_annotator = NULL, lease_expires = NULL, lease_holder = NULL WHERE substr(lease_holder, 1, ?) = ?",
            (len(prefix), prefix),
        )
    cfg("access").revoked.add(invitation_id)
    return jsonify(invitation_id=invitation_id, state="revoked")


@api.get(protocol.RUNS)
def list_runs():
    rows = db().execute("SELECT id, name, env_id, created_at FROM runs ORDER BY id").fetchall()
    return jsonify(runs=[run_payload(r) for r in rows])


@api.get(protocol.RUN)
def show_run(run_id: int):
    return jsonify(run_payload(require_run(db(), run_id), with_meta=True))


@api.post(protocol.RUNS)
def create_run():
    body = json_body(("name", "env_id", "meta"))
    name = text_field(body, "name")
    env_id = text_field(body, "env_id", required=False)
    meta = body.get("meta", {})
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise ApiError(400, f"Field 'meta' is {type(meta).__name__}; it must be a JSON object.")
    try:
        meta_json = json.dumps(meta, allow_nan=False)
    except ValueError:
        raise ApiError(400, "Field 'meta' contains NaN or Infinity; it must be a JSON object of finite values.") from None
    if len(meta_json.encode()) > MAX_META_BYTES:
        raise ApiError(413, f"Field 'meta' is {len(meta_json.encode())} bytes as JSON; it may have at most {MAX_META_BYTES} bytes.")
    with write_transaction() as con:
        existing = con.execute("SELECT * FROM runs WHERE name = ?", (name,)).fetchone()
        if existing is not None:
            if existing["env_id"] != env_id:
                raise ApiError(
                    409, f"Run name {name!r} already exists with env_id {existing['env_id']!r}, not {env_id!r}; use a new run name."
                )
            return jsonify(run_id=existing["id"], created=False), 200
        cur = con.execute(
            "INSERT INTO runs (name, env_id, created_at, meta) VALUES (?, ?, ?, ?)",
            (name, env_id, utc_now(), meta_json),
        )
        run_id = cur.lastrowid
    return jsonify(run_id=run_id, created=True), 201


@api.get(protocol.RUN_STATUS)
def run_status(run_id: int):
    con = db()
    require_run(con, run_id)
    total = con.execute(f"SELECT COUNT(*) FROM queries q WHERE q.run_id = ? AND {ASKED}", (run_id,)).fetchone()[0]
    by_choice = dict.fromkeys(CHOICES, 0)  # and "ranked" or "rated", where rankings or ratings are answered
    for choice, n in con.execute(
        "SELECT l.choice, COUNT(*) FROM labels l JOIN queries q ON q.id = l.query_id WHERE q.run_id = ? GROUP BY l.choice", (run_id,)
    ):
        by_choice[choice] = n
    labelled = sum(by_choice.values())
    return jsonify(run_id=run_id, queries=total, labelled=labelled, pending=total - labelled, choices=by_choice)


def count_field(body: dict, key: str, maximum: int = MAX_ID) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= maximum:
        raise ApiError(400, f"Field '{key}' is {value!r}; it must be an integer from 0 to {maximum}.")
    return value


def seconds_field(body: dict, key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 <= value <= 1e9:
        raise ApiError(400, f"Field '{key}' is {value!r}; it must be a number of seconds from 0 to 1e9.")
    return float(value)


PROGRESS_COUNTS = ("step", "total_steps", "sessions_done", "sessions_total", "next_session_step", "session_size")
PROGRESS_FIELDS = (*PROGRESS_COUNTS, "phase", "session", "seconds_to_next_session", "steps_per_second", "agreement")
MAX_AGREEMENTS = 100  # annotators in one report's agreement


def agreement_field(body: dict) -> dict | None:
    """How often the reward model agrees with each annotator's answers: {annotator: share from 0 to 1}."""
    value = body.get("agreement")
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_AGREEMENTS:
        raise ApiError(400, f"Field 'agreement' must be an object of at most {MAX_AGREEMENTS} annotators, each with a share from 0 to 1.")
    for name, share in value.items():
        annotator_arg(name)
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
            raise ApiError(400, f"Field 'agreement' gives {name!r} the share {share!r}; it must be a number from 0 to 1.")
    return {name.strip(): float(share) for name, share in value.items()}


@api.post(protocol.RUN_PROGRESS)
def report_progress(run_id: int):
    """The trainer's news, shown on the page between sessions; with session and session_size it also declares how
    many pairs that session will have.  Each report replaces the previous one."""
    body = json_body(PROGRESS_FIELDS)
    if body.get("step") is None:
        raise ApiError(400, "Field 'step' is missing; it must be an integer from 0 to 9223372036854775807.")
    report = {key: count_field(body, key) for key in PROGRESS_COUNTS}
    if body.get("phase") not in PHASES:
        raise ApiError(400, f"Field 'phase' is {body.get('phase')!r}; it must be one of {', '.join(PHASES)}.")
    report["phase"] = body["phase"]
    report["session"] = None if body.get("session") is None else id_value(body["session"], "Field 'session'")
    for key in ("seconds_to_next_session", "steps_per_second"):
        report[key] = seconds_field(body, key)
    report["agreement"] = agreement_field(body)
    if report["session_size"] is not None and report["session"] is None:
        raise ApiError(400, "Field 'session_size' needs field 'session' (the session it counts the pairs of).")
    report = {key: value for key, value in report.items() if value is not None}
    with write_transaction() as con:
        require_run(con, run_id)
        con.execute(
            "INSERT INTO run_progress (run_id, report, reported_at) VALUES (?, ?, ?) "
            "ON CONFLICT (run_id) DO UPDATE SET report = excluded.report, reported_at = excluded.reported_at",
            (run_id, json.dumps(report), now()),
        )
        trainer_seen(run_id)
        if "session_size" in report:
            con.execute(
                "INSERT INTO session_sizes (run_id, session, size) VALUES (?, ?, ?) "
                "ON CONFLICT (run_id, session) DO UPDATE SET size = excluded.size",
                (run_id, report["session"], report["session_size"]),
            )
        # every label write up to here was answered under the previous report: one that reports "finished" reads answers
        # up to this seq and no further, so what the page told a person (learned or not) is what the run does
        label_seq = con.execute("SELECT value FROM sequence WHERE name = 'label'").fetchone()[0]
    return jsonify(run_id=run_id, progress=report, label_seq=label_seq), 200


def learning(con: sqlite3.Connection, run_id: int) -> str:
    """Whether an answer given to the run now is learned from, by the run's last report: `yes` while it trains (a
    trainer reads every answer, edit and undo until its end), `on resume` when it stopped before its end (the resumed
    run reads them), `no` once it finished."""
    row = con.execute("SELECT report FROM run_progress WHERE run_id = ?", (run_id,)).fetchone()
    phase = json.loads(row["report"]).get("phase") if row else None
    return {"finished": "no", "stopped": "on resume"}.get(phase, "yes")


def progress_reports(con: sqlite3.Connection, run_id: int | None) -> list[dict]:
    """The latest report of each run (or of one), newest first, with its age in seconds and whether it is stale."""
    sql = "SELECT p.run_id, p.report, p.reported_at, r.name FROM run_progress p JOIN runs r ON r.id = p.run_id"
    rows = con.execute(
        sql + (" WHERE p.run_id = ?" if run_id else "") + " ORDER BY p.reported_at DESC LIMIT 20", (run_id,) if run_id else ()
    )
    reports = []
    for r in rows:
        age = max(0.0, now() - r["reported_at"])
        head = {"run_id": r["run_id"], "run_name": r["name"]}
        reports.append(head | json.loads(r["report"]) | {"age_seconds": round(age, 1), "stale": age > STALE_SECONDS})
    return reports


def trainer_seen(run_id: int) -> None:
    """The run's trainer asked for answers or reported: it is alive (kept in memory, for the page's run state)."""
    cfg("trainer_seen")[run_id] = now()


@api.get(protocol.RUN_PROGRESS)
def show_progress(run_id: int):
    """The run's state for the page: the trainer's last report, how long ago the trainer last read answers or reported
    (None: not since this server started), and the run's counts of labels, skips and pairs waiting."""
    con = db()
    require_run(con, run_id)
    reports = progress_reports(con, run_id)
    seen = cfg("trainer_seen").get(run_id)
    pending = con.execute(f"SELECT COUNT(*) FROM queries q WHERE q.run_id = ? AND {ASKED} AND {UNLABELLED}", (run_id,)).fetchone()[0]
    return jsonify(
        run_id=run_id,
        progress=reports[0] if reports else None,
        trainer_seen_seconds=None if seen is None else round(max(0.0, now() - seen), 1),
        pending=pending,
        **run_counts(con, run_id),
    )


# --------------------------------------------------------------------------------------------
# API blueprint: queries, labels, answers
# --------------------------------------------------------------------------------------------


@api.post(protocol.RUN_QUERIES)
def upload_queries(run_id: int):
    return jsonify(query_ids=store_batch(run_id, "queries", check_query_entry, find_query, insert_query)), 201


def query_ids_arg(raw: str, what: str, most: int) -> list[int]:
    """A comma-separated list of at most `most` query ids (each bounded before it is read as a number)."""
    ids = []
    for part in filter(None, (p.strip() for p in raw.split(","))):
        if not (part.isascii() and part.isdigit() and len(part) <= len(str(MAX_ID))) or int(part) > MAX_ID or len(ids) == most:
            raise ApiError(400, f"{what}={raw[:60]!r} is not allowed; use a comma-separated list of at most {most} query ids.")
        ids.append(int(part))
    return ids


MAX_EXCLUDE = 1000  # query ids one /api/next may leave out (the page's pairs on screen and answers not yet sent)


@api.get(protocol.NEXT_QUERY)
def next_query():
    annotator = annotator_arg(request.args.get("annotator"))
    holder = principal().holder(annotator)
    run_id = int_arg("run_id", default=0, minimum=1) if request.args.get("run_id") else None
    exclude = query_ids_arg(request.args.get("exclude", ""), "exclude", MAX_EXCLUDE)
    with write_transaction() as con:
        if run_id is not None:
            require_run(con, run_id)
        held = pairs_held(con, holder)
        sql = f"SELECT q.* FROM queries q WHERE {UNLABELLED} AND {ASKED} AND (q.lease_holder IS NULL OR q.lease_expires <= ? OR q.lease_holder = ?)"
        params: list = [now(), holder]
        if held >= MAX_LEASES_PER_ANNOTATOR:  # only a pair this annotator holds already
            sql += " AND q.lease_holder = ? AND q.lease_expires > ?"
            params += [holder, now()]
        if run_id is not None:
            sql += " AND q.run_id = ?"
            params.append(run_id)
        if exclude:
            sql += f" AND q.id NOT IN ({','.join('?' * len(exclude))})"
            params.extend(exclude)
        # the newest session's pairs first: a person who comes back after a while finds what the trainer asks now (a
        # trainer with --feedback-async moves on to newer pairs; answers to the older ones still count)
        q = con.execute(sql + " ORDER BY q.session DESC, q.id LIMIT 1", params).fetchone()
        if q is None and held >= MAX_LEASES_PER_ANNOTATOR:
            raise ApiError(
                429,
                f"You hold {held} pairs already, the most one person may hold at once; answer one of them "
                f"or let its lease end ({cfg('lease_seconds'):g} s), then ask again.",
            )
        if q is None:  # with what the trainers last reported, so the page can say what happens meanwhile
            training = progress_reports(con, run_id)
            return jsonify(waiting=True, training=training) if training else jsonify(waiting=True)
        lease(con, q["id"], annotator, holder)
        q = con.execute("SELECT * FROM queries WHERE id = ?", (q["id"],)).fetchone()
        payload = query_payload(con, q)
    return jsonify(payload)


def check_may_answer(q: sqlite3.Row, holder: str) -> None:
    """A pair is answered by whom it was leased to (GET /api/next): a browser only answers its own pairs (its lease may
    have ended, as long as nobody else has the pair since: an answer kept in the browser through an outage still counts);
    the token's scripts also answer a pair nobody holds. The check's clips are never leased: anyone reorders them."""
    if q["check_step"] is not None:
        return
    mine = q["lease_holder"] == holder
    if mine or (principal().session is None and (q["lease_holder"] is None or q["lease_expires"] <= now())):
        return
    if q["lease_holder"] is not None and q["lease_expires"] > now():
        # shown to someone else right now: they would answer it too, and one of the two answers be lost
        raise ApiError(
            409,
            f"Query {q['id']} is shown to another annotator for {q['lease_expires'] - now():.0f} s more; label the pair GET /api/next gives you.",
        )
    raise ApiError(409, f"Query {q['id']} is not leased to you; label the pairs GET /api/next gives you.")


def answer_of(con: sqlite3.Connection, q: sqlite3.Row, body: dict) -> tuple[str, str | None, str | None]:
    """The one check of an answer against its query: a pair takes a choice; a ranking takes {"ranking": [each clip's
    position once, best first]} (rankings.order_problem), clips to rate {"ratings": [one per clip, 1 .. the scale]}
    (ratings.ratings_problem), either or the choice skip. Returns the choice to store, a ranking's order and ratings as
    JSON (None where the answer has none); a 400 naming what is wrong otherwise, and nothing of a mixed answer."""
    names, scale = ranked_clips(con, q["id"])[0], q["rating_scale"]
    choice, order, ratings = body.get("choice"), body.get("ranking"), body.get("ratings")
    if names is None:
        if order is not None or ratings is not None:
            raise ApiError(
                400, f"Query {q['id']} is a pair: answer it with a choice, not a {'ranking' if order is not None else 'rating'}."
            )
        allowed = cfg("choices")
        if choice not in allowed:
            raise ApiError(400, f"choice {str(choice)[:40]!r} is not allowed; use one of {', '.join(allowed)}.")
        return choice, None, None
    asks, wrong = ("ratings", order) if scale else ("a ranking", ratings)
    if wrong is not None:
        given = "a ranking" if scale else "ratings"
        raise ApiError(400, f"Query {q['id']} asks for {asks} of its {len(names)} clips, not {given}.")
    skips = "skip" in cfg("choices")
    if choice is not None:
        if order is not None or ratings is not None or choice != "skip" or not skips:
            also = " or the choice skip" if skips else ""
            raise ApiError(400, f"Query {q['id']} asks for {asks} of its {len(names)} clips{also}, not the choice {str(choice)[:40]!r}.")
        return choice, None, None
    if scale:
        problem = ratings_problem(ratings, len(names), scale)
        if problem is not None:
            raise ApiError(400, f"ratings {str(ratings)[:60]} are not allowed for query {q['id']}: {problem}.")
        return RATED, None, json.dumps(ratings)
    problem = order_problem(order, len(names))
    if problem is not None:
        raise ApiError(400, f"ranking {str(order)[:60]} is not allowed for query {q['id']}: {problem}.")
    return RANKED, json.dumps(order), None


@api.post(protocol.QUERY_LABEL)
def label_query(query_id: int):
    asked = require_query(db(), query_id)
    body = json_body(("choice", "ranking", "ratings", "annotator"))
    annotator = annotator_arg(body.get("annotator"))
    holder = principal().holder(annotator)
    choice, ranking, ratings = answer_of(db(), asked, body)
    with write_transaction() as con:
        q = require_query(con, query_id)
        old = con.execute("SELECT * FROM labels WHERE query_id = ?", (query_id,)).fetchone()
        if old is None:
            check_may_answer(q, holder)
            stamp = utc_now()
            cur = con.execute(
                "INSERT INTO labels (query_id, choice, annotator, created_at, updated_at, seq, holder, ranking, ratings) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (query_id, choice, annotator, stamp, stamp, next_seq(con), holder, ranking, ratings),
            )
            con.execute("UPDATE queries SET lease_annotator = NULL, lease_expires = NULL, lease_holder = NULL WHERE id = ?", (query_id,))
            label_id, status, updated = cur.lastrowid, 201, False
        elif old["holder"] != holder:
            raise ApiError(409, f"Query {query_id} is already labelled by another annotator; ask for a new pair with GET /api/next.")
        elif (old["choice"], old["ranking"], old["ratings"]) == (choice, ranking, ratings):
            label_id, status, updated = old["id"], 200, False
        elif not cfg("allow_editing"):
            raise ApiError(
                409,
                f"Query {query_id} is already labelled {old['choice']!r} and editing is disabled on this server; labels cannot be changed.",
            )
        else:
            con.execute(
                "UPDATE labels SET choice = ?, ranking = ?, ratings = ?, annotator = ?, updated_at = ?, seq = ? WHERE id = ?",
                (choice, ranking, ratings, annotator, utc_now(), next_seq(con), old["id"]),
            )
            label_id, status, updated = old["id"], 200, True
        progress, learned = progress_for(con, q["run_id"], q["session"]), learning(con, q["run_id"])
    order, rated = (None if text is None else json.loads(text) for text in (ranking, ratings))
    reply = dict(label_id=label_id, query_id=query_id, choice=choice, ranking=order, ratings=rated, updated=updated)
    reply |= dict(progress=progress, learned=learned)
    return jsonify(reply), status


@api.post(protocol.QUERY_UNDO)
def undo_label(query_id: int):
    """The query is pending again and leased to whoever undid it, within their cap: the pairs named in `release` (the
    page's next pair, which the undone one takes the place of) are given up first; one who would hold more than the cap
    gets 429 and nothing changes."""
    if not cfg("allow_editing"):
        raise ApiError(403, "Undo is disabled on this server (--no-editing); labels cannot be changed.")
    checking = require_query(db(), query_id)["check_step"] is not None  # the check's clips: never leased
    body = json_body(("annotator", "release"))
    annotator = annotator_arg(body.get("annotator"))
    holder = principal().holder(annotator)
    release = body.get("release") or []
    ids = isinstance(release, list) and all(isinstance(r, int) and not isinstance(r, bool) and 1 <= r <= MAX_ID for r in release)
    if not (ids and len(release) <= MAX_LEASES_PER_ANNOTATOR):
        raise ApiError(400, f"Field 'release' must be a list of at most {MAX_LEASES_PER_ANNOTATOR} query ids you hold.")
    with write_transaction() as con:
        old = con.execute("SELECT * FROM labels WHERE query_id = ?", (query_id,)).fetchone()
        if old is None:
            raise ApiError(409, f"Query {query_id} has no label to undo; only labelled queries can be undone.")
        if old["holder"] != holder:
            raise ApiError(409, f"Query {query_id} was labelled by another annotator; only your own labels can be undone.")
        for released in release:
            con.execute(
                f"UPDATE queries SET lease_annotator = NULL, lease_expires = NULL, lease_holder = NULL "
                f"WHERE id = ? AND lease_holder = ? AND id IN (SELECT q.id FROM queries q WHERE {UNLABELLED})",
                (released, holder),
            )
        held = 0 if checking else pairs_held(con, holder, besides=query_id)
        if held >= MAX_LEASES_PER_ANNOTATOR:
            raise ApiError(
                429,
                f"You hold {held} pairs already, the most one person may hold at once; answer one of them, then undo "
                f"(or name the pair the undone one replaces in 'release').",
            )
        con.execute(
            "INSERT INTO label_tombstones (seq, label_id, query_id, choice, annotator, created_at, deleted_at, ranking, ratings) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                next_seq(con),
                old["id"],
                query_id,
                old["choice"],
                old["annotator"],
                old["created_at"],
                utc_now(),
                old["ranking"],
                old["ratings"],
            ),
        )
        con.execute("DELETE FROM labels WHERE id = ?", (old["id"],))
        if not checking:
            lease(con, query_id, annotator, holder)
        q = con.execute("SELECT * FROM queries WHERE id = ?", (query_id,)).fetchone()
        payload, learned = query_payload(con, q), learning(con, q["run_id"])
    undone_ranking, undone_ratings = (None if old[name] is None else json.loads(old[name]) for name in ("ranking", "ratings"))
    return jsonify(
        undone_label_id=old["id"], undone_choice=old["choice"], undone_ranking=undone_ranking, undone_ratings=undone_ratings,
        query=payload, learned=learned,
    )  # fmt: skip


@api.get(protocol.RUN_ANSWERS)
def answers(run_id: int):
    after = int_arg("after", default=0, minimum=0)
    limit = int_arg("limit", default=MAX_ANSWERS_LIMIT, minimum=1, maximum=MAX_ANSWERS_LIMIT)
    con = db()
    require_run(con, run_id)
    trainer_seen(run_id)
    rows = con.execute(
        """
        SELECT * FROM (
            SELECT l.seq, l.id AS label_id, l.query_id, l.choice, l.ranking, l.ratings, l.annotator, l.created_at, l.updated_at,
                   q.left_segment_id, q.right_segment_id, q.session, q.left_clip, q.right_clip
            FROM labels l JOIN queries q ON q.id = l.query_id
            WHERE q.run_id = :run AND l.seq > :after
            UNION ALL
            SELECT t.seq, t.label_id, t.query_id, 'undone', NULL, NULL, t.annotator, t.created_at, t.deleted_at,
                   q.left_segment_id, q.right_segment_id, q.session, q.left_clip, q.right_clip
            FROM label_tombstones t JOIN queries q ON q.id = t.query_id
            WHERE q.run_id = :run AND t.seq > :after
        ) ORDER BY seq LIMIT :limit
        """,
        {"run": run_id, "after": after, "limit": limit},
    ).fetchall()
    items = [dict(r) | {name: None if r[name] is None else json.loads(r[name]) for name in ("ranking", "ratings")} for r in rows]
    cursor = items[-1]["seq"] if items else after
    return jsonify(answers=items, cursor=cursor)


# --------------------------------------------------------------------------------------------
# API blueprint: evaluations (the reward-model check view)
# --------------------------------------------------------------------------------------------


@api.post(protocol.RUN_EVALUATIONS)
def upload_evaluations(run_id: int):
    return jsonify(evaluation_ids=store_batch(run_id, "evaluations", check_evaluation_entry, find_evaluation, insert_evaluation)), 201


@api.get(protocol.RUN_EVALUATIONS)
def list_evaluations(run_id: int):
    """The reward model's check clips, highest predicted return first; with ?latest=1 only the newest clip of the agent
    (highest step, then last uploaded; a check clip where the run uploads none of the agent): what it does now. And
    `reorder`: the newest check's clips as a query a person may reorder (the run uploads it where it learns from that),
    or None."""
    latest = int_arg("latest", default=0, minimum=0, maximum=1)
    con = db()
    require_run(con, run_id)
    if latest:
        sql = "SELECT * FROM evaluations WHERE run_id = ? ORDER BY kind = 'agent' DESC, step DESC, id DESC LIMIT 1"
    else:
        sql = "SELECT * FROM evaluations WHERE run_id = ? AND kind = 'check' ORDER BY predicted_return DESC, id"
    rows = con.execute(sql, (run_id,)).fetchall()
    check = con.execute(
        "SELECT * FROM queries WHERE run_id = ? AND check_step IS NOT NULL ORDER BY check_step DESC, id DESC LIMIT 1", (run_id,)
    )
    check = check.fetchone()
    return jsonify(
        run_id=run_id,
        reorder=None if check is None else query_payload(con, check),
        evaluations=[
            {
                "evaluation_id": r["id"],
                "clip": r["clip"],
                "url": clip_url(run_id, r["clip"]),
                "predicted_return": r["predicted_return"],
                "step": r["step"],
                "kind": r["kind"],
                "created_at": r["created_at"],
            }
            for r in rows
        ],
    )


# --------------------------------------------------------------------------------------------
# Application: error handlers, hooks, create_app
# --------------------------------------------------------------------------------------------


def on_api_error(e: ApiError):
    return jsonify(error=e.message), e.status


def on_database_error(e: sqlite3.OperationalError):
    """Contention is never a 500: a request that waited DB_TIMEOUT_SECONDS for the write lock is told to retry."""
    if "locked" not in str(e) and "busy" not in str(e):
        raise e
    resp = jsonify(error=f"The database is busy with other writes (waited {DB_TIMEOUT_SECONDS} s); retry in a moment.")
    resp.headers["Retry-After"] = "1"
    return resp, 503


def on_too_large(_e: RequestEntityTooLarge):
    limit = cfg("max_upload_bytes")
    return jsonify(
        error=f"The upload is larger than the limit of {limit} bytes ({limit / 1048576:.1f} MiB); send smaller batches or raise --max-upload-mb."
    ), 413


def on_http_error(e: HTTPException):
    if e.code == 404:
        message = f"No such resource: {request.path}; see the API list at the top of feedback_server.py."
    elif e.code == 405:
        allowed = ", ".join(sorted(getattr(e, "valid_methods", None) or []))
        message = f"Method {request.method} is not allowed for {request.path}; allowed: {allowed}."
    else:
        message = f"{e.name}: {e.description}"
    return jsonify(error=message), e.code


def check_access():
    """access.Access's verdict on the request (serving.py may have reached it before the body, and dropped the body):
    a browser that is not logged in gets the login page for the labelling page, everything else a JSON error. Whom the
    request speaks for is kept for the routes (principal())."""
    refusal, g.principal = cfg("access").judge(
        request.method, request.path, request.headers.get, request.environ.get("SERVER_PORT"), request.content_length
    )
    refusal = request.environ.get(access.REFUSAL_KEY) or refusal
    if refusal is None:
        return None
    if refusal.status == 401 and request.endpoint == "page.annotation_page":
        return access.login_page_response("", 401)
    return jsonify(error=refusal.message), refusal.status


def check_ids():
    """Ids in the path are SQLite integers: a larger one is a 400 naming it, never an OverflowError."""
    for key, value in (request.view_args or {}).items():
        if isinstance(value, int) and value > MAX_ID:
            raise ApiError(400, f"{key} {value} is not allowed; ids are integers from 1 to {MAX_ID}.")


def origin_host(origin: str) -> str | None:
    """The host[:port] an Origin header names; None for one that is not a URL (a browser's "null", garbage)."""
    try:
        return urlsplit(origin).netloc
    except ValueError:
        return None


def check_write_request():
    """Writes come from this server's own page or from a non-browser client (the trainer, curl), never from another site.

    A browser names the page that makes a request in ``Sec-Fetch-Site`` and ``Origin``: a write is refused
    (403) unless they are absent or say the page came from this server, so a page elsewhere, even on another
    port of this host, cannot label or undo through a visitor's browser, nor lease pairs (GET /api/next is
    checked too: an <img> pointing at it would hold pairs away from annotators).  Writes must also declare
    their body (415 otherwise): ``application/json``, or ``multipart/form-data`` for the two uploads; a plain
    HTML form or a ``no-cors`` fetch can send neither.
    """
    writes = request.method in ("POST", "PUT", "PATCH", "DELETE")
    if request.endpoint is None or not (writes or request.endpoint == "api.next_query"):  # GET /api/next leases a pair
        return
    site = request.headers.get("Sec-Fetch-Site")
    if site is not None and site not in ("same-origin", "none"):
        raise ApiError(403, f"Cross-origin write refused (Sec-Fetch-Site: {site}); label from the page this server serves.")
    origin = request.headers.get("Origin")
    if origin is not None and origin_host(origin) != request.host:
        raise ApiError(
            403, f"Cross-origin write refused (Origin {origin!r} is not {request.host!r}); label from the page this server serves."
        )
    expected = "multipart/form-data" if request.endpoint in UPLOAD_ENDPOINTS else "application/json"
    if request.endpoint in access.OPEN_ENDPOINTS:
        expected = "application/x-www-form-urlencoded"  # the login page's form
    if writes and request.mimetype != expected:
        raise ApiError(415, f"Content type {request.content_type!r} is not allowed here; send {expected}.")


def security_headers(resp: Response) -> Response:
    resp.headers["X-Content-Type-Options"] = "nosniff"
    resp.headers.setdefault("Referrer-Policy", "no-referrer")
    return resp


def close_db(_exc):
    con = g.pop("db", None)
    if con is not None:
        con.close()


def create_app(
    data_dir,
    token: str | None = None,
    allow_ties: bool = True,
    allow_skip: bool = True,
    allow_editing: bool = True,
    playback_speed: float = 1.0,
    lease_seconds: float = 60,
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES,
    host_names: tuple[str, ...] = (),
    clock=time.time,
) -> Flask:
    """Builds the Flask app.  ``token`` None asks no credentials (the command line always has a token); ``host_names``:
    the names it is reached by besides loopback names and IP addresses (access.allowed_host_names); ``clock`` (seconds,
    like ``time.time``) exists so tests can expire leases."""
    if not (isinstance(playback_speed, (int, float)) and math.isfinite(playback_speed) and playback_speed > 0):
        raise ValueError(f"playback_speed must be a finite number > 0, got {playback_speed!r}")
    if not (isinstance(lease_seconds, (int, float)) and math.isfinite(lease_seconds) and lease_seconds > 0):
        raise ValueError(f"lease_seconds must be a finite number > 0, got {lease_seconds!r}")
    if not (isinstance(max_upload_bytes, int) and max_upload_bytes > 0):
        raise ValueError(f"max_upload_bytes must be an integer > 0, got {max_upload_bytes!r}")
    if token is not None and not token:
        raise ValueError("token must be a non-empty string or None")

    store = Store(Path(data_dir).resolve())
    con = store.connect()
    try:
        revoked = access.revoked_invitations(con)
    finally:
        con.close()
    app = Flask(__name__, static_folder=None)
    app.config.update(MAX_CONTENT_LENGTH=max_upload_bytes, MAX_FORM_MEMORY_SIZE=max_upload_bytes, MAX_FORM_PARTS=100_000)
    app.json.sort_keys = False
    app.extensions["feedback"] = {
        "store": store,
        "token": token,
        "access": Access(app, token, host_names, max_upload_bytes, clock, revoked),
        "choices": [c for c in CHOICES if (c != "tie" or allow_ties) and (c != "skip" or allow_skip)],
        "allow_editing": allow_editing,
        "playback_speed": float(playback_speed),
        "lease_seconds": float(lease_seconds),
        "max_upload_bytes": max_upload_bytes,
        "clock": clock,
        "trainer_seen": {},  # run id -> when its trainer last read answers or reported (show_progress)
    }
    app.register_blueprint(access.login)
    app.register_blueprint(page)
    app.register_blueprint(clips)
    app.register_blueprint(api)
    app.register_error_handler(ApiError, on_api_error)
    app.register_error_handler(RequestEntityTooLarge, on_too_large)
    app.register_error_handler(HTTPException, on_http_error)
    app.register_error_handler(sqlite3.OperationalError, on_database_error)
    app.before_request(check_access)
    app.before_request(check_ids)
    app.before_request(check_write_request)
    app.after_request(security_headers)
    app.teardown_appcontext(close_db)
    return app


# --------------------------------------------------------------------------------------------
# Command line and serving
# --------------------------------------------------------------------------------------------


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _number(kind, name: str, check, rule: str):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or (isinstance(value, float) and not math.isfinite(value)) or not check(value):
            raise argparse.ArgumentTypeError(f"{name} {text!r} is not allowed; use {rule}")
        return value

    return parse


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(prog="feedback_server.py", description="Human feedback server for CleanRLHF (pairwise clip comparisons).")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    p.add_argument(
        "--port",
        default=5001,
        type=_number(int, "port", lambda v: 1 <= v <= 65535, "an integer from 1 to 65535"),
        help="TCP port (default 5001)",
    )
    p.add_argument("--data-dir", default=None, help="SQLite database and clips (default ./feedback_data under the current directory)")
    p.add_argument(
        "--token",
        default=None,
        help=f"shared secret: API calls send it in the {TOKEN_HEADER} header, browsers log in with it or with a login link; "
        f"default: the {TOKEN_ENV} environment variable (which keeps it out of the process list), else the one kept in "
        f"<data-dir>/{access.TOKEN_FILE}, else a new one kept there",
    )
    p.add_argument(
        "--allowed-hosts",
        default=[],
        nargs="+",
        metavar="NAME",
        help="more names this server is reached by (a reverse proxy's public name); loopback names, IP addresses and "
        "--host are always allowed, other Host headers are refused",
    )
    p.add_argument(
        "--exit-with-parent", action="store_true", help="stop when the process that started this one ends (the trainer's autostart)"
    )
    p.add_argument("--no-ties", action="store_true", help="do not offer 'tie'")
    p.add_argument("--no-skip", action="store_true", help="do not offer 'skip'")
    p.add_argument("--no-editing", action="store_true", help="labels cannot be changed or undone")
    p.add_argument(
        "--playback-speed",
        default=1.0,
        type=_number(float, "playback speed", lambda v: 0 < v <= 16, "a number > 0 and <= 16"),
        help="default clip playback speed (default 1.0)",
    )
    p.add_argument(
        "--lease-seconds",
        default=60.0,
        type=_number(float, "lease seconds", lambda v: 0 < v <= 86400, "a number > 0 and <= 86400"),
        help="how long a shown pair is reserved for one annotator (default 60)",
    )
    p.add_argument(
        "--max-upload-mb",
        default=DEFAULT_MAX_UPLOAD_BYTES / 2**20,
        type=_number(float, "max upload MB", lambda v: 0 < v <= 4096, "a number > 0 and <= 4096"),
        help=f"largest upload request in MiB (default {DEFAULT_MAX_UPLOAD_BYTES / 2**20:g})",
    )
    p.add_argument(
        "--threads",
        default=8,
        type=_number(int, "threads", lambda v: 1 <= v <= 256, "an integer from 1 to 256"),
        help="requests served at once; more wait in a queue (default 8)",
    )
    args = p.parse_args(argv)
    if args.token is None:
        args.token = os.environ.get(TOKEN_ENV) or None
    if args.token is not None and not args.token.strip():
        p.error("token '' is not allowed; use a non-empty secret or leave --token out")
    if not args.host.strip():
        p.error("host '' is not allowed; use an interface address such as 127.0.0.1 or 0.0.0.0")
    for name in args.allowed_hosts:
        if access.host_name(name) != name.strip().lower().rstrip(".") or "/" in name:
            p.error(f"allowed host {name!r} is not allowed; use a host name such as feedback.example.org, without scheme or port")
    data_dir = Path(args.data_dir) if args.data_dir else Path.cwd() / "feedback_data"
    data_dir = data_dir.expanduser().resolve()
    if data_dir.exists() and not data_dir.is_dir():
        p.error(f"data dir {str(data_dir)!r} is not allowed; it exists and is not a directory")
    args.data_dir = data_dir
    return args


def access_log(app):
    """One line per request on stderr, as werkzeug's development server wrote before (waitress writes none).

    The query string is left out: it may carry ``?token=``.
    """

    def logged_app(environ, start_response):
        def logging_start_response(status, headers, exc_info=None):
            stamp = time.strftime("%d/%b/%Y %H:%M:%S")
            request_line = f"{environ.get('REQUEST_METHOD')} {environ.get('PATH_INFO')} {environ.get('SERVER_PROTOCOL')}"
            # one write per line, so that lines from concurrent worker threads never interleave; a log that cannot be
            # written (a closed terminal) costs its lines, never the request
            with contextlib.suppress(OSError):
                sys.stderr.write(f'{environ.get("REMOTE_ADDR", "-")} - - [{stamp}] "{request_line}" {status.split(" ", 1)[0]} -\n')
                sys.stderr.flush()
            return start_response(status, headers, exc_info)

        return app(environ, logging_start_response)

    return logged_app


def stop_serving(_signum, _frame):
    # waitress's main loop ends on SystemExit: it lets the worker threads finish their requests (up to
    # 5 s) and returns, so SIGTERM stops the server as Ctrl-C does instead of killing it mid-reply.
    raise SystemExit(0)


def base_url(host: str, port: int) -> str:
    """How a browser on this machine reaches a server listening on host:port."""
    if host in access.WILDCARD_ADDRESSES:
        host = socket.gethostname()
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def main(argv=None) -> int:
    args = parse_args(argv)
    max_upload_bytes = int(args.max_upload_mb * 1024 * 1024)
    token, token_file = access.server_token(args.data_dir, args.token)
    app = create_app(
        args.data_dir,
        token=token,
        allow_ties=not args.no_ties,
        allow_skip=not args.no_skip,
        allow_editing=not args.no_editing,
        playback_speed=args.playback_speed,
        lease_seconds=args.lease_seconds,
        max_upload_bytes=max_upload_bytes,
        host_names=tuple(access.allowed_host_names(args.host, args.allowed_hosts)),
    )
    try:
        server = serving.make_server(access_log(app), cfg_of(app, "access"), args.host, args.port, args.threads, max_upload_bytes)
    except (OSError, ValueError) as e:
        print(f"feedback_server.py: error: cannot listen on {args.host}:{args.port} ({e}); use another --host or --port", file=sys.stderr)
        return 1
    base = base_url(args.host, args.port)
    print(f"Feedback server on {base}/; data in {args.data_dir}", file=sys.stderr, flush=True)
    if token_file is not None:
        print(f"Its token is in {token_file} (readable by you only): give it to a trainer as {TOKEN_ENV}", file=sys.stderr, flush=True)
    if sys.stderr.isatty():  # a terminal, not a log file: the one-time login link is for the person who started it
        con = cfg_of(app, "store").connect()
        try:
            _, code = access.new_invitation(con, time.time(), "trainer", "the server's terminal")
        finally:
            con.close()
        minutes = access.LOGIN_CODE_SECONDS // 60
        print(f"Log in: {access.login_url(base, code)} (works once, within {minutes} min)", file=sys.stderr, flush=True)
    if args.exit_with_parent:
        serving.exit_with_parent()
    signal.signal(signal.SIGTERM, stop_serving)
    try:
        server.run()
    finally:
        server.close()
    print("Feedback server stopped", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
