"""The feedback server against a hostile network, on a real port with its real SQLite database: a sweep of malformed,
oversized and ill-encoded requests (cookies with huge numbers, lone surrogates, broken UTF-8, chunked bodies) gets a 4xx
with a reason and never a 5xx, a dropped connection or a traceback; bodies sent in chunks are cut off at their route's
limit while they are read; crowds of idle and trickling sockets do not keep a normal request waiting; clips no row names
(a server killed mid-upload) are removed at the next start."""

from __future__ import annotations

import json
import re
import select
import socket
import threading
import time
from pathlib import Path

import pytest
from test_feedback_hardening import Server, fake_mp4

from humanFeedback.access import MAX_JSON_BYTES

requests = pytest.importorskip("requests", reason="requests is missing (pip install requests)")

MIB = 1024 * 1024


def exchange(port: int, raw: bytes, timeout: float = 10.0) -> tuple[int | None, bytes]:
    """Sends `raw` (a whole request, which asks to close the connection) and reads the answer until the server closes;
    returns its status (None: no HTTP answer, the connection was dropped) and its body."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(raw)
        except (BrokenPipeError, ConnectionResetError):  # answered before the whole body was sent: read the answer
            pass
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except ConnectionResetError:
            pass
        except TimeoutError:
            return None, b"no answer within %d s" % timeout
    match = re.match(rb"HTTP/1\.[01] (\d{3}) ", answer)
    return (int(match[1]) if match else None), answer.partition(b"\r\n\r\n")[2]


def request(port: int, method: str, path: str, headers: dict[str, str | bytes] | None = None, body: bytes = b"") -> bytes:
    """The bytes of one request with a Host, a Content-Length (unless chunked) and Connection: close."""
    lines = [f"{method} {path} HTTP/1.1".encode(), f"Host: 127.0.0.1:{port}".encode(), b"Connection: close"]
    headers = dict(headers or {})
    if body and "Transfer-Encoding" not in headers:
        headers.setdefault("Content-Length", str(len(body)))
    for name, value in headers.items():
        lines.append(name.encode() + b": " + (value if isinstance(value, bytes) else value.encode()))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def multipart(fields: dict[str, bytes], files: dict[bytes, bytes]) -> tuple[bytes, str]:
    boundary = "hostile0boundary"
    parts = [
        b'--%s\r\nContent-Disposition: form-data; name="%s"\r\n\r\n%s\r\n' % (boundary.encode(), k.encode(), v) for k, v in fields.items()
    ]
    for name, data in files.items():
        head = b'--%s\r\nContent-Disposition: form-data; name="clips"; filename="%s"\r\nContent-Type: video/mp4\r\n\r\n'
        parts.append(head % (boundary.encode(), name) + data + b"\r\n")
    parts.append(b"--%s--\r\n" % boundary.encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


LONE = "\\ud800"  # a lone surrogate, as JSON writes it: valid JSON, not text UTF-8 can carry


def hostile_requests(s: Server, run_id: int, query_id: int, cookie: str) -> list[tuple[str, bytes]]:
    """(what, raw request) pairs: cookies with oversized or odd numeric fields, lone surrogates and broken UTF-8 in every
    text a route stores, odd numbers in paths, query strings and headers, broken chunked and multipart bodies."""
    port, token = s.port, s.headers["X-Feedback-Token"]
    name = f"feedback_session_{port}"
    issued, nonce, *rest = cookie.split(".")
    cookies = {
        "400-digit issued": f"{'9' * 400}.{nonce}.{'.'.join(rest)}",
        "5000-digit issued": f"{'1' * 5000}.{nonce}.{'.'.join(rest)}",
        "negative issued": f"-1.{nonce}.{'.'.join(rest)}",
        "exponent issued": f"1e9.{nonce}.{'.'.join(rest)}",
        "arabic digits issued": "١٢٣.x.y",
        "empty fields": "...",
        "many fields": ".".join(["1"] * 200),
        "huge": "9" * 6000,
        "latin-1 bytes": "\xff\xfe.\xff.\xff",
        "the valid one, twice": f"{cookie}; {name}={cookie}",
    }
    anyone = {"Content-Type": "application/json"}
    auth = {"X-Feedback-Token": token}
    cases: list[tuple[str, bytes]] = []
    for what, value in cookies.items():
        jar = {"Cookie": f"{name}={value}".encode()}  # UTF-8 bytes where the value is not ASCII
        cases += [
            (f"GET / with cookie {what}", request(port, "GET", "/", jar)),
            (f"GET /api/config with cookie {what}", request(port, "GET", "/api/config", jar)),
            (f"GET /api/next with cookie {what}", request(port, "GET", "/api/next?annotator=a", jar)),
            (f"POST /api/runs with cookie {what}", request(port, "POST", "/api/runs", jar | anyone, b'{"name": "cookie"}')),
            (
                f"POST label with cookie {what}",
                request(port, "POST", f"/api/queries/{query_id}/label", jar | anyone, b'{"choice":"left","annotator":"a"}'),
            ),
            (f"GET a clip with cookie {what}", request(port, "GET", f"/clips/{run_id}/hostile0a.mp4", jar)),
            (f"POST undo with cookie {what}", request(port, "POST", f"/api/queries/{query_id}/undo", jar | anyone, b'{"annotator":"a"}')),
            (
                f"POST /login with cookie {what}",
                request(port, "POST", "/login", jar | {"Content-Type": "application/x-www-form-urlencoded"}, b"token=x"),
            ),
        ]
    text_bodies = {
        "/api/runs": [
            {"name": f"r{LONE}"},
            {"name": "r", "env_id": f"e{LONE}"},
            {"name": "r2", "meta": {"note": f"n{LONE}"}},
            {"name": "r3", "meta": {f"k{LONE}": 1}},
            {"name": "r4", "meta": {"instructions": LONE}},
            {"name": f"\\udfff{LONE}"},
        ],
        f"/api/queries/{query_id}/label": [{"choice": "left", "annotator": f"a{LONE}"}, {"choice": f"left{LONE}", "annotator": "a"}],
        f"/api/queries/{query_id}/undo": [{"annotator": f"a{LONE}"}],
        f"/api/runs/{run_id}/progress": [
            {"step": 1, "phase": "training", "session": f"s{LONE}", "session_size": 3},
            {"step": 1, "phase": f"training{LONE}"},
            {"step": 1, "phase": "training", "agreement": {f"a{LONE}": 0.5}},
        ],
    }
    for route, bodies in text_bodies.items():
        for body in bodies:
            raw = json.dumps(body).replace("\\\\ud", "\\ud").replace("\\\\udfff", "\\udfff").encode()
            cases.append((f"POST {route} {raw[:60]!r}", request(port, "POST", route, auth | anyone, raw)))
            browser = {"Cookie": f"{name}={cookie}"}  # and from a logged-in browser
            cases.append((f"POST {route} {raw[:60]!r} from a browser", request(port, "POST", route, browser | anyone, raw)))
    for what, raw in {
        "invalid UTF-8": b'{"name": "\xff\xfe"}',
        "surrogate as UTF-8 bytes": b'{"name": "\xed\xa0\x80"}',
        "overlong UTF-8": b'{"name": "\xc0\xaf"}',
        "NUL": b'{"name": "a\\u0000b"}',
        "deep nesting": b"[" * 100_000 + b"]" * 100_000,
        "5000-digit number": b'{"name": "n", "meta": {"x": ' + b"9" * 5000 + b"}}",
        "1e400": b'{"name": "n", "meta": {"x": 1e400}}',
        "NaN": b'{"name": "n", "meta": {"x": NaN}}',
        "not an object": b'"name"',
        "truncated": b'{"name": "',
        "BOM": b'\xef\xbb\xbf{"name": "bom"}',
    }.items():
        cases.append((f"POST /api/runs {what}", request(port, "POST", "/api/runs", auth | anyone, raw)))
    for what, raw in {
        "step 1e400": b'{"step": 1e400, "phase": "training"}',
        "step 5000 digits": b'{"step": ' + b"9" * 5000 + b', "phase": "training"}',
        "seconds NaN": b'{"step": 1, "phase": "training", "seconds_to_next_session": NaN}',
        "agreement NaN": b'{"step": 1, "phase": "training", "agreement": {"a": NaN}}',
        "session float": b'{"step": 1, "phase": "training", "session": 1.5, "session_size": 2}',
    }.items():
        cases.append((f"POST progress {what}", request(port, "POST", f"/api/runs/{run_id}/progress", auth | anyone, raw)))
    # uploads: surrogates and broken bytes in the JSON list and in file names
    entry = {"left_clip": "h0a.mp4", "right_clip": "h0b.mp4", "left_segment_id": 1, "right_segment_id": 2, "session": 1}
    clips = {b"h0a.mp4": fake_mp4("h0a"), b"h0b.mp4": fake_mp4("h0b")}
    upload_cases = {
        "session surrogate": (json.dumps([entry | {"session": "SURR"}]).replace("SURR", LONE).encode(), clips),
        "segment surrogate": (json.dumps([entry | {"left_segment_id": "SURR"}]).replace("SURR", LONE).encode(), clips),
        "clip name surrogate": (json.dumps([entry | {"left_clip": "SURR.mp4"}]).replace("SURR", LONE).encode(), clips),
        "invalid UTF-8 field": (b'[{"left_clip": "\xff"}]', clips),
        "file name invalid UTF-8": (json.dumps([entry]).encode(), {b"\xff\xfe.mp4": fake_mp4("x"), b"h0b.mp4": fake_mp4("h0b")}),
        "file name surrogate bytes": (json.dumps([entry]).encode(), {b"\xed\xa0\x80.mp4": fake_mp4("x"), b"h0b.mp4": fake_mp4("h0b")}),
        "5000-digit segment": (json.dumps([entry]).replace('"left_segment_id": 1', '"left_segment_id": ' + "9" * 5000).encode(), clips),
        "1e400 segment": (json.dumps([entry]).replace('"left_segment_id": 1', '"left_segment_id": 1e400').encode(), clips),
    }
    for what, (field, files) in upload_cases.items():
        body, content_type = multipart({"queries": field}, files)
        cases.append((f"upload {what}", request(port, "POST", f"/api/runs/{run_id}/queries", auth | {"Content-Type": content_type}, body)))
        body, content_type = multipart({"evaluations": field.replace(b"left_clip", b"clip")}, files)
        cases.append(
            (f"evaluations {what}", request(port, "POST", f"/api/runs/{run_id}/evaluations", auth | {"Content-Type": content_type}, body))
        )
    for what, content_type in {
        "no boundary": "multipart/form-data",
        "huge boundary": "multipart/form-data; boundary=" + "b" * 5000,
        "odd charset": "multipart/form-data; boundary=x; charset=utf-7",
    }.items():
        cases.append(
            (f"upload {what}", request(port, "POST", f"/api/runs/{run_id}/queries", auth | {"Content-Type": content_type}, b"--x--\r\n"))
        )
    # query strings: odd numbers and encodings
    for query in (
        "annotator=%ED%A0%80",
        "annotator=%FF%FE",
        "annotator=a%00b",
        f"annotator=a&run_id={'9' * 400}",
        f"annotator=a&run_id={'9' * 5000}",
        "annotator=a&run_id=-1",
        "annotator=a&run_id=1e3",
        "annotator=a&run_id=%D9%A1",
        "annotator=a&run_id=1_0",
        f"annotator=a&exclude={'9' * 400}",
        "annotator=a&exclude=1,,2,%ED%A0%80",
        "annotator=" + "a" * 5000,
        "annotator=a&annotator=b",
    ):
        cases.append((f"GET /api/next?{query[:60]}", request(port, "GET", f"/api/next?{query}", auth)))
    for query in (f"after={'9' * 400}", f"after={'9' * 5000}", "after=-1", "after=1e3", "after=%D9%A3", f"limit={'9' * 400}", "limit=0"):
        cases.append((f"GET answers?{query[:40]}", request(port, "GET", f"/api/runs/{run_id}/answers?{query}", auth)))
    for query in (f"latest={'9' * 400}", "latest=2", "latest=%ED%A0%80"):
        cases.append((f"GET evaluations?{query[:40]}", request(port, "GET", f"/api/runs/{run_id}/evaluations?{query}", auth)))
    for code in ("%ED%A0%80", "%FF", "a" * 5000, "9" * 400, ""):
        cases.append((f"GET /login?code={code[:20]}", request(port, "GET", f"/login?code={code}")))
    for token_form in (b"token=%ED%A0%80", b"token=%FF%FE", b"token=" + b"9" * 3000, b"token=a&token=b", b"\xff\xfe=\xff"):
        cases.append(
            (
                f"POST /login {token_form[:30]!r}",
                request(port, "POST", "/login", {"Content-Type": "application/x-www-form-urlencoded"}, token_form),
            )
        )
    # paths
    for path in (
        "/clips/1/%ED%A0%80.mp4",
        "/clips/1/%FF.mp4",
        "/clips/1/..%2f..%2fetc%2fpasswd.mp4",
        f"/clips/{'9' * 400}/a.mp4",
        "/clips/-1/a.mp4",
        f"/api/runs/{'9' * 400}",
        f"/api/runs/{'9' * 5000}/answers",
        "/api/runs/%D9%A1",
        "/api/runs/1%00",
        "/%00",
        "/" + "a" * 8000,
        f"/api/queries/{'9' * 400}/label",
        "/static/js/..%2f..%2ffeedback_server.py",
        "/static/js/%ED%A0%80.js",
        "/api/runs/1/../../etc",
    ):
        cases.append((f"GET {path[:50]}", request(port, "GET", path, auth)))
    # headers
    clip = f"/clips/{run_id}/hostile0a.mp4"
    for what, headers in {
        "Range past the end": {"Range": f"bytes={'9' * 400}-"},
        "many Ranges": {"Range": "bytes=" + ",".join(["0-0"] * 2000)},
        "Range garbage": {"Range": "bytes=\xff-\xfe"},
        "If-Modified-Since garbage": {"If-Modified-Since": "9" * 400},
        "If-Range garbage": {"If-Range": "\xff" * 50, "Range": "bytes=0-1"},
        "If-None-Match huge": {"If-None-Match": "x" * 8000},
    }.items():
        cases.append((f"GET clip {what}", request(port, "GET", clip, auth | {k: v.encode("latin-1") for k, v in headers.items()})))
    for what, headers in {
        "Host latin-1": {"Host": b"\xff\xfe"},
        "Host huge port": {"Host": f"127.0.0.1:{'9' * 400}".encode()},
        "token latin-1": {"X-Feedback-Token": b"\xff\xfe\xfd"},
        "token huge": {"X-Feedback-Token": b"t" * 8000},
        "Origin odd": {"Origin": b"http://[::1", "Content-Type": b"application/json"},
        "Origin latin-1": {"Origin": b"http://\xff", "Content-Type": b"application/json"},
        "Sec-Fetch-Site latin-1": {"Sec-Fetch-Site": b"\xff", "Content-Type": b"application/json"},
        "Content-Type latin-1": {"Content-Type": b"application/json; charset=\xff"},
        "Content-Type utf-16": {"Content-Type": b"application/json; charset=utf-16"},
    }.items():
        headers = dict(headers)
        host = headers.pop("Host", None)
        raw = request(port, "POST", "/api/runs", auth | headers, b'{"name": "hdr"}')
        if host is not None:
            raw = raw.replace(f"Host: 127.0.0.1:{port}".encode(), b"Host: " + host)
        cases.append((f"POST /api/runs {what}", raw))
    for what, length in {"negative": "-1", "exponent": "1e3", "huge": "9" * 400, "two": "5, 6", "hex": "0x10", "spaces": " 15 "}.items():
        raw = request(port, "POST", "/api/runs", auth | anyone | {"Content-Length": length}, b'{"name": "len0"}')
        cases.append((f"Content-Length {what}", raw))
    for what, chunks in {
        "400-hex-digit chunk size": b"f" * 400 + b"\r\nab\r\n0\r\n\r\n",
        "negative chunk size": b"-5\r\nabcde\r\n0\r\n\r\n",
        "chunk size garbage": b"zz\r\nab\r\n0\r\n\r\n",
        "chunk extension huge": b"2;" + b"x" * 9000 + b"\r\nab\r\n0\r\n\r\n",
        "no last chunk": b'f\r\n{"name": "chunk"\r\n',
    }.items():
        raw = request(port, "POST", "/api/runs", auth | anyone | {"Transfer-Encoding": "chunked"}, chunks)
        cases.append((f"chunked {what}", raw))
    cases.append(("Transfer-Encoding gzip", request(port, "POST", "/api/runs", auth | anyone | {"Transfer-Encoding": "gzip"}, b"x")))
    cases.append(
        (
            "both Content-Length and chunked",
            request(port, "POST", "/api/runs", auth | anyone | {"Transfer-Encoding": "chunked", "Content-Length": "4"}, b"0\r\n\r\n"),
        )
    )
    cases.append(
        (
            "header line without colon",
            request(port, "GET", "/api/config", auth).replace(b"Connection: close", b"Connection: close\r\nnocolon"),
        )
    )
    cases.append(("HTTP/9.9", request(port, "GET", "/api/config", auth).replace(b"HTTP/1.1", b"HTTP/9.9", 1)))
    cases.append(("method garbage", request(port, "\xff\xfe".encode("latin-1").decode("latin-1"), "/api/config", auth)))
    return cases


def test_a_hostile_sweep_gets_a_reason_and_never_a_5xx_a_dropped_connection_or_a_traceback(tmp_path):
    s = Server(tmp_path)
    try:
        run_id = s.run("hostile")
        (query_id,) = s.upload(run_id, "hostile", 1)
        browser = requests.Session()
        assert browser.get(s.login_link(), timeout=5).status_code == 200
        (cookie,) = browser.cookies
        cases = hostile_requests(s, run_id, query_id, cookie.value)
        assert len(cases) >= 200, len(cases)
        answers = {what: exchange(s.port, raw) for what, raw in cases}
        failed = {what: (status, body[:200]) for what, (status, body) in answers.items() if status is None or status >= 500}
        assert not failed, f"{len(failed)} of {len(cases)}: {failed}"
        # each refusal says why, as JSON where an API route refuses it; text that is not UTF-8 is never stored
        api = {what: body for what, (status, body) in answers.items() if status >= 400 and body.startswith(b"{")}
        assert all(json.loads(body).get("error") for body in api.values()), api
        encoded = {what: status for what, (status, _) in answers.items() if "ud8" in what or "surrogate" in what or "UTF-8" in what}
        assert len(encoded) >= 20 and all(400 <= status < 500 for status in encoded.values()), encoded
        assert s.get("/api/config").status_code == 200  # and the server serves on
    finally:
        log = s.stop()
    assert "Traceback" not in log and "Exception" not in log, log[-3000:]


def open_crowd(port: int, idle: int, trickling: int) -> tuple[list[socket.socket], list[socket.socket]]:
    """`idle` sockets that never send a byte and `trickling` ones that send the first byte of a request's head; their
    connections are not waited for (a server that stops accepting keeps them in its backlog, or refuses them)."""
    crowd = []
    for _ in range(idle + trickling):
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", port))
        crowd.append(sock)
    time.sleep(0.5)  # the handshakes
    for sock in crowd[idle:]:
        try:
            sock.send(b"G")
        except OSError:
            pass  # not connected (yet): the next byte goes out with the others
    return crowd[:idle], crowd[idle:]


def timed_request(s: Server) -> float:
    """Seconds a normal request takes to be answered (inf: none within 15 s)."""
    started = time.monotonic()
    try:
        assert requests.get(s.base + "/api/config", headers=s.headers, timeout=15).status_code == 200
    except requests.RequestException:
        return float("inf")
    return time.monotonic() - started


def test_idle_and_trickling_sockets_keep_nobody_waiting(tmp_path):
    """600 sockets that send nothing and 510 that send one byte of a request's head every 10 s (from this host, like a
    client's own: one address, so the per-client limit applies to the normal request too): a normal request is answered
    within 2 s right after they open, while they trickle, and right after a second such crowd arrives."""
    s = Server(tmp_path)
    head = f"ET /api/config HTTP/1.1\r\nHost: 127.0.0.1:{s.port}\r\n".encode()
    crowds, stop, seconds = [], threading.Event(), []

    def trickle():  # one more byte of the head every 10 s on each trickling socket the server keeps open
        position = 0
        while not stop.wait(10):
            for sock in [sock for _, trickling in crowds for sock in trickling]:
                try:
                    sock.send(head[position % len(head) : position % len(head) + 1])
                except OSError:
                    pass  # the server closed it
            position += 1

    trickler = threading.Thread(target=trickle, daemon=True)
    try:
        crowds.append(open_crowd(s.port, 600, 510))
        trickler.start()
        seconds.append(timed_request(s))
        for wait in (5, 7):  # at 5 s and 12 s: the trickling sockets have sent their next byte
            time.sleep(wait)
            seconds.append(timed_request(s))
        crowds.append(open_crowd(s.port, 600, 510))  # another crowd: it takes the places the first one kept
        seconds.append(timed_request(s))
        time.sleep(11)
        seconds.append(timed_request(s))
    finally:
        stop.set()
        for sock in [sock for idle, trickling in crowds for sock in idle + trickling]:
            sock.close()
        log = s.stop()
    assert max(seconds) <= 2.0, seconds
    assert "Traceback" not in log, log[-2000:]


def chunked_until_answered(port: int, path: str, headers: dict[str, str], total: int) -> tuple[int, bytes, int]:
    """Sends a chunked body of up to `total` bytes in 64 KiB chunks, looking for an answer after each; returns the
    answer's status and body and how many body bytes were sent before it came."""
    head = request(port, "POST", path, headers | {"Transfer-Encoding": "chunked"})
    chunk = b"%x\r\n" % (64 * 1024) + b" " * (64 * 1024) + b"\r\n"
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
        sock.sendall(head)
        answer = b""
        answered = select.poll()  # not select(): descriptors past 1024 are fine
        answered.register(sock, select.POLLIN)
        while sent < total:
            if answered.poll(10):
                break
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += 64 * 1024
        else:
            sock.sendall(b"0\r\n\r\n")
        try:
            while data := sock.recv(65536):
                answer += data
        except ConnectionResetError:
            pass
    status = int(answer.split(b" ", 2)[1])
    return status, answer.partition(b"\r\n\r\n")[2], sent


