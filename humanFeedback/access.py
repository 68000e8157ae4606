"""Who may use the feedback server, decided from a request's headers alone, before any of its body is read.

- Host: the name a request is addressed to must be one this server is reached by: a loopback name, an IP address, the
  --host it listens on (and this machine's name when that is a wildcard address), or one of --allowed-hosts (a reverse
  proxy's public name). A page on another site whose name the attacker points at this host (DNS rebinding) names its
  own site: refused with 403.
- Credentials: the token in the X-Feedback-Token header (the trainer, scripts), or a session cookie (a browser); only
  the login route is open without them. The login route turns a one-time login code (`/login?code=`, dead after its
  first use, LOGIN_CODE_SECONDS at most) or the token typed into its form into the session cookie, which holds neither:
  it is signed with the token, so it outlives a restart of the server and dies when the token changes.
- Body size: what a request declares in Content-Length must fit its route (an upload --max-upload-mb, the login form
  LOGIN_FORM_BYTES, anything else MAX_JSON_BYTES), else 413.

`Access.refusal` is the one place these rules live: serving.py asks it as soon as a request's headers are in and does
not read the body of a refused request; the app asks it again for every request (tests drive the app without waitress).
"""

from __future__ import annotations

import hashlib
import hmac
import html
import ipaddress
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
LOGIN_CODE_SECONDS = 24 * 3600  # how long an unused login code works
TOKEN_FILE = "token"  # <data-dir>/token: the token a server made itself, kept for its restarts (mode 0600)
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_ADDRESSES = ("0.0.0.0", "::", "")
UPLOAD_ENDPOINTS = ("api.upload_queries", "api.upload_evaluations")
OPEN_ENDPOINTS = ("login.login_page", "login.login_with_token")  # reachable without credentials
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


def _session_mac(token: str, issued: str, nonce: str) -> str:
    return hmac.new(token.encode(), f"session|{issued}|{nonce}".encode(), hashlib.sha256).hexdigest()


def new_session(token: str, now: float) -> str:
    issued, nonce = str(int(now)), secrets.token_urlsafe(16)
    return f"{issued}.{nonce}.{_session_mac(token, issued, nonce)}"


def session_is_valid(token: str, value: str, now: float) -> bool:
    parts = value.split(".")
    if len(parts) != 3 or not parts[0].isascii() or not parts[0].isdigit():
        return False
    issued, nonce, mac = parts
    age = now - int(issued)  # a few minutes below 0: the clock was set back since
    return -300 <= age < SESSION_SECONDS and hmac.compare_digest(mac.encode(), _session_mac(token, issued, nonce).encode())


class Access:
    """The rules above for one app: its token (None: no credentials asked, for tests), its extra host names, its upload
    limit, its clock and its routes (to know which rules a path falls under)."""

    def __init__(self, app, token: str | None, host_names, max_upload_bytes: int, clock):
        self.app, self.token, self.max_upload_bytes, self.clock = app, token, max_upload_bytes, clock
        self.names = {name for name in (host_name(n) for n in (*LOOPBACK_NAMES, *host_names)) if name}

    def endpoint(self, method: str, path: str) -> str | None:
        try:
            return self.app.url_map.bind("localhost").match(path, method)[0]
        except HTTPException:
            return None

    def host_allowed(self, header: str | None) -> bool:
        name = host_name(header)
        return name is not None and (name in self.names or is_ip_address(name))

    def logged_in(self, cookies: str | None, port) -> bool:
        value = parse_cookie(cookies or "").get(session_cookie_name(port))
        return self.token is None or (value is not None and session_is_valid(self.token, value, self.clock()))

    def body_limit(self, endpoint: str | None) -> int:
        if endpoint in UPLOAD_ENDPOINTS:
            return self.max_upload_bytes
        return LOGIN_FORM_BYTES if endpoint in OPEN_ENDPOINTS else MAX_JSON_BYTES

    def refusal(self, method: str, path: str, header, port, content_length: int | None) -> Refusal | None:
        """Why a request is refused (None: it is not), from its method, path, headers (`header(name) -> value or None`),
        the server's port and its declared body length (None when it declares none)."""
        host = header("Host")
        if not self.host_allowed(host):
            return Refusal(
                403,
                f"Host {host!r} is not a name this server is reached by; open it by its address, or start it with --allowed-hosts NAME.",
            )
        endpoint = self.endpoint(method, path)
        if self.token is not None and endpoint not in OPEN_ENDPOINTS:
            given = header(TOKEN_HEADER)
            if given:
                if not hmac.compare_digest(given.encode(), self.token.encode()):
                    return Refusal(403, f"The token in the {TOKEN_HEADER} header is wrong; use the server's token.")
            elif not self.logged_in(header("Cookie"), port):
                return Refusal(
                    401,
                    f"This server needs you to log in: open {protocol.LOGIN} (a login link, or the token), or send the token in the {TOKEN_HEADER} header.",
                )
        limit = self.body_limit(endpoint)
        if content_length is not None and content_length > limit:
            hint = "send smaller batches or raise --max-upload-mb" if endpoint in UPLOAD_ENDPOINTS else "send a smaller body"
            return Refusal(
                413,
                f"The request body is {content_length} bytes, more than the {limit} bytes ({limit / 1048576:.2f} MiB) allowed here; {hint}.",
            )
        return None


