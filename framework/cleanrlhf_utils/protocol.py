"""The feedback protocol: what the trainer's client (cleanrlhf_utils.feedback) and the feedback server
(humanFeedback.feedback_server) must agree on, in one place that both import.

Routes are Flask rule templates: the server registers them as written, the client fills them with ``path``. The page's
script (humanFeedback/static/js/api.js) calls the page-facing routes; tests/test_feedback_server.py holds it to these.
"""

from __future__ import annotations

import re

# What a person may answer for a pair (the left clip shows segment 0). The server may switch tie and skip off.
CHOICES = ("left", "right", "tie", "skip")

# The shared secret: sent in this header (or as ?token=, or in the cookie the page route sets from ?token=); handed to
# a server the trainer starts through this environment variable, never its command line (visible to every user in ps).
TOKEN_HEADER = "X-Feedback-Token"
TOKEN_ENV = "FEEDBACK_SERVER_TOKEN"
TOKEN_COOKIE = "feedback_token"

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
CONFIG = "/api/config"
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