def test_a_chunked_body_is_cut_off_at_its_routes_limit_while_it_is_read(tmp_path):
    """With the token, a body sent in chunks (no Content-Length to judge first) is answered 413 with a JSON reason as
    soon as it passes its route's limit (80 KiB for a JSON route, --max-upload-mb for an upload) or announces a chunk
    past it: of 15 MiB, a JSON route reads no more than a few of its limits, and nothing is stored."""
    s = Server(tmp_path)  # uploads take 16 MiB: the JSON routes' 80 KiB must hold on their own
    (tmp_path / "small").mkdir()
    small = Server(tmp_path / "small", "--max-upload-mb", "1")
    try:
        run_id, small_run = s.run("chunks"), small.run("chunks")
        before = s.rows()
        auth = s.headers | {"Content-Type": "application/json"}
        for server, path, headers, limit, most in (
            (s, "/api/runs", auth, MAX_JSON_BYTES, 0.5 * MIB),
            (s, f"/api/runs/{run_id}/progress", auth, MAX_JSON_BYTES, 0.5 * MIB),
            (small, f"/api/runs/{small_run}/queries", small.headers | {"Content-Type": "multipart/form-data; boundary=x"}, MIB, 2 * MIB),
        ):
            status, body, sent = chunked_until_answered(server.port, path, headers, 15 * MIB)
            assert status == 413 and str(limit) in json.loads(body)["error"], (path, status, body)
            assert sent <= most, (path, sent)  # answered while the body came, not after 15 MiB
        # one chunk that announces 2^64 bytes: answered at once
        chunked = auth | {"Transfer-Encoding": "chunked"}
        status, body = exchange(s.port, request(s.port, "POST", "/api/runs", chunked, b"f" * 16 + b"\r\nab"))
        assert status == 413, body
        # a chunked body within the limit is read as usual
        run = json.dumps({"name": "chunked-ok"}).encode()
        status, body = exchange(s.port, request(s.port, "POST", "/api/runs", chunked, b"%x\r\n%s\r\n0\r\n\r\n" % (len(run), run)))
        assert status == 201, body
        unchanged = {k: v for k, v in s.rows().items() if k not in ("runs", "sqlite_sequence")}
        assert unchanged == {k: v for k, v in before.items() if k not in ("runs", "sqlite_sequence")}
    finally:
        log = s.stop() + small.stop()
    assert "Traceback" not in log