# --------------------------------------------------------------------------------------------
# Login codes: one-time, kept in the database (a code survives a restart of the server and is used once)
# --------------------------------------------------------------------------------------------


def _code_hash(code: str) -> str:
    return hashlib.sha256(code.encode()).hexdigest()


def new_login_code(con, now: float) -> str:
    """A login code, stored (as its hash) until it is used or LOGIN_CODE_SECONDS pass; `con` outside a transaction."""
    code = secrets.token_urlsafe(24)
    con.execute("BEGIN IMMEDIATE")
    try:
        con.execute("DELETE FROM login_codes WHERE expires_at <= ?", (now,))
        con.execute("INSERT INTO login_codes (code_hash, expires_at) VALUES (?, ?)", (_code_hash(code), now + LOGIN_CODE_SECONDS))
    except BaseException:
        con.execute("ROLLBACK")
        raise
    con.execute("COMMIT")
    return code


def use_login_code(con, code: str, now: float) -> bool:
    """Whether `code` is a live login code; it is dead from this call on."""
    return con.execute("DELETE FROM login_codes WHERE code_hash = ? AND expires_at > ?", (_code_hash(code), now)).rowcount == 1


def login_url(base: str, code: str) -> str:
    return f"{base.rstrip('/')}{protocol.LOGIN}?code={code}"


# --------------------------------------------------------------------------------------------
# The login blueprint: a readable page that says how to get in, and the two ways in
# --------------------------------------------------------------------------------------------

login = Blueprint("login", __name__)


def login_page_response(message: str, status: int) -> Response:
    body = LOGIN_PAGE.substitute(message=html.escape(message), login=protocol.LOGIN)
    resp = Response(body, status=status, mimetype="text/html")
    resp.headers["Cache-Control"] = "no-store"
    # not no-referrer: with it a browser sends its form as from origin "null", which check_write_request refuses
    resp.headers["Referrer-Policy"] = "same-origin"
    return resp


def logged_in_response() -> Response:
    """The session cookie, on a page that opens the labelling page: a same-site navigation, so the SameSite=Strict cookie
    is sent with it also when the login link was opened from another site (a chat, a mail)."""
    ext = current_app.extensions["feedback"]
    body = '<!doctype html><meta charset="utf-8"><meta http-equiv="refresh" content="0; url=/"><title>Logged in</title>'
    body += '<p>Logged in. <a href="/">Open the labelling page</a>.</p>'
    resp = Response(body, mimetype="text/html")
    resp.headers["Cache-Control"] = "no-store"
    if ext["token"] is not None:
        resp.set_cookie(
            session_cookie_name(request.environ.get("SERVER_PORT")),
            new_session(ext["token"], ext["clock"]()),
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
    con = current_app.extensions["feedback"]["store"].connect()
    try:
        valid = len(code) <= 200 and use_login_code(con, code, access.clock())
    finally:
        con.close()
    if valid:
        return logged_in_response()
    return login_page_response("This login link has been used already or has expired: each link works once.", 403)


@login.post(protocol.LOGIN)
def login_with_token():
    access: Access = current_app.extensions["feedback"]["access"]
    given = request.form.get("token", "").strip()
    if access.token is None or (given and hmac.compare_digest(given.encode(), access.token.encode())):
        return logged_in_response()
    return login_page_response("That is not this server's token.", 403)
