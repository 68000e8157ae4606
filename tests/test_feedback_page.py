"""The annotation page in a real headless Chromium against a real feedback server process."""

from __future__ import annotations

import json
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.exists():
    pytest.skip("/usr/bin/chromium is missing (apt-get install -y chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is missing (pip install playwright)")
requests = pytest.importorskip("requests", reason="requests is missing (pip install requests)")
imageio_ffmpeg = pytest.importorskip("imageio_ffmpeg", reason="imageio-ffmpeg is missing (pip install imageio-ffmpeg)")
np = pytest.importorskip("numpy")

ROOT = Path(__file__).resolve().parents[1]
SERVER = ROOT / "humanFeedback" / "feedback_server.py"
TOKEN = "page-test-token"
HEADERS = {"X-Feedback-Token": TOKEN}


def write_h264(path: Path, shade: int, frames: int = 24) -> bytes:
    """A 2 s, 64x48 H.264 yuv420p mp4 with a moving bar (so playback is visible)."""
    writer = imageio_ffmpeg.write_frames(
        str(path), (64, 48), fps=12, codec="libx264", pix_fmt_out="yuv420p", macro_block_size=16, ffmpeg_log_level="error"
    )
    writer.send(None)
    for i in range(frames):
        frame = np.full((48, 64, 3), shade, dtype=np.uint8)
        frame[:, (i * 2) % 64 : (i * 2) % 64 + 6, 1] = 255
        writer.send(frame.tobytes())
    writer.close()
    return path.read_bytes()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("page")
    port = free_port()
    proc = start_server(tmp / "data", port)
    base = f"http://127.0.0.1:{port}"
    run_id = make_run(base, "page-test")
    upload_pairs(base, tmp, run_id, 1, ["q0", "q1"])
    clips = {name: (tmp / name).read_bytes() for name in ("q0a.mp4", "q1b.mp4")}
    evaluations = [{"clip": "q0a.mp4", "predicted_return": 3.5, "step": 1000}, {"clip": "q1b.mp4", "predicted_return": 12.25, "step": 2000}]
    resp = requests.post(
        f"{base}/api/runs/{run_id}/evaluations",
        data={"evaluations": json.dumps(evaluations)},
        files=[("clips", (e["clip"], clips[e["clip"]], "video/mp4")) for e in evaluations],
        headers=HEADERS,
        timeout=10,
    )
    assert resp.status_code == 201, resp.text
    try:
        yield {"base": base, "run_id": run_id}
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
        )
        try:
            yield b
        finally:
            b.close()


def log_in(page, base: str) -> str:
    """Opens a one-time login link, as a person opens the one the trainer printed; returns the link."""
    resp = requests.post(f"{base}/api/login-codes", json={}, headers=HEADERS, timeout=5)
    assert resp.status_code == 201, resp.text
    link = base + resp.json()["url"]
    page.goto(link)
    page.wait_for_url(base + "/")
    return link


def answers(server) -> list[dict]:
    resp = requests.get(f"{server['base']}/api/runs/{server['run_id']}/answers", params={"after": 0}, headers=HEADERS, timeout=5)
    return resp.json()["answers"]


