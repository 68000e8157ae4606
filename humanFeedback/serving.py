"""The feedback app on a port: waitress, made to hold up where anyone can connect.

- A request's headers are judged (access.Access.refusal: Host, credentials, declared body size) as soon as they are in.
  A refused request gets its JSON answer at once and its body is never read: without the token a 400 MB POST costs the
  server its headers, not 400 MB spooled to a temporary file. The connection closes after such an answer.
- Connections: up to CONNECTION_LIMIT at once (poll(), not select(), so their descriptors may pass 1024); one idle for
  IDLE_SECONDS (nothing received, no request in progress) is closed, checked every CLEANUP_SECONDS. Idle connections hold
  no worker thread, so a crowd of them does not slow anybody else's requests.
- With exit_with_parent the server stops (as on SIGTERM) once the process that started it is gone, so a trainer killed
  with SIGKILL leaves no server behind.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from waitress import create_server
from waitress.channel import HTTPChannel
from waitress.parser import HTTPRequestParser
from waitress.server import BaseWSGIServer
from waitress.task import WSGITask

from humanFeedback.access import REFUSAL_KEY, Access

CONNECTION_LIMIT = 500
IDLE_SECONDS = 30
CLEANUP_SECONDS = 5
PARENT_POLL_SECONDS = 0.5


def guarded_channel(access: Access, port: int) -> type[HTTPChannel]:
    """A waitress channel whose parser asks `access` about a request once its headers are in, before its body."""

    class Parser(HTTPRequestParser):
        refusal = None

        def parse_header(self, header_plus):
            super().parse_header(header_plus)
            if self.body_rcv is None:  # no body: nothing to spare, the app judges the request as usual
                return
            headers = self.headers
            refusal = access.refusal(
                self.command,
                self.path,
                lambda name: headers.get(name.upper().replace("-", "_")),
                port,
                None if self.chunked else self.content_length,
            )
            if refusal is not None:  # answered now, with no body; the connection closes after the answer
                self.refusal = refusal
                self.body_rcv, self.chunked, self.content_length, self.expect_continue = None, False, 0, False
                headers["CONTENT_LENGTH"] = "0"
                headers["CONNECTION"] = "close"  # what follows on the connection is the unread body, never a request

    class Task(WSGITask):
        def get_environment(self):
            environ = super().get_environment()
            if self.request.refusal is not None:
                environ[REFUSAL_KEY] = self.request.refusal
            return environ

    class Channel(HTTPChannel):
        parser_class = Parser
        task_class = Task

    return Channel


def make_server(app, access: Access, host: str, port: int, threads: int, max_body_bytes: int):
    """A waitress server for `app` on host:port (raises OSError or ValueError if it cannot listen there)."""
    server = create_server(
        app,
        host=host,
        port=port,
        threads=threads,
        max_request_body_size=max_body_bytes + 1,  # a chunked body (no Content-Length) is cut off past the upload limit
        connection_limit=CONNECTION_LIMIT,
        channel_timeout=IDLE_SECONDS,
        cleanup_interval=CLEANUP_SECONDS,
        asyncore_use_poll=True,
    )
    listeners = [server] if isinstance(server, BaseWSGIServer) else [d for d in server.map.values() if isinstance(d, BaseWSGIServer)]
    for listener in listeners:
        listener.channel_class = guarded_channel(access, listener.effective_port)
    return server


def exit_with_parent() -> None:
    """Sends this process SIGTERM once its parent is gone (it is then re-parented, so its parent pid changes)."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_SECONDS)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
