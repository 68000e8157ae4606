"""A person ranks clips in the page: a real feedback server process, a real headless Chromium. Keys 1..k place the
clips best first, Backspace takes back the last one placed (with none placed, it undoes the last answer, as for a
pair), Enter submits; a clip can be dragged within the order; the server's answers (what the trainer reads) hold the
latest order."""

from __future__ import annotations

import json

import pytest
from test_feedback_page import HEADERS, free_port, log_in, make_run, start_server, upload_pairs, write_h264

requests = pytest.importorskip("requests")
sync_api = pytest.importorskip("playwright.sync_api")


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(
            executable_path="/usr/bin/chromium", headless=True, args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
        )
        try:
            yield b
        finally:
            b.close()


def upload_ranking(base: str, tmp, run_id: int, session, clips: int) -> int:
    names = [f"rank{k}.mp4" for k in range(clips)]
    files = [("clips", (name, write_h264(tmp / name, 40 + 50 * k), "video/mp4")) for k, name in enumerate(names)]
    query = {"clips": names, "segment_ids": [10 + k for k in range(clips)], "session": session}
    resp = requests.post(
        f"{base}/api/runs/{run_id}/queries", data={"queries": json.dumps([query])}, files=files, headers=HEADERS, timeout=10
    )
    assert resp.status_code == 201, resp.text
    return resp.json()["query_ids"][0]


def latest_answers(base: str, run_id: int, field: str = "ranking") -> dict[int, tuple]:
    """What a trainer keeps reading the answers: query id -> (choice, its `field`: ranking or ratings) of the latest
    write, undone ones dropped."""
    latest = {}
    for a in requests.get(f"{base}/api/runs/{run_id}/answers", params={"after": 0}, headers=HEADERS, timeout=5).json()["answers"]:
        if a["choice"] == "undone":
            latest.pop(a["query_id"], None)
        else:
            latest[a["query_id"]] = (a["choice"], a[field])
    return latest


def wait_for(page, base: str, run_id: int, expected: dict, field: str = "ranking") -> None:
    deadline = 100
    while latest_answers(base, run_id, field) != expected and deadline:
        page.wait_for_timeout(100)
        deadline -= 1
    assert latest_answers(base, run_id, field) == expected


def order_shown(page) -> list[str]:
    return page.locator("#rank-order li").all_inner_texts()


def test_a_person_ranks_three_clips_with_keys_undoes_and_ranks_again_then_answers_a_pair(tmp_path, browser):
    port = free_port()
    proc = start_server(tmp_path / "data", port)
    base = f"http://127.0.0.1:{port}"
    context = browser.new_context(viewport={"width": 1100, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        run_id = make_run(base, "ranking-page")
        (pair,) = upload_pairs(base, tmp_path, run_id, 1, ["p"])
        ranked = upload_ranking(base, tmp_path, run_id, 2, 3)  # the newer session's query comes first
        log_in(page, base)
        page.fill("#annotator-input", "ranker")
        page.click("#name-save")
        page.wait_for_function("q => document.querySelector('#ranking').dataset.queryId === q", arg=str(ranked), timeout=20_000)
        assert page.is_visible("#ranking") and page.is_hidden("#pairs") and page.is_hidden("#choices")
        page.wait_for_function(
            "() => [...document.querySelectorAll('#rank-clips video')].filter(v => v.readyState >= 2 && !v.paused).length === 3",
            timeout=20_000,
        )
        assert page.locator("#rank-clips figcaption kbd").all_inner_texts() == ["1", "2", "3"]
        assert page.inner_text("#progress") == "Ranking 1 of 1 in session 2 · 0 labelled in total"

        page.keyboard.press("3")
        page.keyboard.press("1")
        assert order_shown(page) == ["Clip 3", "Clip 1"] and page.is_disabled("#rank-submit")
        page.keyboard.press("Backspace")  # takes back the last clip placed, not the last answer
        page.keyboard.press("Enter")  # an incomplete order is not submitted
        assert order_shown(page) == ["Clip 3"] and latest_answers(base, run_id) == {}
        page.keyboard.press("2")
        page.keyboard.press("1")
        assert page.locator("#rank-clips .place").all_inner_texts() == ["3rd", "2nd", "1st"]
        page.keyboard.press("Enter")
        wait_for(page, base, run_id, {ranked: ("ranked", [2, 1, 0])})

        # the pair comes next; Backspace there (nothing placed) undoes the last answer, the ranking, which comes back
        page.wait_for_function("q => document.querySelector('#pairs').dataset.queryId === q", arg=str(pair), timeout=20_000)
        assert page.is_visible("#choices") and page.is_hidden("#ranking") and page.is_hidden("#rank-controls")
        page.wait_for_function("() => document.querySelector('#progress').textContent.startsWith('Pair 1 of 1 in session 1')")
        page.keyboard.press("Backspace")
        page.wait_for_selector("#ranking", state="visible", timeout=20_000)
        assert page.get_attribute("#ranking", "data-query-id") == str(ranked) and page.is_hidden("#pairs")
        assert "Your earlier answer was the order Clip 3, Clip 2, Clip 1" in page.inner_text("#notice")
        wait_for(page, base, run_id, {})

        # ranked again, partly by dragging: 1, 2, 3 placed by keys, then Clip 3 dragged before Clip 1
        assert order_shown(page) == []
        for key in "123":
            page.keyboard.press(key)
        page.drag_and_drop("#rank-order li[data-clip='2']", "#rank-order li[data-clip='0']")
        assert order_shown(page) == ["Clip 3", "Clip 1", "Clip 2"]
        page.click("#rank-submit")
        page.wait_for_function("q => document.querySelector('#pairs').dataset.queryId === q", arg=str(pair), timeout=20_000)
        page.keyboard.press("ArrowLeft")  # and the pair with its own keys
        wait_for(page, base, run_id, {ranked: ("ranked", [2, 0, 1]), pair: ("left", None)})
        page.wait_for_selector("#waiting", state="visible", timeout=20_000)
        assert page.inner_text("#progress").startswith("Session 1: 1 of 1 pairs answered")
        assert errors == []
    finally:
        context.close()
        proc.terminate()
        proc.wait(timeout=10)
