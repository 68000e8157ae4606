"""A person rates clips in the page: a real feedback server process, a real headless Chromium. A digit rates the clip
outlined (the first not yet rated), a click rates any clip, Backspace takes back the last rating given (with none
given, it undoes the last answer, as for a pair), Enter submits once every clip is rated; the server's answers (what
the trainer reads) hold the latest ratings."""

from __future__ import annotations

import json

import pytest
from test_feedback_page import HEADERS, free_port, log_in, make_run, start_server, upload_pairs, write_h264
from test_feedback_ranking_page import (
    browser,  # noqa: F401 (the module's Chromium)
    latest_answers,
    wait_for,
)

requests = pytest.importorskip("requests")
sync_api = pytest.importorskip("playwright.sync_api")


def upload_rating(base: str, tmp, run_id: int, session, clips: int, scale: int) -> int:
    names = [f"rate{k}.mp4" for k in range(clips)]
    files = [("clips", (name, write_h264(tmp / name, 40 + 50 * k), "video/mp4")) for k, name in enumerate(names)]
    query = {"clips": names, "segment_ids": [10 + k for k in range(clips)], "session": session, "rating_scale": scale}
    resp = requests.post(
        f"{base}/api/runs/{run_id}/queries", data={"queries": json.dumps([query])}, files=files, headers=HEADERS, timeout=10
    )
    assert resp.status_code == 201, resp.text
    return resp.json()["query_ids"][0]


def chosen(page) -> list[str]:
    """Each clip's rating as the page shows it ('' where none is chosen yet)."""
    return page.eval_on_selector_all(
        "#rate-clips figure", "figs => figs.map(f => (f.querySelector('button.point.chosen') || {}).textContent || '')"
    )


def test_a_person_rates_two_clips_with_keys_and_clicks_undoes_and_rates_again_then_answers_a_pair(tmp_path, browser):  # noqa: F811
    port = free_port()
    proc = start_server(tmp_path / "data", port)
    base = f"http://127.0.0.1:{port}"
    context = browser.new_context(viewport={"width": 1100, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        run_id = make_run(base, "rating-page")
        (pair,) = upload_pairs(base, tmp_path, run_id, 1, ["p"])
        rated = upload_rating(base, tmp_path, run_id, 2, 2, 5)  # the newer session's query comes first
        log_in(page, base)
        page.fill("#annotator-input", "rater")
        page.click("#name-save")
        page.wait_for_function("q => document.querySelector('#rating').dataset.queryId === q", arg=str(rated), timeout=20_000)
        assert page.is_visible("#rating") and page.is_hidden("#pairs") and page.is_hidden("#choices") and page.is_hidden("#ranking")
        page.wait_for_function(
            "() => [...document.querySelectorAll('#rate-clips video')].filter(v => v.readyState >= 2 && !v.paused).length === 2",
            timeout=20_000,
        )
        assert page.locator("#rate-clips figure").first.locator("button.point").all_inner_texts() == ["1", "2", "3", "4", "5"]
        assert page.inner_text("#progress") == "Rating 1 of 1 in session 2 · 0 labelled in total"

        page.keyboard.press("4")  # the first clip
        page.keyboard.press("7")  # off the scale: nothing
        assert chosen(page) == ["4", ""] and page.is_disabled("#rate-submit")
        page.keyboard.press("Enter")  # not every clip rated: not submitted
        page.keyboard.press("2")
        assert chosen(page) == ["4", "2"] and page.is_enabled("#rate-submit")
        page.keyboard.press("Backspace")  # takes back the last rating, not the last answer
        assert chosen(page) == ["4", ""] and latest_answers(base, run_id, "ratings") == {}
        page.click("#rate-clips figure[data-clip='1'] button.point[data-rating='5']")
        page.click("#rate-clips figure[data-clip='0'] button.point[data-rating='1']")  # a click changes a rating
        assert chosen(page) == ["1", "5"]
        page.keyboard.press("Enter")
        wait_for(page, base, run_id, {rated: ("rated", [1, 5])}, "ratings")

        # the pair comes next; Backspace there undoes the last answer, the ratings, which come back to be given again
        page.wait_for_function("q => document.querySelector('#pairs').dataset.queryId === q", arg=str(pair), timeout=20_000)
        assert page.is_visible("#choices") and page.is_hidden("#rating") and page.is_hidden("#rate-controls")
        page.keyboard.press("Backspace")
        page.wait_for_selector("#rating", state="visible", timeout=20_000)
        assert page.get_attribute("#rating", "data-query-id") == str(rated) and chosen(page) == ["", ""]
        assert "Your earlier answer was the ratings Clip 1: 1, Clip 2: 5" in page.inner_text("#notice")
        wait_for(page, base, run_id, {}, "ratings")

        page.keyboard.press("3")
        page.keyboard.press("3")
        page.click("#rate-submit")
        page.wait_for_function("q => document.querySelector('#pairs').dataset.queryId === q", arg=str(pair), timeout=20_000)
        page.keyboard.press("ArrowRight")
        wait_for(page, base, run_id, {rated: ("rated", [3, 3]), pair: ("right", None)}, "ratings")
        page.wait_for_selector("#waiting", state="visible", timeout=20_000)
        assert errors == []
    finally:
        context.close()
        proc.terminate()
        proc.wait(timeout=10)
