"""Screenshots of the labelling page for docs/human-feedback.md, one per kind of query: a pair, a ranking of three clips,
ratings of two clips on five points, and the check view with its reorder button. A real feedback server on a free port,
Hopper-v5 clips rendered by MuJoCo (random actions from different seeds), Debian's Chromium through Playwright.

    MUJOCO_GL=egl python dev/page_screenshots.py            # writes docs/page/{pair,ranking,rating,check}.png
"""

import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import requests

from cleanrlhf_utils.envs import write_mp4
from cleanrlhf_utils.protocol import TOKEN_ENV

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "page"
CHROMIUM = "/usr/bin/chromium"


def hopper_clip(path: Path, seed: int, steps: int = 50) -> bytes:
    """An mp4 of Hopper-v5 under random actions (the seed picks them), 320x240 at 25 fps."""
    env = gym.make("Hopper-v5", render_mode="rgb_array", width=320, height=240)
    env.reset(seed=seed)
    rng = np.random.default_rng(seed)
    frames = []
    for _ in range(steps):
        env.step(rng.uniform(-1, 1, env.action_space.shape) * 0.6)
        frames.append(env.render())
    env.close()
    write_mp4(path, np.stack(frames), fps=25)
    return path.read_bytes()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    from playwright.sync_api import sync_playwright

    token, port = secrets.token_urlsafe(16), free_port()
    base, headers = f"http://127.0.0.1:{port}", {"X-Feedback-Token": token}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        server = subprocess.Popen(
            [sys.executable, "-m", "humanFeedback.feedback_server", "--port", str(port), "--data-dir", str(tmp / "data")],
            cwd=REPO,
            env={**os.environ, TOKEN_ENV: token},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            for _ in range(100):
                try:
                    requests.get(f"{base}/api/config", headers=headers, timeout=1)
                    break
                except requests.ConnectionError:
                    time.sleep(0.1)
            meta = {"instructions": "Which one hops forward better?", "clip_seconds": 2.0}
            run = requests.post(f"{base}/api/runs", json={"name": "hopper", "env_id": "Hopper-v5", "meta": meta}, headers=headers)
            run_id = run.json()["run_id"]
            clips = {f"c{i}.mp4": hopper_clip(tmp / f"c{i}.mp4", seed=i) for i in range(8)}

            def upload(route: str, field: str, entries: list[dict], names: list[str]) -> dict:
                files = [("clips", (name, clips[name], "video/mp4")) for name in names]
                reply = requests.post(f"{base}/api/runs/{run_id}/{route}", data={field: json.dumps(entries)}, files=files, headers=headers)
                reply.raise_for_status()
                return reply.json()

            # newest session first on the page: ratings (3), then the ranking (2), then the pair (1)
            upload(
                "queries",
                "queries",
                [{"left_clip": "c0.mp4", "right_clip": "c1.mp4", "left_segment_id": 0, "right_segment_id": 1, "session": 1}],
                ["c0.mp4", "c1.mp4"],
            )
            upload(
                "queries",
                "queries",
                [{"clips": ["c2.mp4", "c3.mp4", "c4.mp4"], "segment_ids": [2, 3, 4], "session": 2}],
                ["c2.mp4", "c3.mp4", "c4.mp4"],
            )
            upload(
                "queries",
                "queries",
                [{"clips": ["c5.mp4", "c6.mp4"], "segment_ids": [5, 6], "session": 3, "rating_scale": 5}],
                ["c5.mp4", "c6.mp4"],
            )
            check = ["c7.mp4", "c3.mp4", "c1.mp4"]
            entries = [{"clip": name, "predicted_return": 30.0 - 7 * i, "step": 20000, "kind": "check"} for i, name in enumerate(check)]
            upload("evaluations", "evaluations", entries, check)
            query = {"clips": check, "segment_ids": [7, 3, 1], "session": "check-20000", "check_step": 20000}
            upload("queries", "queries", [query], check)
            link = base + requests.post(f"{base}/api/login-codes", json={}, headers=headers).json()["url"]

            OUT.mkdir(parents=True, exist_ok=True)
            with sync_playwright() as p:
                browser = p.chromium.launch(
                    executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
                )
                page = browser.new_page(viewport={"width": 1100, "height": 800})
                page.goto(link)
                page.wait_for_url(base + "/")
                page.fill("#annotator-input", "ann")
                page.click("#name-save")
                playing = "n => [...document.querySelectorAll('video')].filter(v => v.offsetParent && v.readyState >= 2).length >= n"
                for view, clips_shown, name, keys in (
                    ("#rating", 2, "rating", "34"),
                    ("#ranking", 3, "ranking", "21"),
                    ("#pairs", 2, "pair", ""),
                ):
                    page.wait_for_selector(view, state="visible", timeout=30_000)
                    page.wait_for_function(playing, arg=clips_shown, timeout=30_000)
                    for key in keys:  # an answer begun, as a person in the middle of it sees the page
                        page.keyboard.press(key)
                    page.wait_for_timeout(700)
                    page.screenshot(path=str(OUT / f"{name}.png"), full_page=True)
                    page.keyboard.press("Escape")
                    if name == "rating":
                        page.keyboard.press("Backspace")
                        page.keyboard.press("Backspace")
                        page.click("#rate-clips figure[data-clip='0'] button.point[data-rating='3']")
                        page.click("#rate-clips figure[data-clip='1'] button.point[data-rating='4']")
                        page.keyboard.press("Enter")
                    elif name == "ranking":
                        page.keyboard.press("3")
                        page.keyboard.press("Enter")
                page.goto(base + "/#rewards")
                page.wait_for_selector("#reorder-check", state="visible", timeout=30_000)
                page.wait_for_timeout(1500)
                page.screenshot(path=str(OUT / "check.png"), full_page=True)
                browser.close()
        finally:
            server.terminate()
            server.wait(timeout=10)
    print(f"wrote {', '.join(sorted(path.name for path in OUT.glob('*.png')))} to {OUT.relative_to(REPO)}")


if __name__ == "__main__":
    main()
