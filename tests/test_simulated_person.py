"""bench/simulated_person.py small: a headless Chromium plays a person on the real page of a real human-mode run on the
zero-reward windmill (server autostarted, token on), answering by the objective it wants from what each pair shows."""

import argparse
import json
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from cleanrlhf_utils.feedback import read_label_file
from cleanrlhf_utils.objectives import load_objective, segment_rewards

REPO = Path(__file__).resolve().parents[1]
if not Path("/usr/bin/chromium").exists():
    pytest.skip("/usr/bin/chromium is missing (bash dev/install_test_deps.sh)", allow_module_level=True)
pytest.importorskip("playwright.sync_api", reason="playwright is missing (pip install playwright)")

# the trainer's networks, small: what the person does through the page does not depend on them
SMALL_NETWORKS = "--batch-size 64 --actor-hidden-dim 64 --critic-hidden-dim 64 --reward-net-hidden-dim 64"


def test_a_person_on_the_page_gives_the_run_labels_that_prefer_what_they_want(tmp_path):
    command = [
        sys.executable, str(REPO / "bench" / "simulated_person.py"), "--seeds", "1", "--modes", "sync",
        "--objective", "windmill-counterclockwise", "--steps", "1000", "--explore-steps", "500", "--labels", "6",
        "--pairs-per-session", "3", "--feedback-frequency", "300", "--evaluation-frequency", "1000",
        "--answer-delay", "0", "0.2", "--person-eps-mistake", "0", "--robust-labels", "smooth",
        f"--preference-flags=--label-mistake-rate 0.2 {SMALL_NETWORKS}",
        "--workdir", str(tmp_path / "work"),
        "--output", str(tmp_path / "out.json"),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    row = json.loads((tmp_path / "out.json").read_text())["rows"][0]

    # Six pairs on screen, each watched at least its clip's length, each answer in the run exactly once.
    assert row["labels"] == row["labels_obtained"] == 6 and row["exactly_once"] and not row["page_errors"]
    assert all(a["answered_s"] - a["shown_s"] >= a["clip_seconds"] > 0 for a in row["answers"])
    assert 0 < row["first_pair_s"] < row["wall_s"] and 0 <= row["person_waiting_share"] < 1 and 0 <= row["trainer_idle_share"] < 1
    # A person without mistakes agrees with the objective, and the trainer measured the same from their answers.
    assert row["person_agreement"] == 1.0 and row["trainer_agreement"] == 1.0

    # The trainer ran with the benchmark's extra flags (a noise defence here)
    run_dir = tmp_path / "work" / "runs" / row["run_name"]
    assert json.loads((run_dir / "args.json").read_text())["label_mistake_rate"] == 0.2  # the mistake-aware variant ran

    # What reached the run: every label prefers the segment the objective (recomputed from the stored segments) ranks
    # higher, so query ids, sides and segments line up from the trainer's log through the page and server back to it.
    segments, labels = read_label_file(run_dir / "labels.sqlite")
    returns = segment_rewards(load_objective("windmill-counterclockwise"), segments, obs_dim=3).sum(-1)
    assert len(labels) == 6
    np.testing.assert_array_equal(labels, (returns[:, 1] > returns[:, 0]).astype(np.float32))
    shown = [json.loads(line) for line in (run_dir / "shown_pairs.jsonl").read_text().splitlines()]
    assert sorted(pair["query_id"] for pair in shown) == sorted(a["query_id"] for a in row["answers"])
    logged = np.array([[p["left_objective_return"], p["right_objective_return"]] for p in sorted(shown, key=lambda p: p["query_id"])])
    np.testing.assert_allclose(logged, returns, rtol=1e-6, atol=1e-9)

    # --keep-finished: the same benchmark again keeps the finished run and starts none; other settings are refused with
    # the setting named, and the file stays as it was.
    written = (tmp_path / "out.json").read_text()
    again = subprocess.run([*command, "--keep-finished"], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "kept from" in again.stdout and (tmp_path / "out.json").read_text() == written
    assert [p.name for p in (tmp_path / "work" / "runs").iterdir()] == [row["run_name"]]
    # Its curve: the final evaluation's return after all six labels and all the person's minutes. A kept row
    # without its curve gains it again from the run in --workdir, and nothing else in the file changes.
    assert row["curve"] == [[1000, row["eval_return"], 6, pytest.approx(row["person_minutes"])]]
    kept = json.loads(written)
    del kept["rows"][0]["curve"]
    (tmp_path / "out.json").write_text(json.dumps(kept))
    again = subprocess.run([*command, "--keep-finished"], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "its curve read from" in again.stdout, again.stdout[-3000:] + again.stderr[-3000:]
    rewritten = json.loads((tmp_path / "out.json").read_text())
    assert rewritten["rows"] == json.loads(written)["rows"]
    assert rewritten["settings"] == kept["settings"] | {"keep_finished": True}  # only what this invocation was asked
    written = (tmp_path / "out.json").read_text()
    other = [*command, "--keep-finished"]
    other[other.index("--labels") + 1] = "7"
    refused = subprocess.run(other, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "--labels [6] there, [7] here" in refused.stderr
    assert (tmp_path / "out.json").read_text() == written


def simulated_person():
    sys.path.insert(0, str(REPO / "bench"))
    import simulated_person

    return simulated_person


def test_a_curve_sets_each_evaluation_against_the_labels_and_the_persons_minutes_by_then(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "runs" / "person"))
    for step, value in [(1000, 10.0), (2000, 20.0), (3000, 30.0), (4000, 40.0)]:
        writer.add_scalar("eval/mean_return", value, step)
    for step, count in [(1500, 2), (3000, 3)]:  # a session logged at an evaluation's step came before it
        writer.add_scalar("feedback/labels_obtained", count, step)
    writer.close()
    # given out of order: 6 s, 12 s and 18 s of the person's time, answered in that order
    answers = [
        {"shown_s": 30.0, "answered_s": 48.0}, {"shown_s": 0.0, "answered_s": 6.0}, {"shown_s": 10.0, "answered_s": 22.0},
    ]  # fmt: skip
    curve = simulated_person().person_curve(tmp_path, "person", answers)
    assert curve == [[1000, 10.0, 0, 0.0], [2000, 20.0, 2, pytest.approx(0.3)], [3000, 30.0, 3, pytest.approx(0.6)],
                     [4000, 40.0, 3, pytest.approx(0.6)]]  # fmt: skip


def test_each_kind_is_timed_to_the_pairs_result_of_its_seed_over_three_evaluations():
    def row(clips, seed, returns, minutes, scale=0):
        curve = [[1000 * (i + 1), value, i, spent] for i, (value, spent) in enumerate(zip(returns, minutes))]
        return {"mode": "async", "clips": clips, "rating_scale": scale, "seed": seed, "curve": curve}

    rows = [
        row(2, 1, [100, 200, 300, 400, 500], [0, 1, 2, 3, 4]),  # its result: 400, the mean of its last three
        row(3, 1, [100, 500, 500, 500, 300], [0, 0.5, 1, 1.5, 2]),  # one evaluation of 500 is not enough: three are
        row(2, 1, [300, 300, 300, 300, 300], [0, 0.5, 1, 1.5, 2], scale=5),  # ratings: never there
        row(3, 2, [900, 900, 900], [0, 1, 2]),  # no pairs' run of seed 2
        {"mode": "async", "clips": 4, "rating_scale": 0, "seed": 1},  # a row without a curve
    ]
    reached = [r["minutes_to_pairs_result"] for r in simulated_person().with_minutes_to_pairs_result(rows)]
    assert reached == [4, 1.5, None, None, None]


def test_the_person_ranks_and_rates_by_the_objective_and_thinks_once_per_judgement():
    person_module = simulated_person()
    person = person_module.Person(beta=-1.0, eps_mistake=0.0, delay=(1.0, 2.0), seed=3)
    assert person.rank((0.5, 2.0, -1.0, 1.0)) == [1, 3, 0, 2]
    assert person.choose(0.5, 2.0) == "right"
    for clips in (2, 3, 4):
        assert all(clips - 1 <= person.thinking_seconds(clips) <= 2 * (clips - 1) for _ in range(50))
        assert all(clips <= person.thinking_seconds(clips, rated=True) <= 2 * clips for _ in range(50))  # a delay per clip
    # agreement: the share of the answer's clip pairs in the objective's order, ties of either left out
    assert person_module.agreement([2, 4, 1, 3], (0.5, 2.0, -1.0, 1.0)) == 1.0
    assert person_module.agreement([-1, -3, 0, -2], (0.5, 2.0, -1.0, 1.0)) == 0.0
    assert person_module.agreement([2, 1, 0], (1.0, 1.0, 0.0)) == 1.0  # the tied pair (0, 1) is not judged
    assert person_module.agreement([3, 3, 1], (1.0, 2.0, 0.0)) == 1.0  # nor the pair rated alike
    assert person_module.agreement([1, 0], (1.0, 1.0)) is None
    # a person who always errs answers every ranking with an order other than the objective's
    wrong = person_module.Person(beta=-1.0, eps_mistake=1.0, delay=(0.0, 0.0), seed=3)
    assert all(wrong.rank((0.5, 2.0, -1.0)) != [1, 0, 2] for _ in range(30))
    # ratings, 1 .. 5, anchored on the worst and best clip seen so far
    rater = person_module.Person(beta=-1.0, eps_mistake=0.0, delay=(0.0, 0.0), seed=3, rating_scale=5)
    assert rater.rate((0.0, 10.0)) == [1, 5] and rater.rate((4.0, 6.0)) == [3, 4] and rater.rate((-10.0, 10.0)) == [1, 5]
    assert rater.rate((4.0, 6.0)) == [4, 5]  # the worse clip seen since stretched the scale: they rate higher


def test_a_person_ranks_and_rates_clips_on_the_page_and_each_run_learns_the_answers_given(tmp_path):
    """One invocation, two runs at once (--parallel 2, each with its own browser and token): rankings of three clips,
    and ratings of two on a scale of four; the rows come in the order the runs were planned."""
    from cleanrlhf_utils.rankings import order_labels
    from cleanrlhf_utils.ratings import rating_labels

    command = [
        sys.executable, str(REPO / "bench" / "simulated_person.py"), "--seeds", "1", "--modes", "async",
        "--objective", "windmill-counterclockwise", "--steps", "700", "--explore-steps", "500", "--labels", "3",
        "--clips-per-query", "3", "2", "--rating-scales", "0", "4", "--pairs-per-session", "3", "--feedback-frequency", "300",
        "--evaluation-frequency", "700", "--answer-delay", "0.1", "0.2", "--person-eps-mistake", "0",
        f"--preference-flags={SMALL_NETWORKS}", "--workdir", str(tmp_path / "work"), "--output", str(tmp_path / "out.json"),
        "--parallel", "2",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranked, rated = json.loads((tmp_path / "out.json").read_text())["rows"]
    for row, kind in ((ranked, (3, 0)), (rated, (2, 4))):
        assert (row["clips"], row["rating_scale"]) == kind and row["labels"] == row["labels_obtained"] == 3 and row["exactly_once"]
        assert not row["page_errors"] and row["person_agreement"] == 1.0
        # the clips watched once, together, then a judgement per clip placed after the first (a ranking) or per clip
        # rated: two delays of >= 0.1 s either way
        assert all(a["answered_s"] - a["shown_s"] >= a["clip_seconds"] + 0.2 for a in row["answers"])
    assert ranked["person_minutes"] == pytest.approx(sum(a["answered_s"] - a["shown_s"] for a in ranked["answers"]) / 60)
    # at once: the second run started (its name's stamp) before the first one's trainer was done
    started = [int(row["run_name"].rsplit("_", 1)[1]) for row in (ranked, rated)]
    assert abs(started[0] - started[1]) < min(ranked["wall_s"], rated["wall_s"])

    # each ranking the run keeps is the order the objective gives the three stored segments
    run_dir = tmp_path / "work" / "runs" / ranked["run_name"]
    segments, labels = read_label_file(run_dir / "labels.sqlite")
    returns = segment_rewards(load_objective("windmill-counterclockwise"), segments, obs_dim=3).sum(-1)
    assert segments["obs_actions"].shape[1] == 3 and all(len(set(query)) == 3 for query in returns.tolist())  # no ties
    np.testing.assert_array_equal(labels, order_labels(np.argsort(-returns, axis=1)).astype(np.float32))
    assert json.loads((run_dir / "args.json").read_text())["clips_per_query"] == 3

    # each rating the run keeps is what the person gave in the page, and follows the objective's returns
    run_dir = tmp_path / "work" / "runs" / rated["run_name"]
    segments, labels = read_label_file(run_dir / "labels.sqlite")
    given = {a["query_id"]: a["choice"] for a in rated["answers"]}
    with sqlite3.connect(run_dir / "labels.sqlite") as db:
        logged = dict(db.execute("SELECT query_id, label FROM labels"))
    assert logged == {query: float(rating_labels(np.array([ratings]) - 1, 4)[0]) for query, ratings in given.items()}
    returns = segment_rewards(load_objective("windmill-counterclockwise"), segments, obs_dim=3).sum(-1)
    for (low, high), ratings in zip(np.argsort(returns, axis=1), [given[q] for q in sorted(given)]):
        assert ratings[high] >= ratings[low]
    assert json.loads((run_dir / "args.json").read_text())["rating_scale"] == 4


def test_a_person_who_wants_the_envs_reward_judges_by_its_returns_and_the_trainer_has_no_objective(tmp_path):
    """--objective env (Hopper's hop): the person reads each clip's env return from shown_pairs.jsonl, a pair's and a
    ranking's alike, and the trainer runs without --teacher-objective (it has none to measure agreement with)."""
    person_module = simulated_person()
    log = tmp_path / "shown_pairs.jsonl"
    lines = [
        {"query_id": 4, "left_env_return": 12.5, "right_env_return": 30.0, "left_objective_return": 1.0, "right_objective_return": 0.0},
        {"query_id": 5, "env_returns": [3.0, 9.0, 1.0], "objective_returns": [0.0, 0.0, 1.0]},
    ]
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    by_env, by_objective = person_module.ShownPairs(log, "env"), person_module.ShownPairs(log, "windmill-clockwise")
    assert by_env.lookup(4) == (12.5, 30.0) and by_env.lookup(5) == (3.0, 9.0, 1.0)
    assert by_objective.lookup(4) == (1.0, 0.0) and by_objective.lookup(5) == (0.0, 0.0, 1.0)

    args = argparse.Namespace(
        env_id="Hopper-v5", objective="env", steps=1000, explore_steps=500, pairs_per_session=3, feedback_frequency=300,
        evaluation_frequency=1000, async_poll_steps=None, preference_flags="",
    )  # fmt: skip
    flags = person_module.trainer_flags(args, 1, "run", "http://127.0.0.1:1", True, 2, 0, 6)
    assert "--teacher-objective" not in flags and flags[flags.index("--env-id") + 1] == "Hopper-v5"
    args.objective = "windmill-clockwise"
    flags = person_module.trainer_flags(args, 1, "run", "http://127.0.0.1:1", True, 2, 0, 6)
    assert flags[flags.index("--teacher-objective") + 1] == "windmill-clockwise"


def test_a_stopped_benchmark_stops_every_run_it_started(tmp_path):
    """--parallel 2, stopped with SIGTERM (as `kill` or a scheduler stops it) while both runs train: the benchmark exits
    within seconds, leaves no trainer behind, and writes no row for a run it did not finish."""
    command = [
        sys.executable, str(REPO / "bench" / "simulated_person.py"), "--seeds", "1", "--modes", "async",
        "--objective", "windmill-counterclockwise", "--steps", "20000", "--explore-steps", "500", "--labels", "30",
        "--clips-per-query", "2", "3", "--pairs-per-session", "3", "--feedback-frequency", "300",
        "--evaluation-frequency", "20000", "--answer-delay", "0.1", "0.2", f"--preference-flags={SMALL_NETWORKS}",
        "--parallel", "2", "--workdir", str(tmp_path / "work"), "--output", str(tmp_path / "out.json"),
    ]  # fmt: skip
    bench = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def trainers(names: list[str]) -> list[int]:
        """The live processes whose command line names one of the runs."""
        alive = []
        for proc in Path("/proc").iterdir():
            try:
                line = (proc / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if proc.name.isdigit() and any(name in line for name in names) and "sac_rlhf.py" in line:
                alive.append(int(proc.name))
        return alive

    try:
        deadline, names = time.monotonic() + 180, []
        while time.monotonic() < deadline and len(trainers(names)) < 2:
            time.sleep(0.5)
            names = [log.stem for log in (tmp_path / "work").glob("person_*.log")]
        assert len(trainers(names)) == 2, "both runs were to be training at once"
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) != 0
        deadline = time.monotonic() + 10
        while trainers(names) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert trainers(names) == []
        assert not (tmp_path / "out.json").exists()
    finally:
        if bench.poll() is None:
            bench.kill()
