"""A person reorders the reward-model check from the page's check view: a real feedback server process, a real headless
Chromium. The check view offers the newest check's clips; the button puts them on the compare view as a ranking (keys,
Enter), whose answer the server keeps as that check's order; Backspace on the next pair undoes it and brings the check
back to be ordered again; the server's answers (what the trainer reads) hold the latest order."""

from __future__ import annotations

import json

import pytest
from test_feedback_page import HEADERS, free_port, log_in, make_run, start_server, upload_pairs, write_h264
from test_feedback_ranking_page import (
    browser,  # noqa: F401 (the module's Chromium)
    wait_for,
)

requests = pytest.importorskip("requests")
sync_api = pytest.importorskip("playwright.sync_api")


def upload_check(base: str, tmp, run_id: int, step: int, clips: int) -> int:
    """The check's clips as the trainer uploads them: evaluation clips with their predicted returns, then the same files
    as a query to reorder."""
    names = [f"run{run_id}_check_{step}_{i}.mp4" for i in range(clips)]
    data = {name: write_h264(tmp / name, 40 + 60 * i) for i, name in enumerate(names)}
    entries = [{"clip": name, "predicted_return": float(i), "step": step, "kind": "check"} for i, name in enumerate(names)]
    resp = requests.post(
        f"{base}/api/runs/{run_id}/evaluations",
        data={"evaluations": json.dumps(entries)},
        files=[("clips", (name, blob, "video/mp4")) for name, blob in data.items()],
        headers=HEADERS,
        timeout=10,
    )
    assert resp.status_code == 201, resp.text
    query = {"clips": names, "segment_ids": list(range(clips)), "session": f"check-{step}", "check_step": step}
    resp = requests.post(
        f"{base}/api/runs/{run_id}/queries",
        data={"queries": json.dumps([query])},
        files=[("clips", (name, blob, "video/mp4")) for name, blob in data.items()],
        headers=HEADERS,
        timeout=10,
    )
    assert resp.status_code == 201, resp.text
    return resp.json()["query_ids"][0]


def test_a_person_reorders_the_check_from_its_view_undoes_and_orders_it_again(tmp_path, browser):  # noqa: F811
    port = free_port()
    proc = start_server(tmp_path / "data", port)
    base = f"http://127.0.0.1:{port}"
    context = browser.new_context(viewport={"width": 1100, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        run_id = make_run(base, "reorder-page")
        (pair,) = upload_pairs(base, tmp_path, run_id, 1, ["p"])
        check = upload_check(base, tmp_path, run_id, 3000, 3)
        log_in(page, base)
        page.fill("#annotator-input", "orderer")
        page.click("#name-save")
        page.wait_for_function("q => document.querySelector('#pairs').dataset.queryId === q", arg=str(pair), timeout=20_000)

        page.goto(base + "/#rewards")
        page.wait_for_selector("#reorder-check", state="visible", timeout=20_000)
        assert page.inner_text("#reorder-check") == "Put the 3 clips of step 3,000 in your order"
        page.click("#reorder-check")
        page.wait_for_function("q => document.querySelector('#ranking').dataset.queryId === q", arg=str(check), timeout=20_000)
        assert page.is_visible("#ranking") and page.is_hidden("#rewards-view")
        assert "check clips of step 3,000" in page.inner_text("#instructions")
        for key in "312":
            page.keyboard.press(key)
        page.keyboard.press("Enter")
        wait_for(page, base, run_id, {check: ("ranked", [2, 0, 1])})

        # the pair on screen before comes back; Backspace there undoes the reorder, which comes back to be ordered again
        page.wait_for_function("q => document.querySelector('#pairs').dataset.queryId === q", arg=str(pair), timeout=20_000)
        page.keyboard.press("Backspace")
        page.wait_for_selector("#ranking", state="visible", timeout=20_000)
        assert page.get_attribute("#ranking", "data-query-id") == str(check)
        wait_for(page, base, run_id, {})
        for key in "213":
            page.keyboard.press(key)
        page.keyboard.press("Enter")
        page.wait_for_function("q => document.querySelector('#pairs').dataset.queryId === q", arg=str(pair), timeout=20_000)
        page.keyboard.press("ArrowLeft")
        wait_for(page, base, run_id, {check: ("ranked", [1, 0, 2]), pair: ("left", None)})
        assert errors == []
    finally:
        context.close()
        proc.terminate()
        proc.wait(timeout=10)
