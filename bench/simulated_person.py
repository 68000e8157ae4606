"""A simulated person teaching through the real page: a headless Chromium (Debian's chromium, driven by Playwright)
opens the labelling page of a real `sac_rlhf.py --teacher-feedback-mode human` run (server autostarted, token on),
watches each pair for its clip's length plus a drawn 2-5 s, and clicks the clip the objective prefers, with a
person's noise (B-Pref's eps-mistake and, optionally, beta-rational model), once as by default (the trainer waits for
each session's answers) and once with --feedback-async. The behaviour is the windmill's direction, which its reward
(0 at every step) says nothing about.

    python bench/simulated_person.py                                  # windmill clockwise, seeds 1 2 3, async and sync
    python bench/simulated_person.py --seeds 1 --modes async --objective windmill-counterclockwise
    python bench/simulated_person.py --modes async --clips-per-query 2 3 4 --labels 30 13 9   # pairs against rankings
    python bench/simulated_person.py --modes async --clips-per-query 2 2 --rating-scales 0 5 --labels 30 13   # and ratings

With --clips-per-query k > 2 the trainer asks for rankings of k clips and the person orders them in the page (keys
1..k best first, then Enter). Their time model: the clips play together and are watched once, then every clip placed
after the first is a judgement of its own, one drawn delay each (k - 1 delays; a pair's one). Their noise is the
synthetic teacher's for rankings (cleanrlhf_utils.feedback.SyntheticTeacher.rank_true_rewards on the objective's
returns: Plackett-Luce at --person-beta, a mistake replacing the order by another). Each --clips-per-query value runs
with its own label budget (--labels, one value for all kinds or one per kind), so kinds can be set against each other at
about equal minutes of the person's time, which each row reports (person_minutes: watching and thinking, waiting left
out). With --rating-scales (one per --clips-per-query; 0: compare or rank) the trainer asks for ratings of each of the
query's clips on that scale, and the person rates them in the page (a digit per clip, then Enter): the clips watched
once together, then a drawn delay per clip (each rating is a judgement of its own: k delays), noise as the synthetic
teacher's ratings (SyntheticTeacher.rate_true_rewards: equal bins between the worst and best clip seen, a mistake
replacing a clip's rating by another).

How the person knows what a clip shows: the trainer logs each uploaded pair with its env returns and objective
returns in runs/<run>/shown_pairs.jsonl (the latter what `--teacher-objective` does in human mode); the person reads
the query id of the pair on screen from the page (#pairs data-query-id) and looks it up there, as a real person would
judge the clip. With --objective env the person judges by the env's own return (Hopper-v5: how far and how well it
hops) and the trainer has no objective:

    python bench/simulated_person.py --env-id Hopper-v5 --objective env --modes async --steps 100000 \
        --explore-steps 10000 --feedback-frequency 5000 --pairs-per-session 20 --clips-per-query 2 3 --labels 200 100

Runs that long finish over several invocations with --keep-finished: the rows --output holds from the same settings
stay, and only the runs it lacks start (one seed an invocation, say). --parallel 2 runs two at once, each trainer with
its own person and browser in a process of its own; their timing columns (labels_per_min, waits, first_pair_s) then
share the machine's cores, while the person's minutes are the person's drawn delays and the clips' lengths.

Reported per run and as medians per mode:
  first_pair_s          seconds from the trainer's launch to the first pair on screen (exploration steps included)
  labels_per_min        answers per minute of labelling time (first pair on screen to the last answer)
  trainer_idle_share    the trainer's time waiting for people (summary.json trainer_idle_seconds) over its wall time
  longest_step_wait_s   the most one training step spent on feedback work (asking, reading answers, putting pairs up;
                        summary.json feedback_longest_step_wait_seconds), the run's last step left out: with
                        --feedback-async that step waits for the open session's answers by design
  person_waiting_share  the person's time between an answer and the next pair on screen, over the labelling time
  eval_return           the final evaluation's return on the env's own reward (Hopper-v5's result with --objective env)
  objective_success     the final evaluation's share of time turning the preferred way (the windmill's success)
  agreement             the person's answers agreeing with the objective (their noise), and the trainer's own
                        measure of it (feedback/objective_agreement, mean over sessions)
  exactly_once          every answer clicked arrived in the run exactly once
Each row's `curve` holds [step, eval return, labels, person-minutes] at every evaluation: the agent's return against
the person's time spent by then (a row kept by --keep-finished without one gains it while its run is still in
--workdir). From the curves, minutes_to_pairs_result: the person's minutes by the first evaluation at which
the run's mean return over three evaluations reached the same seed's pairs' result (their mean over their last three),
for every kind, pairs included: the measure of a kind that teaches as much in fewer of the person's minutes.
The trainer runs with the script's defaults for everything the person does not set (reward-check clips on, its poll
intervals). Targets with --feedback-async: no training step waits more than 2 s on feedback work, trainer idle <= 5 %
of wall time, person waiting <= 10 % of the labelling time, windmill direction learned as in bench/novel_behaviours.py (>= 95 % of evaluation time the preferred way).
"""

