"""The feedback app on a port: waitress, made to hold up where anyone can connect.

- A request's headers are judged (access.Access.judge: Host, credentials, role, declared body size) as soon as they are
  in. A refused request gets its JSON answer at once and its body is never read: without the token a 400 MB POST costs
  the server its headers, not 400 MB spooled to a temporary file. The connection closes after such an answer. A body
  sent in chunks (no Content-Length) is held to its route's limit while it is read: it is answered 413 as soon as it, or
  a chunk it announces, would pass that limit.
- Errors waitress finds itself (a malformed request line, broken chunks, headers past their limit) are answered with a
  JSON reason and a 4xx, never a 5xx, like the app's own.
- Connections: a crowd of idle or slow sockets cannot keep anyone out. A new connection is always accepted; past
  PER_CLIENT_LIMIT connections from its address, or CONNECTION_LIMIT in all, the stalest connection not being answered
  (of that address first) is closed to make room. A request's headers must be in within HEADER_SECONDS of its first
  byte (a client trickling them is cut off), and a connection idle for IDLE_SECONDS is closed; both are checked every
  CLEANUP_SECONDS. Idle connections hold no worker thread, and descriptors are polled (poll(), not select()).
- With exit_with_parent the server stops (as on SIGTERM) within PARENT_POLL_SECONDS of the process that started it
  being gone, so a trainer killed with SIGKILL leaves no server behind. (Not Linux's PR_SET_PDEATHSIG: it fires when
  the parent's starting *thread* ends, and a trainer restarts its server from whichever thread found it gone.)
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback

from waitress import create_server
from waitress.channel import HTTPChannel
from waitress.parser import HTTPRequestParser
from waitress.server import BaseWSGIServer
from waitress.task import ErrorTask, WSGITask
from waitress.utilities import Error

from humanFeedback.access import REFUSAL_KEY, Access, Refusal

CONNECTION_LIMIT = 500  # connections at once (a file descriptor each: well under the usual limit of 1024)
PER_CLIENT_LIMIT = 100  # connections of one address at once, before its own stalest one makes room
IDLE_SECONDS = 30
HEADER_SECONDS = 10  # from a request's first byte to the end of its headers
CLEANUP_SECONDS = 1
PARENT_POLL_SECONDS = 0.1  # a getppid() each: nothing


class BodyTooLarge(Error):
    code, reason = 413, "Content Too Large"


def error_reply(error: Error) -> tuple[int, str]:
    """The status and JSON reason for an error waitress found before the app saw the request (never a 5xx: an
    unsupported Transfer-Encoding is the client's to change)."""
    if isinstance(error, BodyTooLarge):
        return 413, f"{error.body}; send a smaller body."
    if error.code == 413:
        return 413, f"The request body is too large ({error.body}); send a smaller body."
    if error.code == 431:
        return 431, f"The request's headers are too large ({error.body}); send fewer or shorter headers."
    status = 400 if error.code >= 500 else error.code
    return status, f"The request cannot be read ({error.body}); send a well-formed HTTP/1.1 request."


class JsonErrorTask(ErrorTask):
    def execute(self):
        status, message = error_reply(self.request.error)
        body = json.dumps({"error": message}).encode()
        self.status = f"{status} {self.request.error.reason if status == self.request.error.code else 'Bad Request'}"
        self.response_headers.append(("Content-Type", "application/json"))
        self.set_close_on_finish()
        self.content_length = len(body)
        self.write(body)


def guarded_channel(access: Access, port: int) -> type[HTTPChannel]:
    """A waitress channel whose parser asks `access` about a request once its headers are in, before its body."""

    class Parser(HTTPRequestParser):
        refusal = None
        body_limit = None  # the route's, for a chunked body

        def __init__(self, adj):
            super().__init__(adj)
            self.started = time.monotonic()  # the request's first byte (the channel makes a parser when data comes)

        def parse_header(self, header_plus):
            super().parse_header(header_plus)
            if self.body_rcv is None:  # no body: nothing to spare, the app judges the request as usual
                return
            headers = self.headers
            try:
                refusal, _ = access.judge(
                    self.command,
                    self.path,
                    lambda name: headers.get(name.upper().replace("-", "_")),
                    port,
                    None if self.chunked else self.content_length,
                )
                self.body_limit = access.body_limit(access.endpoint(self.command, self.path))
            except Exception:  # noqa: BLE001 (a fault in the rules must cost the request, not the connection)
                traceback.print_exc(file=sys.stderr)
                refusal = Refusal(400, "The request's headers cannot be judged; send a well-formed request.")
            if refusal is not None:  # answered now, with no body; the connection closes after the answer
                self.refusal = refusal
                self.body_rcv, self.chunked, self.content_length, self.expect_continue = None, False, 0, False
                headers["CONTENT_LENGTH"] = "0"
                headers["CONNECTION"] = "close"  # what follows on the connection is the unread body, never a request

        def received(self, data):
            consumed = super().received(data)
            receiver = self.body_rcv
            if self.chunked and receiver is not None and not self.completed and self.body_limit is not None:
                announced = len(receiver) + receiver.chunk_remainder  # what is in, and what the current chunk still brings
                if announced > self.body_limit:
                    limit = self.body_limit
                    self.error = BodyTooLarge(
                        f"The chunked body passes {limit} bytes ({limit / 1048576:.2f} MiB), the most this route takes"
                    )
                    self.completed = True
            return consumed

    class Task(WSGITask):
        def get_environment(self):
            environ = super().get_environment()
            if self.request.refusal is not None:
                environ[REFUSAL_KEY] = self.request.refusal
            return environ

    class Channel(HTTPChannel):
        parser_class = Parser
        task_class = Task
        error_task_class = JsonErrorTask

    return Channel


def evictable(channel) -> bool:
    """A connection that can be closed without cutting an answer short: no request being served or answered."""
    return not (channel.requests or channel.total_outbufs_len or channel.will_close or channel.close_when_flushed)


class GuardedListener:
    """Mixed into waitress's listening server: always accepts, and makes room (make_room); its maintenance also cuts
    off requests whose headers trickle in."""

    def readable(self):
        now = time.time()
        if now >= self.next_channel_cleanup:
            self.next_channel_cleanup = now + self.adj.cleanup_interval
            self.maintenance(now)
        return self.accepting  # never stops accepting: a newcomer makes room instead of waiting in the kernel's backlog

    def handle_accept(self):
        try:
            accepted = self.accept()
            if accepted is None:
                return
            conn, addr = accepted
            self.set_socket_options(conn)
        except OSError:  # the client left before it was accepted, or no descriptor is free now
            return
        channel = self.channel_class(self, conn, self.fix_addr(addr), self.adj, map=self._map)
        self.make_room(channel)

    def make_room(self, new) -> None:
        """Past PER_CLIENT_LIMIT connections of `new`'s address, that address's stalest connection not being answered
        is closed; past CONNECTION_LIMIT in all, the stalest of anyone's. A crowd from one address pushes out its own."""
        others = [c for c in self.active_channels.values() if c is not new and evictable(c)]
        client = new.addr[0] if isinstance(new.addr, tuple) else new.addr
        same = [c for c in others if (c.addr[0] if isinstance(c.addr, tuple) else c.addr) == client]
        if len(same) >= PER_CLIENT_LIMIT:
            min(same, key=lambda c: c.last_activity).handle_close()
        elif len(self.active_channels) > CONNECTION_LIMIT and others:
            min(others, key=lambda c: c.last_activity).handle_close()

    def maintenance(self, now):
        super().maintenance(now)  # idle for IDLE_SECONDS
        cutoff = time.monotonic() - HEADER_SECONDS
        for channel in list(self.active_channels.values()):
            request = channel.request
            if request is not None and not request.headers_finished and request.started < cutoff and evictable(channel):
                channel.will_close = True


def make_server(app, access: Access, host: str, port: int, threads: int, max_body_bytes: int):
    """A waitress server for `app` on host:port (raises OSError or ValueError if it cannot listen there)."""
    server = create_server(
        app,
        host=host,
        port=port,
        threads=threads,
        max_request_body_size=2 * max_body_bytes + 1,  # a backstop: the parser holds every body to its route's limit first
        connection_limit=CONNECTION_LIMIT + 1,  # waitress's own limit never applies: GuardedListener makes room first
        channel_timeout=IDLE_SECONDS,
        cleanup_interval=CLEANUP_SECONDS,
        asyncore_use_poll=True,
    )
    listeners = [server] if isinstance(server, BaseWSGIServer) else [d for d in server.map.values() if isinstance(d, BaseWSGIServer)]
    for listener in listeners:
        listener.__class__ = type(f"Guarded{type(listener).__name__}", (GuardedListener, type(listener)), {})
        listener.channel_class = guarded_channel(access, listener.effective_port)
    return server


def exit_with_parent() -> None:
    """Stops this process as SIGTERM does once its parent is gone (it is then re-parented, so its parent pid changes).
    The signal goes to the main thread, whose poll() it interrupts: the server stops at once, not at poll()'s timeout."""
    parent, main = os.getppid(), threading.main_thread().ident

    def watch():
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_SECONDS)
        signal.pthread_kill(main, signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
