"""The feedback protocol: what the trainer's client (cleanrlhf_utils.feedback) and the feedback server
(humanFeedback.feedback_server) must agree on, in one place that both import.

Routes are Flask rule templates: the server registers them as written, the client fills them with ``path``. The page's
script (humanFeedback/static/js/api.js) calls the page-facing routes; tests/test_feedback_server.py holds it to these.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from pathlib import Path

# What a person may answer for a pair (the left clip shows segment 0). The server may switch tie and skip off.
CHOICES = ("left", "right", "tie", "skip")
# A query of more than two clips is ranked: its answer is {"ranking": [clip positions, best first]} (or the choice
# "skip"), stored and read back as the choice RANKED with that ranking (cleanrlhf_utils.rankings checks it).
RANKED = "ranked"
# A query sent with a rating_scale n asks for a rating of each of its clips: {"ratings": [1 .. n per clip, in the order
# shown]} (or "skip"), stored and read back as the choice RATED with those ratings (cleanrlhf_utils.ratings checks them).
RATED = "rated"

# The shared secret: the trainer and scripts send it in this header; handed to a server the trainer starts through this
# environment variable, never its command line (visible to every user in ps). A browser never holds it: the login route
# (LOGIN) turns a one-time login code, or the token typed into its form, into a session cookie named SESSION_COOKIE
# followed by "_" and the server's port (two servers on one host keep their sessions apart).
TOKEN_HEADER = "X-Feedback-Token"
TOKEN_ENV = "FEEDBACK_SERVER_TOKEN"
SESSION_COOKIE = "feedback_session"


def read_token_file(path: Path) -> str | None:
    """The token kept in `path` (a server's <data-dir>/token, a run's runs/<run>/feedback_token), or None."""
    try:
        return Path(path).read_text().strip() or None
    except FileNotFoundError:
        return None


def write_token_file(path: Path, token: str) -> None:
    """Keeps `token` in `path`, readable by its owner only (mode 0600 from the start, replaced in one step)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.part")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.replace(partial, path)


def server_proof(token: str, nonce: str) -> str:
    """What a server holding `token` answers to the challenge `nonce` (GET SERVER_PROOF?nonce=): a trainer checks it
    before it sends the token, so that a program squatting on the server's port never receives it."""
    return hmac.new(token.encode(), f"cleanrlhf-feedback-server-proof|{nonce}".encode(), hashlib.sha256).hexdigest()


NONCE_PATTERN = re.compile(r"[A-Za-z0-9_-]{16,128}")  # a challenge's nonce (its answer proves nothing for another)

# What a trainer may report it is doing (POST RUN_PROGRESS's "phase").
PHASES = ("training", "labelling", "updating", "finished", "stopped")

# Limits the server enforces (4xx beyond them), which a client keeps within.
MAX_TEXT = 200  # characters of a name, an annotator, an env id, a segment id
MAX_INSTRUCTIONS = 500  # characters of a run's instructions shown above its clips
MAX_META_BYTES = 64 * 1024  # a run's meta, as JSON
MAX_ANSWERS_LIMIT = 10_000  # answers returned by one GET RUN_ANSWERS
MAX_ID = 2**63 - 1  # run and query ids are SQLite integers

# Routes.
PAGE = "/"
PAGE_SCRIPT = "/static/js/<name>"
CLIP = "/clips/<int:run_id>/<path:name>"
LOGIN = "/login"
CONFIG = "/api/config"
LOGIN_CODES = "/api/login-codes"
INVITATIONS = "/api/invitations"
INVITATION_REVOKE = "/api/invitations/<int:invitation_id>/revoke"
SERVER_PROOF = "/api/proof"
RUNS = "/api/runs"
RUN = "/api/runs/<int:run_id>"
RUN_STATUS = "/api/runs/<int:run_id>/status"
RUN_PROGRESS = "/api/runs/<int:run_id>/progress"
RUN_QUERIES = "/api/runs/<int:run_id>/queries"
RUN_ANSWERS = "/api/runs/<int:run_id>/answers"
RUN_EVALUATIONS = "/api/runs/<int:run_id>/evaluations"
NEXT_QUERY = "/api/next"
QUERY_LABEL = "/api/queries/<int:query_id>/label"
QUERY_UNDO = "/api/queries/<int:query_id>/undo"

_VARIABLE = re.compile(r"<(?:\w+:)?(\w+)>")


def path(rule: str, **values) -> str:
    """A route with its variables filled in: ``path(RUN_ANSWERS, run_id=3) == "/api/runs/3/answers"``."""
    names = _VARIABLE.findall(rule)
    if sorted(names) != sorted(values):
        raise TypeError(f"route {rule} takes {', '.join(names) or 'no values'}; got {', '.join(values) or 'none'}")
    return _VARIABLE.sub(lambda match: str(values[match[1]]), rule)