import os

os.environ.setdefault("MUJOCO_GL", "egl")

import argparse
import itertools
import json
import math
import multiprocessing
import random
import secrets
import shlex
import signal
import statistics
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path

import numpy as np
from common import DEFENCE_SCRIPTS, REPO, free_port, machine_info, print_table, read_summary, results_path, start_script, write_json
from feedback_efficiency import eval_curve
from novel_behaviours import WINDMILL

from cleanrlhf_utils.feedback import FeedbackClient, FeedbackServerUnreachable, SyntheticTeacher
from cleanrlhf_utils.protocol import TOKEN_ENV  # read by the trainer when no --feedback-server-token is given
from cleanrlhf_utils.rankings import MAX_CLIPS, clip_pairs, orders
from cleanrlhf_utils.ratings import MAX_SCALE, clip_ratings

CHROMIUM = "/usr/bin/chromium"


# --objective env: the person wants what the env's own reward pays (Hopper's hop), and judges each clip by its return
ENV_REWARD = "env"


class ShownPairs:
    """runs/<run>/shown_pairs.jsonl, read as it grows: query id -> the returns of its clips the person judges by, in
    the order shown ((left, right) for a pair): the objective's, or with judge ENV_REWARD the env's."""

    def __init__(self, path: Path, judge: str = "objective"):
        self.path, self.offset, self.returns = path, 0, {}
        self.judge = "env" if judge == ENV_REWARD else "objective"

    def lookup(self, query_id: int, timeout: float = 10.0) -> tuple[float, ...]:
        deadline = time.monotonic() + timeout
        while query_id not in self.returns:
            if self.path.exists():
                with open(self.path) as log:
                    log.seek(self.offset)
                    for line in iter(log.readline, ""):
                        if not line.endswith("\n"):  # a line still being written: read it next time
                            break
                        self.offset += len(line.encode())
                        pair = json.loads(line)
                        name = self.judge
                        clips = pair.get(f"{name}_returns") or (pair[f"left_{name}_return"], pair[f"right_{name}_return"])
                        self.returns[pair["query_id"]] = tuple(clips)
            if query_id in self.returns:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"pair {query_id} is on the page but not in {self.path} after {timeout:g} s")
            time.sleep(0.05)
        return self.returns[query_id]


