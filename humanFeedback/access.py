"""Who may use the feedback server, and as whom, decided from a request's headers alone, before any of its body is read.

- Host: the name a request is addressed to must be one this server is reached by: a loopback name, an IP address, the
  --host it listens on (and this machine's name when that is a wildcard address), or one of --allowed-hosts (a reverse
  proxy's public name). A page on another site whose name the attacker points at this host (DNS rebinding) names its
  own site: refused with 403.
- Credentials and roles (trainer, annotator): the token in the X-Feedback-Token header speaks for the trainer and the scripts
  it runs. A browser holds a session cookie, made by the login route from a one-time login code (`/login?code=`) or
  from the token typed into its form. Every login code is an invitation, kept in the database: the trainer's own login
  link (role trainer) or one for someone else (role annotator); it works once, within LOGIN_CODE_SECONDS. The cookie
  names the invitation and its role and is signed with the token: it outlives a restart of the server, dies when the
  token changes, and dies with its invitation when the trainer revokes it. An annotator sees pairs and answers them:
  the routes in TRAINER_ENDPOINTS answer them 403. Only the login route and the server's proof of its token
  (SERVER_PROOF, which a trainer checks before it sends the token) are open without credentials.
- Body size: what a request declares in Content-Length must fit its route (an upload --max-upload-mb, the login form
  LOGIN_FORM_BYTES, anything else MAX_JSON_BYTES), else 413; serving.py holds a chunked body to the same limit while
  it reads it.

`Access.judge` is the one place these rules live: serving.py asks it as soon as a request's headers are in and does
not read the body of a refused request; the app asks it again for every request (tests drive the app without waitress)
and keeps the Principal it names.
"""

from __future__ import annotations

import hashlib
import hmac
import html
import ipaddress
import re
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path
from string import Template

from flask import Blueprint, Response, current_app, redirect, request
from werkzeug.exceptions import HTTPException
from werkzeug.http import parse_cookie

from cleanrlhf_utils import protocol
from cleanrlhf_utils.protocol import MAX_META_BYTES, SESSION_COOKIE, TOKEN_HEADER, read_token_file, write_token_file

MAX_JSON_BYTES = MAX_META_BYTES + 16 * 1024  # a JSON request body
LOGIN_FORM_BYTES = 4096  # the login form's body (the token)
SESSION_SECONDS = 30 * 24 * 3600  # how long a browser stays logged in
LOGIN_CODE_SECONDS = 15 * 60  # how long an unused login code (an invitation) works: a link found later in a log is dead
TOKEN_FILE = "token"  # <data-dir>/token: the token a server made itself, kept for its restarts (mode 0600)
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_ADDRESSES = ("0.0.0.0", "::", "")
UPLOAD_ENDPOINTS = ("api.upload_queries", "api.upload_evaluations")
OPEN_ENDPOINTS = ("login.login_page", "login.login_with_token", "api.server_proof")  # reachable without credentials
# What only the trainer may do: runs, uploads, progress, everyone's answers, invitations. Everything else (the page, its
# config, runs listed, pairs, labels, undo, clips, the run's news) is open to annotators too.
TRAINER_ENDPOINTS = (
    "api.create_run", "api.show_run", "api.run_status", "api.upload_queries", "api.upload_evaluations", "api.report_progress",
    "api.answers", "api.make_login_code", "api.make_invitation", "api.list_invitations", "api.revoke_invitation",
)  # fmt: skip
REFUSAL_KEY = "cleanrlhf.refusal"  # set in the WSGI environ by serving.py for a request refused before its body
LOGIN_PAGE = Template((Path(__file__).resolve().parent / "static" / "login.html").read_text())


@dataclass(frozen=True)
class Refusal:
    status: int
    message: str


def server_token(data_dir: Path, given: str | None) -> tuple[str, Path | None]:
    """The server's token: `given` (--token or FEEDBACK_SERVER_TOKEN), else the one kept in <data-dir>/token, else a new
    one kept there. Returns it with the file it is kept in (None when given)."""
    if given:
        return given, None
    path = Path(data_dir) / TOKEN_FILE
    token = read_token_file(path)
    if token is None:
        token = secrets.token_urlsafe(32)
        write_token_file(path, token)
    return token, path