def test_clips_no_row_names_are_removed_at_the_next_start(tmp_path):
    """What a server killed between writing an upload's clips and committing its rows leaves (clips no query or
    evaluation names, in a run's folder or in the folder of a run never created) is removed when it starts again;
    every clip a row names, and anything outside the runs' folders, is kept."""
    s = Server(tmp_path)
    run_id = s.run("orphans")
    s.upload(run_id, "kept", 2)
    files = [("clips", ("eval0.mp4", fake_mp4("eval0"), "video/mp4"))]
    data = {"evaluations": json.dumps([{"clip": "eval0.mp4", "predicted_return": 1.0, "step": 5}])}
    assert s.post(f"/api/runs/{run_id}/evaluations", data=data, files=files).status_code == 201
    s.proc.kill()  # as if killed mid-upload
    s.proc.wait(timeout=10)
    clips = s.data_dir / "clips"
    kept = sorted(p.relative_to(clips) for p in clips.rglob("*.mp4"))
    orphans = [clips / str(run_id) / "s3_q0_left.mp4", clips / str(run_id) / "s3_q0_right.mp4", clips / "77" / "never.mp4"]
    for orphan in orphans:
        orphan.parent.mkdir(exist_ok=True)
        orphan.write_bytes(fake_mp4(orphan.name))
    (clips / "notes").mkdir()
    (clips / "notes" / "mine.mp4").write_bytes(b"not the server's")
    s = Server(tmp_path)  # the same data dir
    try:
        assert sorted(p.relative_to(clips) for p in clips.rglob("*.mp4")) == sorted([*kept, Path("notes/mine.mp4")])
        assert requests.get(f"{s.base}/clips/{run_id}/kept0a.mp4", headers=s.headers, timeout=5).status_code == 200
    finally:
        s.stop()