class Person:
    """Answers by the objective's segment returns: beta-rational (P(right) = sigmoid(beta (R_right - R_left))) when
    beta >= 0, else the larger return; then flips the answer with probability eps_mistake. Ranks k clips as the
    synthetic teacher does, from the same noise settings, and rates them on a scale as it does (anchored on the worst
    and best clip seen so far)."""

    def __init__(self, beta: float, eps_mistake: float, delay: tuple[float, float], seed: int, rating_scale: int = 0):
        self.beta, self.eps_mistake, self.delay = beta, eps_mistake, delay
        self.rng = random.Random(seed)
        self.ranker = SyntheticTeacher(beta, 1.0, eps_mistake, 0.0, 0.0, seed=seed, rating_scale=rating_scale)

    def choose(self, left: float, right: float) -> str:
        if self.beta >= 0:
            z = max(-50.0, min(50.0, self.beta * (right - left)))
            prefer_right = self.rng.random() < 1.0 / (1.0 + math.exp(-z))
        else:
            prefer_right = right > left
        if self.rng.random() < self.eps_mistake:
            prefer_right = not prefer_right
        return "right" if prefer_right else "left"

    def rank(self, returns: tuple[float, ...]) -> list[int]:
        """The clips best first (indices into `returns`)."""
        label = self.ranker.rank_true_rewards(np.array(returns, dtype=np.float64)[None, :, None])[0]
        return orders(len(returns))[int(label)].tolist()

    def rate(self, returns: tuple[float, ...]) -> list[int]:
        """Each clip's rating, 1 .. the scale, in the order shown."""
        label = self.ranker.rate_true_rewards(np.array(returns, dtype=np.float64)[None, :, None])
        return (clip_ratings(label, len(returns), self.ranker.rating_scale)[0] + 1).tolist()

    def thinking_seconds(self, clips: int = 2, rated: bool = False) -> float:
        """A drawn delay per judgement: a pair is one, a ranking of k clips k - 1 (each clip placed after the first),
        ratings of k clips k (each clip's own)."""
        return sum(self.rng.uniform(*self.delay) for _ in range(clips if rated else clips - 1))


def agreement(scores: list[float], returns: tuple[float, ...]) -> float | None:
    """The share of the answer's clip pairs that it orders as the objective does (pairs the objective ties, and clips
    the answer scores alike, left out); None when none is left. `scores`: each clip's, higher is better (minus its
    place in a ranking, its rating)."""
    pairs = zip(*clip_pairs(len(returns)))
    judged = [(scores[i] > scores[j]) == (returns[i] > returns[j]) for i, j in pairs if returns[i] != returns[j] and scores[i] != scores[j]]
    return statistics.mean(judged) if judged else None


# the query id of the query on screen in view `box` (#pairs or #ranking), once it differs from `last`
SHOWN_QUERY = "([box, last]) => { const id = document.querySelector(box).dataset.queryId; return id && id !== last ? id : null; }"
# the longest of the query's `clips` videos in `selector`, once all of them play (seconds at the page's speed)
PLAYING = (
    "([selector, clips]) => { const v = [...document.querySelectorAll(selector)];"
    " return v.length === clips && v.every(x => x.readyState >= 2 && x.duration > 0) ?"
    " Math.max(...v.map(x => x.duration / (x.playbackRate || 1))) : null; }"
)
VIEWS = {"pair": ("#pairs", ".pair.active video"), "ranking": ("#ranking", "#rank-clips video"), "rating": ("#rating", "#rate-clips video")}
"""a query's view and its videos in the page, by kind"""


def query_kind(clips: int, rating_scale: int) -> str:
    return "rating" if rating_scale else "pair" if clips == 2 else "ranking"


def answer_in_page(page, person: Person, returns: tuple[float, ...], rating_scale: int) -> tuple[str | list[int], list[float]]:
    """The person's answer to the query on screen, given as a person would: a click on the preferred clip of a pair,
    the clips' keys best first and Enter for a ranking, a digit per clip (0 for 10) and Enter for ratings. Returns the
    answer and each clip's score under it (higher is better)."""
    if rating_scale:
        ratings = person.rate(returns)
        for rating in ratings:
            page.keyboard.press(str(rating % 10))
        page.keyboard.press("Enter")
        return ratings, ratings
    if len(returns) == 2:
        choice = person.choose(*returns)
        page.click(f"button.choice[data-choice={choice}]")
        return choice, [0, 1] if choice == "right" else [1, 0]
    order = person.rank(returns)
    for clip in order:
        page.keyboard.press(str(clip + 1))
    page.keyboard.press("Enter")
    return order, [-order.index(clip) for clip in range(len(returns))]