def allowed_host_names(host: str, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The names a server listening on `host` answers to besides loopback names and IP addresses: `host` itself, this
    machine's name when `host` is a wildcard address (reachable from other machines), and `extra` (--allowed-hosts)."""
    names = [host, *extra]
    if host in WILDCARD_ADDRESSES:
        names.append(socket.gethostname())
    return names


def host_name(header: str | None) -> str | None:
    """The name of a Host header without its port ("[::1]:5001" -> "::1"), lower case; None if it has none."""
    value = (header or "").strip().lower()
    if value.startswith("["):
        end = value.find("]")
        name = value[1:end] if end > 0 else ""
    else:
        name = value.rsplit(":", 1)[0] if value.count(":") == 1 else value
    return name.rstrip(".") or None


def is_ip_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def session_cookie_name(port) -> str:
    return f"{SESSION_COOKIE}_{port}"


@dataclass(frozen=True)
class Principal:
    """Whom a request speaks for: its `role` ("trainer" or "annotator") and, for a browser, its `session` (the key of the leases it
    holds and the labels it gave, whatever annotator name it types); None for the token, whose scripts label under many
    names (the simulated person, tests) and hold leases per name."""

    role: str
    session: str | None = None

    def holder(self, annotator: str) -> str:
        """Who holds a lease or owns a label given under `annotator`."""
        return self.session if self.session is not None else f"token:{annotator}"


TOKEN_PRINCIPAL = Principal("trainer")  # the X-Feedback-Token header (and every request of an app made without a token)

# A session cookie: issued (seconds since the epoch), nonce, grant ("t": the token typed into the form; "t<id>" or
# "a<id>": invitation <id> with role trainer or annotator), HMAC. Every field is bounded before any number is read.
SESSION_RE = re.compile(r"(\d{1,12})\.([A-Za-z0-9_-]{16,64})\.(t|[ta][1-9]\d{0,17})\.([0-9a-f]{64})", re.ASCII)


@dataclass(frozen=True)
class Session:
    nonce: str
    grant: str

    @property
    def role(self) -> str:
        return "trainer" if self.grant.startswith("t") else "annotator"

    @property
    def invitation(self) -> int | None:
        return int(self.grant[1:]) if len(self.grant) > 1 else None

    @property
    def key(self) -> str:
        """The session in the database (leases, labels): its grant and a digest of its nonce, never the cookie itself."""
        return f"{self.grant}:{hashlib.sha256(self.nonce.encode()).hexdigest()[:20]}"


def grant_of(role: str, invitation: int | None) -> str:
    return ("t" if role == "trainer" else "a") + ("" if invitation is None else str(invitation))


def _session_mac(token: str, issued: str, nonce: str, grant: str) -> str:
    return hmac.new(token.encode(), f"session|{issued}|{nonce}|{grant}".encode(), hashlib.sha256).hexdigest()


def new_session(token: str, now: float, grant: str) -> str:
    issued, nonce = str(int(now)), secrets.token_urlsafe(16)
    return f"{issued}.{nonce}.{grant}.{_session_mac(token, issued, nonce, grant)}"


def read_session(token: str, value: str | None, now: float) -> Session | None:
    """The session a cookie value holds, or None (malformed, forged, signed with another token, expired)."""
    match = SESSION_RE.fullmatch(value or "")
    if match is None:
        return None
    issued, nonce, grant, mac = match.groups()
    age = now - int(issued)  # a few minutes below 0: the clock was set back since
    if not -300 <= age < SESSION_SECONDS or not hmac.compare_digest(mac, _session_mac(token, issued, nonce, grant)):
        return None
    return Session(nonce, grant)


class Access:
    """The rules above for one app: its token (None: no credentials asked, for tests), its extra host names, its upload
    limit, its clock, its routes (to know which rules a path falls under) and the invitations revoked (loaded at start,
    kept current by revoke_invitation)."""

    def __init__(self, app, token: str | None, host_names, max_upload_bytes: int, clock, revoked=()):
        self.app, self.token, self.max_upload_bytes, self.clock = app, token, max_upload_bytes, clock
        self.names = {name for name in (host_name(n) for n in (*LOOPBACK_NAMES, *host_names)) if name}
        self.revoked = set(revoked)

    def endpoint(self, method: str, path: str) -> str | None:
        try:
            return self.app.url_map.bind("localhost").match(path, method)[0]
        except HTTPException:
            return None

    def host_allowed(self, header: str | None) -> bool:
        name = host_name(header)
        return name is not None and (name in self.names or is_ip_address(name))

    def session(self, cookies: str | None, port) -> Session | None:
        """The browser's live session: signed with this token, not expired, its invitation not revoked."""
        if self.token is None:
            return None
        session = read_session(self.token, parse_cookie(cookies or "").get(session_cookie_name(port)), self.clock())
        return None if session is None or session.invitation in self.revoked else session

    def logged_in(self, cookies: str | None, port) -> bool:
        return self.token is None or self.session(cookies, port) is not None

    def body_limit(self, endpoint: str | None) -> int:
        if endpoint in UPLOAD_ENDPOINTS:
            return self.max_upload_bytes
        return LOGIN_FORM_BYTES if endpoint in OPEN_ENDPOINTS else MAX_JSON_BYTES

    def judge(self, method: str, path: str, header, port, content_length: int | None) -> tuple[Refusal | None, Principal | None]:
        """Why a request is refused (None: it is not), and whom it speaks for (None on the open routes), from its method,
        path, headers (`header(name) -> value or None`), the server's port and its declared body length (None: none)."""
        host = header("Host")
        if not self.host_allowed(host):
            message = (
                f"Host {host!r} is not a name this server is reached by; open it by its address, or start it with --allowed-hosts NAME."
            )
            return Refusal(403, message), None
        endpoint = self.endpoint(method, path)
        principal = TOKEN_PRINCIPAL if self.token is None else None
        if principal is None and endpoint not in OPEN_ENDPOINTS:
            given = header(TOKEN_HEADER)
            if given:
                if not hmac.compare_digest(given.encode(), self.token.encode()):
                    return Refusal(403, f"The token in the {TOKEN_HEADER} header is wrong; use the server's token."), None
                principal = TOKEN_PRINCIPAL
            elif (session := self.session(header("Cookie"), port)) is not None:
                principal = Principal(session.role, session.key)
            else:
                message = (
                    f"This server needs you to log in: open {protocol.LOGIN} (a login link, or the token), "
                    f"or send the token in the {TOKEN_HEADER} header."
                )
                return Refusal(401, message), None
        if principal is not None and principal.role != "trainer" and endpoint in TRAINER_ENDPOINTS:
            message = f"{method} {path} is the trainer's: a person logged in by an invitation sees pairs and answers them, nothing else."
            return Refusal(403, message), principal
        limit = self.body_limit(endpoint)
        if content_length is not None and content_length > limit:
            hint = "send smaller batches or raise --max-upload-mb" if endpoint in UPLOAD_ENDPOINTS else "send a smaller body"
            return Refusal(
                413,
                f"The request body is {content_length} bytes, more than the {limit} bytes ({limit / 1048576:.2f} MiB) allowed here; {hint}.",
            ), principal
        return None, principal


# --------------------------------------------------------------------------------------------
# Invitations: every login code, kept in the database (a code survives a restart of the server and is used once)
# --------------------------------------------------------------------------------------------


def _code_hash(code: str) -> str:
    return hashlib.sha256(code.encode()).hexdigest()


def new_invitation(con, now: float, role: str, name: str = "") -> tuple[int, str]:
    """An invitation with a fresh login code (stored as its hash), working once within LOGIN_CODE_SECONDS: (its id, the
    code). `con` outside a transaction."""
    code = secrets.token_urlsafe(24)
    con.execute("BEGIN IMMEDIATE")
    try:
        invitation = con.execute(
            "INSERT INTO invitations (role, name, code_hash, created_at, expires_at) VALUES (?, ?, ?, ?, ?)",
            (role, name, _code_hash(code), now, now + LOGIN_CODE_SECONDS),
        ).lastrowid
    except BaseException:
        con.execute("ROLLBACK")
        raise
    con.execute("COMMIT")
    return invitation, code


def use_login_code(con, code: str, now: float) -> str | None:
    """The grant of a live login code (its invitation's role and id), which is dead from this call on; None if it is
    not one. `con` outside a transaction."""
    con.execute("BEGIN IMMEDIATE")
    try:
        row = con.execute(
            "SELECT id, role FROM invitations WHERE code_hash = ? AND used_at IS NULL AND revoked_at IS NULL AND expires_at > ?",
            (_code_hash(code), now),
        ).fetchone()
        if row is not None:
            con.execute("UPDATE invitations SET used_at = ? WHERE id = ?", (now, row[0]))
    except BaseException:
        con.execute("ROLLBACK")
        raise
    con.execute("COMMIT")
    return None if row is None else grant_of(row[1], row[0])


def invitation_state(row, now: float) -> str:
    """revoked, in use (its code opened a browser), expired (never used in time) or waiting (its code still works)."""
    if row["revoked_at"] is not None:
        return "revoked"
    if row["used_at"] is not None:
        return "in use"
    return "expired" if row["expires_at"] <= now else "waiting"


def revoked_invitations(con) -> set[int]:
    return {row[0] for row in con.execute("SELECT id FROM invitations WHERE revoked_at IS NOT NULL")}


def login_url(base: str, code: str) -> str:
    return f"{base.rstrip('/')}{protocol.LOGIN}?code={code}"


# --------------------------------------------------------------------------------------------
# The login blueprint: a readable page that says how to get in, and the two ways in
# --------------------------------------------------------------------------------------------

login = Blueprint("login", __name__)


def login_page_response(message: str, status: int) -> Response:
    body = LOGIN_PAGE.substitute(message=html.escape(message), login=protocol.LOGIN, minutes=LOGIN_CODE_SECONDS // 60)
    resp = Response(body, status=status, mimetype="text/html")
    resp.headers["Cache-Control"] = "no-store"
    # not no-referrer: with it a browser sends its form as from origin "null", which check_write_request refuses
    resp.headers["Referrer-Policy"] = "same-origin"
    return resp


def logged_in_response(grant: str) -> Response:
    """The session cookie of `grant` (grant_of), on a page that opens the labelling page: a same-site navigation, so the
    SameSite=Strict cookie is sent with it also when the login link was opened from another site (a chat, a mail)."""
    ext = current_app.extensions["feedback"]
    body = '<!doctype html><meta charset="utf-8"><meta http-equiv="refresh" content="0; url=/"><title>Logged in</title>'
    body += '<p>Logged in. <a href="/">Open the labelling page</a>.</p>'
    resp = Response(body, mimetype="text/html")
    resp.headers["Cache-Control"] = "no-store"
    if ext["token"] is not None:
        resp.set_cookie(
            session_cookie_name(request.environ.get("SERVER_PORT")),
            new_session(ext["token"], ext["clock"](), grant),
            max_age=SESSION_SECONDS,
            httponly=True,
            samesite="Strict",
            secure=request.is_secure,
            path="/",
        )
    return resp


@login.get(protocol.LOGIN)
def login_page():
    code = request.args.get("code")
    access: Access = current_app.extensions["feedback"]["access"]
    if code is None:
        if access.logged_in(request.headers.get("Cookie"), request.environ.get("SERVER_PORT")):
            return redirect("/", code=303)
        return login_page_response("", 200)
    grant = None
    if 0 < len(code) <= 200 and code.isascii():
        con = current_app.extensions["feedback"]["store"].connect()
        try:
            grant = use_login_code(con, code, access.clock())
        finally:
            con.close()
    if grant is not None:
        return logged_in_response(grant)
    minutes = LOGIN_CODE_SECONDS // 60
    return login_page_response(
        f"This login link has been used already, has expired ({minutes} min) or was revoked: each link works once.", 403
    )


@login.post(protocol.LOGIN)
def login_with_token():
    access: Access = current_app.extensions["feedback"]["access"]
    given = request.form.get("token", "").strip()
    if access.token is None or (given and hmac.compare_digest(given.encode(), access.token.encode())):
        return logged_in_response(grant_of("trainer", None))
    return login_page_response("That is not this server's token.", 403)