def wait_for_answers(server, n: int, timeout: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        got = answers(server)
        if len(got) >= n or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def by_pair(answers: list[dict]) -> list[dict]:
    """Answers grouped by pair in the order the pairs were shown (query ids rise), each pair's in the server's order."""
    return sorted(answers, key=lambda a: int(a["query_id"]))


def shown_query(page) -> str:
    return page.get_attribute("#pairs", "data-query-id")


def assert_active_videos_play(page) -> None:
    page.wait_for_function(
        "() => { const v = [...document.querySelectorAll('.pair.active video')];"
        " return v.length === 2 && v.every(x => x.readyState >= 2 && !x.paused); }",
        timeout=10_000,
    )
    start = page.evaluate("() => [...document.querySelectorAll('.pair.active video')].map(v => v.currentTime)")
    page.wait_for_function(
        "start => [...document.querySelectorAll('.pair.active video')].every((v, i) => v.currentTime !== start[i])",
        arg=start,
        timeout=5_000,
    )
    rates = page.evaluate("() => [...document.querySelectorAll('.pair.active video')].map(v => v.playbackRate)")
    assert rates[0] == rates[1]


def test_label_by_click_and_key_then_undo_and_reward_view(server, browser):
    context = browser.new_context(viewport={"width": 1100, "height": 800})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        log_in(page, server["base"])
        page.fill("#annotator-input", "tester")
        page.click("#name-save")

        page.wait_for_function("() => document.querySelector('#pairs').dataset.queryId", timeout=10_000)
        first = shown_query(page)
        assert_active_videos_play(page)
        assert page.inner_text("#progress") == "Pair 1 of 2 in session 1 · 0 labelled in total"
        for choice, key in (("left", "←"), ("right", "→"), ("tie", "↑"), ("skip", "↓")):
            assert key in page.inner_text(f"button[data-choice={choice}]")
        page.evaluate("() => { window.__noReload = true; }")

        # the next pair is prefetched into the hidden player, so a click shows it synchronously
        page.wait_for_function(
            "() => { const p = document.querySelector('.pair:not(.active)');"
            " return p.dataset.queryId && [...p.querySelectorAll('video')].every(v => v.readyState >= 2); }",
            timeout=10_000,
        )
        second = page.evaluate(
            "() => { document.querySelector('button[data-choice=left]').click();"  # answer with a click
            " return document.querySelector('#pairs').dataset.queryId; }"
        )
        assert second and second != first
        assert_active_videos_play(page)
        page.wait_for_function("() => document.querySelector('#progress').textContent.startsWith('Pair 2 of 2')", timeout=5_000)

        page.keyboard.press("ArrowRight")  # answer with a key press
        page.wait_for_selector("#waiting", state="visible", timeout=10_000)
        assert "every 2 s" in page.inner_text("#waiting")
        assert page.evaluate("() => window.__noReload") is True  # no page reload happened

        # the page sends each answer on its own (an outbox per pair), so two quick answers can reach the server in
        # either order: compare them pair by pair, each pair's writes in the order the server stored them
        got = by_pair(wait_for_answers(server, 2))
        assert [(str(a["query_id"]), a["choice"], a["annotator"]) for a in got] == [(first, "left", "tester"), (second, "right", "tester")]

        page.click("#undo")  # the last pair comes back and its label is withdrawn
        page.wait_for_function("q => document.querySelector('#pairs').dataset.queryId === q", arg=second, timeout=10_000)
        assert page.is_hidden("#waiting")
        page.keyboard.press("ArrowDown")
        page.wait_for_selector("#waiting", state="visible", timeout=10_000)
        got = by_pair(wait_for_answers(server, 3))
        assert [(str(a["query_id"]), a["choice"]) for a in got] == [(first, "left"), (second, "undone"), (second, "skip")]

        page.reload()  # the name was typed once: it is remembered
        page.wait_for_selector("#waiting", state="visible", timeout=10_000)
        assert page.is_hidden("#name-form") and page.inner_text("#who-name") == "tester"

        page.goto(f"{server['base']}/#rewards")
        page.wait_for_function("() => document.querySelectorAll('#rewards-list .eval').length === 2", timeout=10_000)
        ranked = page.locator("#rewards-list .eval .ret").all_inner_texts()
        assert ranked == ["#1 · predicted return 12.250", "#2 · predicted return 3.500"]
        assert errors == []
    finally:
        context.close()


def test_the_browser_keeps_no_token_and_its_history_no_live_login(server, browser, tmp_path):
    """A person logs in with the printed one-time link and labels: no file of the browser's profile (history, cookies,
    cache, local storage) holds the token, no request carries it, and the login link its history keeps opens nothing."""
    profile = tmp_path / "profile"
    context = browser.browser_type.launch_persistent_context(
        str(profile),
        executable_path=str(CHROMIUM),
        headless=True,
        args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
    )
    urls: list[str] = []
    answered_clips: set[str] = set()  # the clips the server has answered: the profile's cache may now hold them
    try:
        page = context.new_page()
        page.on("request", lambda r: urls.append(r.url))
        page.on("response", lambda r: answered_clips.add(r.url.split("?")[0]) if "/clips/" in r.url else None)
        link = log_in(page, server["base"])
        page.goto(f"{server['base']}/#rewards")
        page.wait_for_function("() => document.querySelectorAll('#rewards-list video').length === 2", timeout=20_000)
        # The server's answers, not the decoder's metadata: a fresh profile's media pipeline beside a loaded CI worker
        # took from 30 s to past 120 s to report readyState 1 for clips whose responses were long in.
        deadline = time.monotonic() + 60
        while len(answered_clips) < 2 and time.monotonic() < deadline:
            page.wait_for_timeout(100)
        assert len(answered_clips) == 2, answered_clips
        assert any("/api/" in u for u in urls)
        (cookie,) = [c for c in context.cookies() if c["name"].startswith("feedback_session_")]
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and TOKEN not in cookie["value"]
        assert page.evaluate("() => document.cookie") == ""  # HttpOnly: the page's scripts never see it
    finally:
        context.close()  # the profile is written out
    assert all(TOKEN not in u for u in urls)
    for path in profile.rglob("*"):
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes(), path
    history = sqlite3.connect(profile / "Default" / "History")
    visited = [row[0] for row in history.execute("SELECT url FROM urls")]
    history.close()
    assert f"{server['base']}/" in visited and link in visited  # the history is there, login link included ...
    assert requests.get(link, timeout=5).status_code == 403  # ... and that link is dead


def test_the_check_view_shows_each_clip_once_when_it_is_routed_to_twice_at_once(server, browser):
    """The page routes on load and on every hash change: two routes to the check view while the first still awaits
    the server (a person opening #rewards right after the login) draw its clips once, not once per route."""
    context = browser.new_context()
    page = context.new_page()
    fetched: list[str] = []
    page.on("response", lambda r: fetched.append(r.url) if r.url.endswith("/evaluations") else None)
    try:
        log_in(page, server["base"])
        page.evaluate(
            "() => { history.replaceState(null, '', '#rewards');"
            " for (let i = 0; i < 2; i++) window.dispatchEvent(new HashChangeEvent('hashchange')); }"
        )
        page.wait_for_function("() => document.querySelectorAll('#rewards-list video').length >= 2", timeout=20_000)
        deadline = time.monotonic() + 20
        while len(fetched) < 2 and time.monotonic() < deadline:
            page.wait_for_timeout(100)
        page.wait_for_timeout(500)  # both renders have had their answer: the slower one has drawn, or not
        assert len(fetched) >= 2, fetched
        assert page.locator("#rewards-list video").count() == 2
        assert page.locator("#rewards-list .eval .ret").all_inner_texts()[0].startswith("#1 · predicted return 12.250")
    finally:
        context.close()


# ----------------------------------------------------------------------------- the page as a person sees it


def start_server(data_dir: Path, port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, str(SERVER), "--port", str(port), "--data-dir", str(data_dir), "--token", TOKEN],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while True:
        try:
            requests.get(f"http://127.0.0.1:{port}/api/config", headers=HEADERS, timeout=1)
            return proc
        except requests.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError("feedback server did not start") from None
            time.sleep(0.1)


def make_run(base: str, name: str, meta: dict | None = None) -> int:
    resp = requests.post(base + "/api/runs", json={"name": name, "env_id": "Hopper-v5", "meta": meta or {}}, headers=HEADERS, timeout=5)
    return resp.json()["run_id"]


def upload_pairs(base: str, tmp: Path, run_id: int, session, names: list[str]) -> list[int]:
    clips = {
        f"{n}{side}.mp4": write_h264(tmp / f"{n}{side}.mp4", 60 + 40 * k + (30 if side == "b" else 0))
        for k, n in enumerate(names)
        for side in "ab"
    }
    queries = [
        {"left_clip": f"{n}a.mp4", "right_clip": f"{n}b.mp4", "left_segment_id": k, "right_segment_id": 100 + k, "session": session}
        for k, n in enumerate(names)
    ]
    resp = requests.post(
        f"{base}/api/runs/{run_id}/queries",
        data={"queries": json.dumps(queries)},
        files=[("clips", (name, data, "video/mp4")) for name, data in clips.items()],
        headers=HEADERS,
        timeout=10,
    )
    assert resp.status_code == 201, resp.text
    return resp.json()["query_ids"]


def report(base: str, run_id: int, **fields) -> None:
    resp = requests.post(f"{base}/api/runs/{run_id}/progress", json=fields, headers=HEADERS, timeout=5)
    assert resp.status_code == 200, resp.text


def record_progress_lines(page) -> None:
    page.evaluate(
        "() => { window.__progress = []; const el = document.querySelector('#progress');"
        " new MutationObserver(() => window.__progress.push(el.textContent)).observe(el, {childList: true, characterData: true, subtree: true}); }"
    )


def test_progress_instructions_run_picker_training_news_and_sharp_clips(tmp_path, browser):
    """The page's "pair k of N in session s" from the size the trainer declared, never growing while pairs upload, never
    going back, right after the last answer. Item 13: between sessions the trainer's news. Item 15: the run's question
    above the clips and the clip's length; clips never enlarged beyond their own size. Item 16: a run picker."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_server(tmp_path / "data", port)
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        alpha = make_run(base, "alpha", {"instructions": "Which one moves forward better?", "clip_seconds": 0.4})
        beta = make_run(base, "beta")
        report(base, alpha, step=1000, phase="labelling", session=1, session_size=3)  # 3 pairs, uploaded one by one
        upload_pairs(base, tmp_path, alpha, 1, ["a0", "a1"])
        upload_pairs(base, tmp_path, beta, 7, ["b0"])

        log_in(page, base)
        page.fill("#annotator-input", "ann")
        page.click("#name-save")
        page.wait_for_function(f"() => [...document.querySelectorAll('#run-pick option')].some(o => o.value === '{beta}')", timeout=10_000)
        page.select_option("#run-pick", str(alpha))
        page.wait_for_function("() => document.querySelector('#progress').textContent.startsWith('Pair 1 of 3')", timeout=10_000)
        record_progress_lines(page)
        assert page.inner_text("#progress") == "Pair 1 of 3 in session 1 · 0 labelled in total"
        instructions = page.inner_text("#instructions")
        assert instructions.startswith("Which one moves forward better?") and "0.40 s" in instructions and "looped" in instructions
        assert_active_videos_play(page)
        sizes = page.evaluate("() => [...document.querySelectorAll('.pair.active video')].map(v => [v.clientWidth, v.videoWidth])")
        assert all(0 < shown <= own for shown, own in sizes), sizes  # 64-pixel clips are not blown up to 600 pixels

        page.keyboard.press("ArrowLeft")
        page.wait_for_function("() => document.querySelector('#progress').textContent.startsWith('Pair 2 of 3')", timeout=10_000)
        upload_pairs(base, tmp_path, alpha, 1, ["a2"])  # the last pair arrives while the person labels
        page.keyboard.press("ArrowRight")
        page.wait_for_function("() => document.querySelector('#progress').textContent.startsWith('Pair 3 of 3')", timeout=10_000)
        page.keyboard.press("ArrowUp")
        page.wait_for_selector("#waiting", state="visible", timeout=10_000)
        page.wait_for_function(
            "() => document.querySelector('#progress').textContent === 'Session 1: 3 of 3 pairs answered · 3 labelled in total'",
            timeout=10_000,
        )
        seen = [line for line in page.evaluate("() => window.__progress") if line]
        positions = [int(line.split()[1]) for line in seen if line.startswith("Pair ")]
        assert positions == sorted(positions) and all(" of 3 " in line for line in seen), seen

        # between sessions: what the trainer last reported, with the step and roughly when the next session comes
        report(base, alpha, step=5000, phase="training", total_steps=100_000, sessions_done=1, sessions_total=5,
               next_session_step=15_000, seconds_to_next_session=190, steps_per_second=52.6)  # fmt: skip
        page.wait_for_function("() => document.querySelector('#training-news').textContent.includes('step 5,000')", timeout=10_000)
        news = page.inner_text("#training-news")
        assert "alpha: training is running, step 5,000 of 100,000" in news and "in about 3 min" in news, news
        assert "Next session (2 of 5) at step 15,000" in news and "beta" not in news  # only the run picked

        page.select_option("#run-pick", "")  # all runs: beta's pair, named
        page.wait_for_function(
            "() => document.querySelector('#progress').textContent.startsWith('Pair 1 of 1 in session 7')", timeout=10_000
        )
        assert "run beta" in page.inner_text("#instructions")
        assert errors == []
    finally:
        context.close()
        proc.terminate()
        proc.wait(timeout=10)


def test_answers_given_while_the_server_is_away_are_kept_and_sent_once(tmp_path, browser):
    """An answer the server did not confirm is kept in the browser (localStorage), survives the page being
    closed, is sent when the server is back, and its pair is never asked again."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    data = tmp_path / "data"
    proc = start_server(data, port)
    context = browser.new_context(viewport={"width": 1100, "height": 800})
    try:
        run = make_run(base, "outage")
        ids = upload_pairs(base, tmp_path, run, 1, ["o0", "o1", "o2"])
        page = context.new_page()
        log_in(page, base)
        page.fill("#annotator-input", "kim")
        page.click("#name-save")
        page.wait_for_function(f"() => document.querySelector('#pairs').dataset.queryId === '{ids[0]}'", timeout=10_000)
        page.keyboard.press("ArrowLeft")
        page.wait_for_function(f"() => document.querySelector('#pairs').dataset.queryId === '{ids[1]}'", timeout=10_000)

        assert len(wait_for_answers({"base": base, "run_id": run}, 1)) == 1  # pair 1's answer is in before the outage
        page.wait_for_function("() => localStorage.getItem('cleanrlhf.feedback.outbox') === '{}'", timeout=10_000)
        proc.send_signal(signal.SIGKILL)  # the server goes away with pair 2 on screen
        proc.wait(timeout=10)
        page.keyboard.press("ArrowRight")
        page.wait_for_function("() => document.querySelector('#outbox').textContent.includes('1 answer not sent yet')", timeout=10_000)
        assert "Failed to fetch" not in page.inner_text("#notice")
        page.close()  # the person closes the tab before the server is back

        proc = start_server(data, port)
        page = context.new_page()  # same browser profile: the kept answer is sent at the next visit
        page.goto(f"{base}/")
        page.wait_for_function(f"() => document.querySelector('#pairs').dataset.queryId === '{ids[2]}'", timeout=10_000)
        got = wait_for_answers({"base": base, "run_id": run}, 2)
        assert [(a["query_id"], a["choice"], a["annotator"]) for a in got] == [(ids[0], "left", "kim"), (ids[1], "right", "kim")]
        page.keyboard.press("ArrowUp")
        page.wait_for_selector("#waiting", state="visible", timeout=10_000)
        time.sleep(0.5)
        got = wait_for_answers({"base": base, "run_id": run}, 3)
        assert [a["query_id"] for a in got] == ids  # each pair answered once, none asked twice
        assert page.evaluate("() => localStorage.getItem('cleanrlhf.feedback.outbox')") == "{}"
        assert page.inner_text("#outbox") == ""
    finally:
        context.close()
        proc.terminate()
        proc.wait(timeout=10)


def test_a_remembered_run_that_is_not_on_this_server_falls_back_to_all_runs(server, browser):
    context = browser.new_context(viewport={"width": 1100, "height": 800})
    page = context.new_page()
    try:
        log_in(page, server["base"])
        page.goto(f"{server['base']}/?run_id=999")
        page.fill("#annotator-input", "fallback")
        page.click("#name-save")
        page.wait_for_function(
            "() => document.querySelector('#notice').textContent.includes('Run 999 is not on this server')", timeout=10_000
        )
        # The fallback runs just after the notice; the picker must follow it even when no run list is reloaded after.
        page.wait_for_function(
            "() => localStorage.getItem('cleanrlhf.feedback.run') === '' && document.querySelector('#run-pick').value === ''",
            timeout=10_000,
        )
    finally:
        context.close()


# ----------------------------------------------------------------------------- getting in, undo, the run panel, tabs


def test_a_browser_that_is_not_logged_in_gets_a_page_that_says_how_to_get_in(server, browser):
    context = browser.new_context(viewport={"width": 1100, "height": 800})
    page = context.new_page()
    try:
        resp = page.goto(server["base"] + "/")
        assert resp.status == 401 and "text/html" in resp.headers["content-type"]
        assert page.inner_text("h1") == "Log in to label clips"
        text = page.inner_text("main")
        assert "login link" in text and "runs/<run>/feedback_token" in text and "works once" in text
        page.fill("#token", "not the token")
        page.click("button[type=submit]")
        assert "not this server's token" in page.inner_text("#login-message")
        page.fill("#token", TOKEN)
        page.click("button[type=submit]")
        page.wait_for_url(server["base"] + "/")
        page.wait_for_selector("#annotator-input", state="visible", timeout=10_000)  # the labelling page
        assert TOKEN not in page.url and all(TOKEN not in c["value"] for c in context.cookies())
    finally:
        context.close()


def upload_evaluation(base: str, tmp: Path, run_id: int, name: str, step: int, shade: int) -> None:
    """An evaluation clip through the real API, as the trainer's FeedbackClient.upload_evaluations sends one."""
    clip = write_h264(tmp / name, shade)
    resp = requests.post(
        f"{base}/api/runs/{run_id}/evaluations",
        data={"evaluations": json.dumps([{"clip": name, "predicted_return": 1.5, "step": step}])},
        files=[("clips", (name, clip, "video/mp4"))],
        headers=HEADERS,
        timeout=10,
    )
    assert resp.status_code == 201, resp.text


def test_undo_has_a_key_counts_right_and_shows_the_earlier_answer(tmp_path, browser):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_server(tmp_path / "data", port)
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    try:
        run = make_run(base, "undo")
        report(base, run, step=100, phase="labelling", session=1, session_size=4)
        ids = upload_pairs(base, tmp_path, run, 1, ["u0", "u1", "u2", "u3"])
        log_in(page, base)
        page.fill("#annotator-input", "uma")
        page.click("#name-save")
        for k, key in enumerate(("ArrowLeft", "ArrowDown", "ArrowRight")):  # left, skip, right
            page.wait_for_function(f"() => document.querySelector('#pairs').dataset.queryId === '{ids[k]}'", timeout=10_000)
            page.keyboard.press(key)
        page.wait_for_function(f"() => document.querySelector('#pairs').dataset.queryId === '{ids[3]}'", timeout=10_000)
        page.wait_for_function("() => localStorage.getItem('cleanrlhf.feedback.outbox') === '{}'", timeout=10_000)
        # a skip is no label: two labels and one skip, not three labels
        page.wait_for_function(
            "() => document.querySelector('#progress').textContent === 'Pair 4 of 4 in session 1 · 2 labelled in total, 1 skipped'",
            timeout=10_000,
        )
        assert "Backspace" in page.inner_text("#undo")

        page.keyboard.press("Backspace")  # undo by key: the third pair comes back, the counts go back with it
        page.wait_for_function(f"() => document.querySelector('#pairs').dataset.queryId === '{ids[2]}'", timeout=10_000)
        page.wait_for_function(
            "() => document.querySelector('#progress').textContent === 'Pair 3 of 4 in session 1 · 1 labelled in total, 1 skipped'",
            timeout=10_000,
        )
        assert "Your earlier answer was “Right is better”" in page.inner_text("#notice")
        assert page.get_attribute("button[data-choice=right]", "class").split() == ["choice", "earlier"]
        assert "your earlier answer" in page.evaluate(
            "() => getComputedStyle(document.querySelector('button[data-choice=right]'), '::after').content"
        )
        got = requests.get(f"{base}/api/runs/{run}/answers", headers=HEADERS, timeout=5).json()["answers"]
        assert [(a["query_id"], a["choice"]) for a in got][-1] == (ids[2], "undone")

        page.keyboard.press("ArrowUp")  # answered again: a tie this time
        page.wait_for_function(f"() => document.querySelector('#pairs').dataset.queryId === '{ids[3]}'", timeout=10_000)
        page.wait_for_function(
            "() => document.querySelector('#progress').textContent === 'Pair 4 of 4 in session 1 · 2 labelled in total, 1 skipped'",
            timeout=10_000,
        )
        assert page.locator("button.choice.earlier").count() == 0
    finally:
        context.close()
        proc.terminate()
        proc.wait(timeout=10)


def test_the_run_panel_says_what_the_trainer_does_and_shows_the_agents_latest_clip(tmp_path, browser):
    """While a pair is on screen the person sees whether the trainer waits for them or trains, at which step, the run's
    labels so far, the reward model's agreement with them when the trainer reports it, and the newest evaluation clip
    the trainer uploaded (through the real API), refreshed after each upload."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_server(tmp_path / "data", port)
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        run = make_run(base, "panel")
        report(base, run, step=4000, phase="labelling", total_steps=100_000, session=1, session_size=3)
        ids = upload_pairs(base, tmp_path, run, 1, ["v0", "v1", "v2"])
        log_in(page, base)
        page.fill("#annotator-input", "uma")
        page.click("#name-save")
        page.wait_for_function(f"() => document.querySelector('#pairs').dataset.queryId === '{ids[0]}'", timeout=10_000)
        page.wait_for_function("() => document.querySelector('#run-state').dataset.phase === 'waiting'", timeout=10_000)
        state = page.inner_text("#run-state")
        assert state.startswith("Waiting for you: training is paused at step 4,000 of 100,000") and "0 labels so far" in state, state
        assert page.is_hidden("#latest-eval")  # no evaluation yet

        upload_evaluation(base, tmp_path, run, "eval_1000.mp4", 1000, 90)
        page.wait_for_function("() => (document.querySelector('#latest-eval video').src || '').endsWith('/eval_1000.mp4')", timeout=10_000)
        page.wait_for_function("() => document.querySelector('#latest-eval video').readyState >= 2", timeout=10_000)
        assert page.is_visible("#latest-eval") and "step 1,000" in page.inner_text("#latest-eval figcaption")

        page.keyboard.press("ArrowLeft")
        report(base, run, step=5000, phase="training", total_steps=100_000, agreement={"uma": 0.8, "someone else": 0.1})
        page.wait_for_function("() => document.querySelector('#run-state').dataset.phase === 'training'", timeout=10_000)
        page.wait_for_function("() => document.querySelector('#run-state').textContent.includes('1 label so far')", timeout=10_000)
        state = page.inner_text("#run-state")
        assert state.startswith("Training: step 5,000 of 100,000") and "agrees with your answers on 80 % of pairs" in state, state
        assert shown_query(page) == str(ids[1])  # all this while a pair is on screen

        upload_evaluation(base, tmp_path, run, "eval_6000.mp4", 6000, 150)  # the next evaluation replaces it
        page.wait_for_function("() => (document.querySelector('#latest-eval video').src || '').endsWith('/eval_6000.mp4')", timeout=10_000)
        assert "step 6,000" in page.inner_text("#latest-eval figcaption")
        assert errors == []
    finally:
        context.close()
        proc.terminate()
        proc.wait(timeout=10)


def test_a_second_tab_says_it_labels_as_the_same_person(server, browser):
    context = browser.new_context(viewport={"width": 1100, "height": 800})
    try:
        first = context.new_page()
        log_in(first, server["base"])
        first.fill("#annotator-input", "tabby")
        first.click("#name-save")
        assert first.is_hidden("#other-tab")
        second = context.new_page()  # the same browser: the same cookie, the same name
        second.goto(server["base"] + "/")
        for page in (first, second):
            page.wait_for_selector("#other-tab", state="visible", timeout=10_000)
            text = page.inner_text("#other-tab")
            assert "open in another tab of this browser" in text and "as tabby" in text and "another browser" in text
        second.close()
        first.wait_for_selector("#other-tab", state="hidden", timeout=10_000)
    finally:
        context.close()


def test_invite_someone_makes_a_revocable_link_for_a_person_who_labels_and_nothing_else(server, browser):
    """The trainer's browser invites "guest": the link works once within 15 minutes and is listed; the guest's browser
    gets in with a name of its own and no way to invite anyone; revoked, the guest is logged out."""
    inviter = browser.new_context(viewport={"width": 1100, "height": 800})
    guest = browser.new_context(viewport={"width": 1100, "height": 800})
    try:
        page = inviter.new_page()
        log_in(page, server["base"])
        page.fill("#annotator-input", "host")
        page.click("#name-save")
        page.click("#invite")
        page.wait_for_selector("#invite-box", state="visible", timeout=10_000)
        page.fill("#invite-name", "guest")
        page.click("#invite-make")
        page.wait_for_selector("#invite-made", state="visible", timeout=10_000)
        link = page.input_value("#invite-link")
        assert link.startswith(f"{server['base']}/login?code=") and "within 15 min" in page.inner_text("#invite-box")
        row = page.locator("#invitations tbody tr", has_text="guest")
        assert row.inner_text().split("\t")[1:4] == ["guest", "annotator", "waiting"]

        other = guest.new_page()
        other.goto(link)
        other.wait_for_url(server["base"] + "/")
        other.wait_for_selector("#annotator-input", state="visible", timeout=10_000)  # in, with a name of their own to give
        other.fill("#annotator-input", "guest")
        other.click("#name-save")
        other.wait_for_selector("#who", state="visible", timeout=10_000)
        assert other.locator("#invite").is_hidden()  # an invitee invites nobody
        assert requests.get(link, timeout=5).status_code == 403  # used

        page.click("#invite")  # closed
        page.click("#invite")  # and opened again: the list is read again
        page.wait_for_function("() => document.querySelector('#invitations tbody').innerText.includes('in use')", timeout=10_000)
        row.get_by_role("button", name="Revoke").click()
        page.wait_for_function("() => document.querySelector('#invitations tbody').innerText.includes('revoked')", timeout=10_000)
        other.reload()
        assert "Log in to label clips" in other.content()  # logged out
    finally:
        inviter.close()
        guest.close()