def label_through_page(base: str, token: str, trainer, shown: ShownPairs, person: Person, started: float, clips: int, scale: int) -> dict:
    """The person's session: open the page, give a name, then until the trainer exits: wait for a new query of
    `clips` clips (to rate on `scale`, or 0), watch it for its clips' length plus the drawn thinking, answer. Returns
    what the person saw and did (times from `started`)."""
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright

    answers, waits = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
        )
        page = browser.new_page(viewport={"width": 1100, "height": 800})
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        client = FeedbackClient(base, token, retry_seconds=0, timeout=5)
        while True:  # the autostarted server comes up with the trainer; the person logs in with a one-time link
            if trainer.poll() is not None:
                raise SystemExit(f"the trainer exited ({trainer.returncode}) before its page answered")
            try:
                page.goto(client.login_link()[0], timeout=5000)
                page.wait_for_url(f"{base}/", timeout=5000)
                break
            except (FeedbackServerUnreachable, PlaywrightError):
                time.sleep(0.5)
        page.fill("#annotator-input", "simulated-person")
        page.click("#name-save")
        last, answered_at, first_shown = "", None, None
        view, videos = VIEWS[query_kind(clips, scale)]
        while trainer.poll() is None:
            try:
                handle = page.wait_for_function(SHOWN_QUERY, arg=[view, last], timeout=1000, polling=50)
            except PlaywrightTimeout:
                continue
            query_id = handle.json_value()
            now = time.perf_counter() - started
            if first_shown is None:
                first_shown = now
            if answered_at is not None:
                waits.append(now - answered_at)
            returns = shown.lookup(int(query_id))
            clip_seconds = page.wait_for_function(PLAYING, arg=[videos, clips], timeout=10_000, polling=50).json_value()
            time.sleep(clip_seconds + person.thinking_seconds(clips, bool(scale)))  # the clips once (together), then thinking
            answer, scores = answer_in_page(page, person, returns, scale)
            answered_at = time.perf_counter() - started
            answers.append({"query_id": int(query_id), "shown_s": round(now, 3), "answered_s": round(answered_at, 3)})
            answers[-1] |= {"clip_seconds": round(clip_seconds, 3), "choice": answer, "agrees_with_objective": agreement(scores, returns)}
            last = query_id
        pending = page.evaluate("() => Object.keys(JSON.parse(localStorage.getItem('cleanrlhf.feedback.outbox') || '{}')).length")
        browser.close()
    return {"answers": answers, "waits": waits, "first_shown": first_shown, "page_errors": errors, "unsent": pending}


def trainer_flags(args, seed: int, run_name: str, base: str, asynchronous: bool, clips: int, scale: int, labels: int) -> list[str]:
    return [
        "--env-id", args.env_id, *(["--teacher-objective", args.objective] if args.objective != ENV_REWARD else []),
        "--seed", str(seed), "--run-name", run_name,
        "--total-timesteps", str(args.steps), "--total-explore-steps", str(args.explore_steps),
        "--learning-starts", str(min(1000, args.explore_steps)), "--teacher-feedback-total-queries", str(labels),
        "--teacher-feedback-num-queries-per-session", str(args.pairs_per_session), "--teacher-feedback-schedule", "linear",
        "--teacher-feedback-frequency", str(args.feedback_frequency), "--evaluation-frequency", str(args.evaluation_frequency),
        "--evaluation-episodes", "5", "--checkpoint-frequency", "0", "--torch-threads", "1", "--no-cuda",
        "--teacher-feedback-mode", "human", "--feedback-server-url", base, "--feedback-server-autostart",
        "--clips-per-query", str(clips), *(["--rating-scale", str(scale)] if scale else []),
        *(["--feedback-async"] if asynchronous else []),
        *(["--feedback-async-poll-steps", str(args.async_poll_steps)] if asynchronous and args.async_poll_steps else []),
        *shlex.split(args.preference_flags),
    ]  # fmt: skip


def trainer_agreement(workdir: Path, run_name: str) -> float | None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(workdir / "runs" / run_name), size_guidance={"scalars": 0})
    events.Reload()
    if "feedback/objective_agreement" not in events.Tags()["scalars"]:
        return None
    return statistics.mean(e.value for e in events.Scalars("feedback/objective_agreement"))


def person_curve(workdir: Path, run_name: str, answers: list[dict]) -> list[list[float]]:
    """[step, eval return, labels, person-minutes] at each of a run's evaluations: its return against the person's
    time spent by then. The labels are the trainer's count (feedback/labels_obtained) logged at or before the step;
    the minutes are those of the first that many answers in the order they were given."""
    spent = np.cumsum([0.0, *(a["answered_s"] - a["shown_s"] for a in sorted(answers, key=lambda a: a["answered_s"]))]) / 60
    labelled = eval_curve(workdir, run_name, "feedback/labels_obtained")
    curve = []
    for step, value in eval_curve(workdir, run_name):
        labels = int(max((count for at, count in labelled if at <= step), default=0))
        curve.append([step, value, labels, float(spent[min(labels, len(answers))])])
    return curve


RUNNING_TRAINERS = []
"""the trainer this worker process runs, for its stop signal to end"""


def stop_trainer_and_interrupt(signum, frame) -> None:
    """A worker's SIGINT: end its trainer first, then interrupt. The interrupt alone can land inside the browser's
    event loop and be lost there; with its trainer gone the person's session ends and the run fails, wherever the
    worker is."""
    for trainer in RUNNING_TRAINERS:
        if trainer.poll() is None:
            trainer.kill()
    raise KeyboardInterrupt


def stop_trainers_on_interrupt() -> None:
    signal.signal(signal.SIGINT, stop_trainer_and_interrupt)


def one_run(args, seed: int, asynchronous: bool, clips: int, scale: int, labels: int) -> dict:
    mode = "async" if asynchronous else "sync"
    run_name = f"person_{mode}_{args.objective}_k{clips}{f'r{scale}' if scale else ''}_{seed}_{int(time.time())}"
    base, token = f"http://127.0.0.1:{free_port()}", secrets.token_urlsafe(16)
    os.environ[TOKEN_ENV] = token
    started = time.perf_counter()
    trainer = start_script(
        DEFENCE_SCRIPTS[args.robust_labels], trainer_flags(args, seed, run_name, base, asynchronous, clips, scale, labels), args.workdir,
        log=args.workdir / f"{run_name}.log",
    )  # fmt: skip
    RUNNING_TRAINERS.append(trainer)
    try:
        person = Person(args.person_beta, args.person_eps_mistake, tuple(args.answer_delay), seed, scale)
        shown = ShownPairs(args.workdir / "runs" / run_name / "shown_pairs.jsonl", args.objective)
        seen = label_through_page(base, token, trainer, shown, person, started, clips, scale)
    finally:
        if trainer.poll() is None:
            trainer.kill()
        RUNNING_TRAINERS.remove(trainer)
    if trainer.wait() != 0:
        raise SystemExit(f"the {mode} run failed; see {args.workdir / f'{run_name}.log'}")
    summary = read_summary(args.workdir, run_name)
    answers = seen["answers"]
    labelling = answers[-1]["answered_s"] - seen["first_shown"] if answers else 0.0
    judged = [a["agrees_with_objective"] for a in answers if a["agrees_with_objective"] is not None]
    return {
        "mode": mode, "clips": clips, "rating_scale": scale, "seed": seed, "run_name": run_name, "labels": len(answers),
        "person_minutes": sum(a["answered_s"] - a["shown_s"] for a in answers) / 60,
        "labels_obtained": summary["labels_obtained"], "exactly_once": summary["labels_obtained"] == len(answers) and seen["unsent"] == 0,
        "first_pair_s": seen["first_shown"], "labelling_s": labelling,
        "labels_per_min": 60 * len(answers) / labelling if labelling else None,
        "wall_s": summary["wall_seconds"], "trainer_idle_s": summary["trainer_idle_seconds"],
        "trainer_idle_share": summary["trainer_idle_seconds"] / summary["wall_seconds"],
        "longest_step_wait_s": summary["feedback_longest_step_wait_seconds"],
        "longest_step_wait_at": summary["feedback_longest_step_wait_step"],
        "person_waiting_s": sum(seen["waits"]), "person_waiting_share": sum(seen["waits"]) / labelling if labelling else None,
        "longest_wait_s": max(seen["waits"], default=0.0),
        "eval_return": summary["final_eval_return"],
        "objective_return": summary.get("final_objective_return"), "objective_success": summary.get("final_objective_success"),
        "person_agreement": statistics.mean(judged) if judged else None, "trainer_agreement": trainer_agreement(args.workdir, run_name),
        "page_errors": seen["page_errors"], "answers": answers, "waits": seen["waits"],
        "curve": person_curve(args.workdir, run_name, answers),
    }  # fmt: skip


SMOOTHED_EVALUATIONS = 3
"""evaluations a result is averaged over: one Hopper evaluation's return swings by a third against its neighbour's"""


def minutes_to_reach(curve: list[list[float]], level: float) -> float | None:
    """The person's minutes spent by the first evaluation at which the mean return of it and the evaluations before it
    (SMOOTHED_EVALUATIONS in all) reached `level`; None if none did."""
    for end in range(SMOOTHED_EVALUATIONS, len(curve) + 1):
        window = curve[end - SMOOTHED_EVALUATIONS : end]
        if statistics.mean(value for _, value, _, _ in window) >= level:
            return window[-1][3]
    return None


def with_minutes_to_pairs_result(rows: list[dict]) -> list[dict]:
    """Each row with a curve gains minutes_to_pairs_result: the minutes its person had spent when its agent reached
    the result of the pairs' run of the same mode and seed (the mean return of that run's last SMOOTHED_EVALUATIONS),
    the pairs' own row included (at most its person_minutes). Rows without a curve, or without such a pairs' run, get
    None."""
    pairs = {
        (r["mode"], r["seed"]): r["curve"] for r in rows if query_kind(r["clips"], r.get("rating_scale", 0)) == "pair" and r.get("curve")
    }
    for row in rows:
        level = pairs.get((row["mode"], row["seed"]))
        reached = None
        if row.get("curve") and level and len(level) >= SMOOTHED_EVALUATIONS:
            result = statistics.mean(value for _, value, _, _ in level[-SMOOTHED_EVALUATIONS:])
            reached = minutes_to_reach(row["curve"], result)
        row["minutes_to_pairs_result"] = reached
    return rows


COLUMNS = [
    "mode",
    "clips",
    "rating_scale",
    "seed",
    "labels",
    "person_minutes",
    "exactly_once",
    "first_pair_s",
    "labels_per_min",
    "wall_s",
    "trainer_idle_share",
    "longest_step_wait_s",
]
COLUMNS += ["person_waiting_share", "longest_wait_s", "eval_return", "minutes_to_pairs_result", "objective_success"]
COLUMNS += ["person_agreement", "trainer_agreement"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env-id", default=WINDMILL)
    parser.add_argument(
        "--objective",
        default="windmill-clockwise",
        help=f"what the person wants: a --teacher-objective, or {ENV_REWARD!r}, what the env's own reward pays (Hopper-v5's hop)",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--modes", nargs="+", choices=["sync", "async"], default=["async", "sync"])
    parser.add_argument(
        "--steps", type=int, default=20_000, help="environment steps per run: with --feedback-async, enough to outlast the labelling"
    )
    parser.add_argument("--explore-steps", type=int, default=1000)
    parser.add_argument(
        "--labels", type=int, nargs="+", default=[50], help="label budget per run: one for every kind, or one per --clips-per-query"
    )
    parser.add_argument(
        "--clips-per-query", type=int, nargs="+", default=[2], help=f"clips the person compares (2) or ranks (3..{MAX_CLIPS}), a run each"
    )
    parser.add_argument(
        "--rating-scales", type=int, nargs="+", default=None,
        help=f"one per --clips-per-query: 0 compares or ranks, 2..{MAX_SCALE} rates each clip on that scale (default: all 0)",
    )  # fmt: skip
    parser.add_argument("--pairs-per-session", type=int, default=10)
    parser.add_argument("--feedback-frequency", type=int, default=500, help="steps between sessions (async: at least)")
    parser.add_argument("--evaluation-frequency", type=int, default=3000)
    parser.add_argument(
        "--async-poll-steps", type=int, default=None, help="--feedback-async-poll-steps of the async run (default: the script's)"
    )
    parser.add_argument("--answer-delay", type=float, nargs=2, default=[2.0, 5.0], metavar=("MIN", "MAX"),
                        help="seconds the person thinks after watching a clip once, drawn uniformly")  # fmt: skip
    parser.add_argument("--person-eps-mistake", type=float, default=0.1, help="share of answers the person gets wrong")
    parser.add_argument("--person-beta", type=float, default=-1.0, help="beta-rational person on objective returns; -1: off")
    parser.add_argument(
        "--robust-labels",
        choices=sorted(DEFENCE_SCRIPTS),
        default="none",
        help="the trainer's label-noise defence: the variant of PEBBLE it runs",
    )
    parser.add_argument("--preference-flags", default="", help="more flags for the trainer, one string (e.g. --rime-flip-tau 0.01)")
    parser.add_argument(
        "--keep-finished", action="store_true",
        help="keep the rows --output already holds from a run of the same settings (other seeds allowed) and run only the "
        "runs it lacks: a benchmark of many long runs finishes over several invocations",
    )  # fmt: skip
    parser.add_argument("--parallel", type=int, default=1, help="runs at once, each with its own person and browser")
    parser.add_argument("--workdir", type=Path, default=REPO / "bench" / "workdir" / "simulated_person")
    parser.add_argument("--output", type=Path, default=results_path("simulated_person", "human-loop", "windmill-person"))
    args = parser.parse_args()
    if not Path(CHROMIUM).exists():
        raise SystemExit(f"{CHROMIUM} is missing: bash dev/install_test_deps.sh installs it")
    if args.parallel < 1:
        parser.error(f"--parallel {args.parallel}: at least 1")
    if not 0 <= args.answer_delay[0] <= args.answer_delay[1]:
        parser.error(f"--answer-delay {args.answer_delay[0]:g} {args.answer_delay[1]:g}: need 0 <= MIN <= MAX")
    wrong = [k for k in args.clips_per_query if not 2 <= k <= MAX_CLIPS]
    if wrong:
        parser.error(f"--clips-per-query {wrong[0]}: a query shows 2 to {MAX_CLIPS} clips")
    if len(args.labels) not in (1, len(args.clips_per_query)):
        parser.error(f"--labels takes one budget or one per --clips-per-query ({len(args.clips_per_query)}), got {len(args.labels)}")
    args.rating_scales = args.rating_scales or [0] * len(args.clips_per_query)
    if len(args.rating_scales) != len(args.clips_per_query):
        parser.error(f"--rating-scales takes one per --clips-per-query ({len(args.clips_per_query)}), got {len(args.rating_scales)}")
    if off := [n for n in args.rating_scales if n != 0 and not 2 <= n <= MAX_SCALE]:
        parser.error(f"--rating-scales {off[0]}: 0 (compare or rank) or a scale of 2 to {MAX_SCALE} points")
    kinds = list(zip(args.clips_per_query, args.rating_scales))
    if len(set(kinds)) < len(kinds):
        parser.error(f"--clips-per-query and --rating-scales name a kind of query twice: {kinds}")
    budgets = dict(zip(kinds, args.labels * len(kinds) if len(args.labels) == 1 else args.labels))

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill` stops the benchmark as Ctrl-C does, runs and all
    output = args.output if args.output.is_absolute() else Path.cwd() / args.output
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    rows = finished_rows(output, settings) if args.keep_finished else []
    seeds = sorted({*args.seeds, *(r["seed"] for r in rows)})
    settings["seeds"] = seeds  # what the rows cover, kept ones included
    plan = [(mode, clips, scale, seed) for seed in seeds for mode, (clips, scale) in itertools.product(args.modes, kinds)]
    todo = []
    for mode, clips, scale, seed in plan:
        kind = {"pair": "pairs", "ranking": f"rankings of {clips} clips", "rating": f"ratings of {clips} clips on {scale} points"}
        if any(row_key(r) == (mode, clips, scale, seed) for r in rows):
            print(f"{mode} run, seed {seed}, {kind[query_kind(clips, scale)]}: kept from {output}")
        elif seed in args.seeds:
            print(f"{mode} run, seed {seed}: {args.steps} steps, {budgets[clips, scale]} {kind[query_kind(clips, scale)]} through the page")
            todo.append((mode, clips, scale, seed))

    def write() -> None:
        result = {"benchmark": "simulated_person", "command": shlex.join(["python", "bench/simulated_person.py", *sys.argv[1:]])}
        result["complete"] = len(rows) == len(plan)
        machine = machine_info() | {"load_average": list(os.getloadavg())}
        with_minutes_to_pairs_result(rows)
        write_json(output, result | {"machine": machine, "settings": settings, "rows": rows, "medians": medians_per_kind(rows)})

    # A kept row without its curve gains it while its run is still in --workdir.
    uncurved = [row for row in rows if "curve" not in row and (args.workdir / "runs" / row["run_name"]).is_dir()]
    for row in uncurved:
        row["curve"] = person_curve(args.workdir, row["run_name"], row["answers"])
        print(f"{row['mode']} run, seed {row['seed']}, {row['run_name']}: its curve read from {args.workdir}")
    with_minutes_to_pairs_result(rows)
    if uncurved:
        write()

    def finished(row: dict) -> None:
        rows.append(row)
        rows.sort(key=lambda kept: plan.index(row_key(kept)))
        write()  # after every run, so a stopped benchmark keeps the runs it finished ("complete": false until the last)
        print_table([row], COLUMNS)

    run_at_once(args, todo, budgets, finished)
    print_table(rows, COLUMNS)
    print("medians:")
    print_table(medians_per_kind(rows), ["mode", "clips", "rating_scale", "seeds", *COLUMNS[4:]])


def run_at_once(args, todo: list[tuple], budgets: dict, finished) -> None:
    """Runs each planned (mode, clips, scale, seed) with one_run, args.parallel at a time, each in a spawned process
    (its own token in its environment, its own browser), handing `finished` each row as its run ends. A run goes to
    the pool only when a worker is free, so that nothing is queued when the benchmark stops: stopped (Ctrl-C) or a run
    failed, the runs still going are interrupted too, and each worker's interrupt ends its trainer first."""
    with ProcessPoolExecutor(
        args.parallel, mp_context=multiprocessing.get_context("spawn"), initializer=stop_trainers_on_interrupt
    ) as pool:
        running = set()
        try:
            while todo or running:
                while todo and len(running) < args.parallel:
                    mode, clips, scale, seed = todo.pop(0)
                    running.add(pool.submit(one_run, args, seed, mode == "async", clips, scale, budgets[clips, scale]))
                done, running = wait(running, return_when=FIRST_COMPLETED)
                for run in done:
                    finished(run.result())
        except BaseException:
            for worker in multiprocessing.active_children():
                os.kill(worker.pid, signal.SIGINT)
            raise


# Settings that say which runs an invocation starts or where it writes, not how a run goes: --keep-finished compares
# the others with the kept file's.
PER_INVOCATION = ("seeds", "keep_finished", "workdir", "output")


def row_key(row: dict) -> tuple:
    return row["mode"], row["clips"], row.get("rating_scale", 0), row["seed"]


def finished_rows(output: Path, settings: dict) -> list[dict]:
    """--keep-finished: the rows an earlier invocation wrote to output, if it ran with these settings (seeds aside)."""
    if not output.exists():
        return []
    earlier = json.loads(output.read_text())
    other = {k: v for k, v in earlier["settings"].items() if k not in PER_INVOCATION}
    differ = sorted(k for k in {*other, *settings} - set(PER_INVOCATION) if other.get(k) != settings.get(k))
    if differ:
        shown = ", ".join(f"--{k.replace('_', '-')} {other.get(k)!r} there, {settings.get(k)!r} here" for k in differ)
        raise SystemExit(f"--keep-finished: {output} holds runs of other settings ({shown}); name another --output")
    return earlier["rows"]


def medians_per_kind(rows: list[dict]) -> list[dict]:
    """Medians over seeds of each (mode, clips per query, rating scale), in the order the runs came."""
    medians = []
    for mode, clips, scale in dict.fromkeys((r["mode"], r["clips"], r.get("rating_scale", 0)) for r in rows):
        mine = [r for r in rows if (r["mode"], r["clips"], r.get("rating_scale", 0)) == (mode, clips, scale)]
        numeric = [c for c in COLUMNS[4:] if all(isinstance(r[c], (int, float)) and not isinstance(r[c], bool) for r in mine)]
        kind = {"mode": mode, "clips": clips, "rating_scale": scale, "seeds": len(mine)}
        medians.append(kind | {c: statistics.median(r[c] for r in mine) for c in numeric})
        medians[-1]["exactly_once"] = all(r["exactly_once"] for r in mine)
    return medians


if __name__ == "__main__":
    main()
