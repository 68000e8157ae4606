"""Human feedback loop latency: how soon a person gets the first playable pair, how fast pairs are
rendered, encoded and uploaded, and whether rendering stays ahead of someone who answers every few
seconds. Everything is real: a feedback server subprocess, a replay buffer of random-action
transitions with their simulator states, HumanTeacher rendering and uploading in its
background thread, and a scripted labeller that talks to the server over HTTP like the browser page.

    python bench/human_loop.py                                  # Hopper-v5 and dm_control/walker-walk-v0
    python bench/human_loop.py --env-ids Hopper-v5 --pairs 20 --answer-seconds 2
    python bench/human_loop.py --part training                  # trainer idle time, with and without --feedback-async

Per environment, a session of --pairs pairs starts at t=0 (HumanTeacher.label). The labeller polls
GET /api/next every 20 ms from t=0; once it gets a pair it downloads both clips (playable), answers
--answer-seconds after the pair became available, and asks for the next one. Reported:
  first_pair_s     t of the first pair available and both clips downloaded (target <= 2 s)
  pairs_per_s      pairs rendered + encoded + uploaded per second (HumanTeacher's upload thread)
  clips_per_s      clips rendered + encoded per second (render_clip alone, the first clip left out)
  ready10_s        t at which 10 pairs were on the server
  wait_s           time the labeller spent waiting for a pair after the first one
                   (0: rendering stayed ahead of the labeller, the second target)
The renderer is made before t=0, as sac_rlhf.py makes it at the start of a human-feedback run, and
without shadows or reflections unless --shadows (the trainer renders its clips without).

Training part (--part training or all): two real sac_rlhf.py runs in human mode on Hopper-v5 (--train-steps
steps, --train-sessions sessions of --train-pairs pairs, small networks), each with its own autostarted feedback
server, answered by a labeller thread that answers every pair --answer-seconds after getting it; once as by default
(the trainer waits for each session's answers) and once with --feedback-async. Reported per run: the trainer's idle
seconds in each session (TensorBoard feedback/trainer_idle_seconds: time the training loop spent waiting for people),
their total, the people's idle seconds as the trainer counts them (a session's last answer read until the next
session's pairs were selected) and as the labeller saw them (each wait of more than 0.1 s for a pair after an
answer), the run's wall time and the labels it got (every label given must arrive exactly once).
Baseline: --baseline-clips of the session's clips (the 2nd, 3rd, ...) again, rendered the naive way by a
fresh gym.make(env_id, render_mode="rgb_array") at 480x480 with MuJoCo's default shadow map and
encoded the same way; speedup = the baseline's time for those clips / the session's time for them.
"""

import os

os.environ.setdefault("MUJOCO_GL", "egl")  # before anything imports mujoco

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import gymnasium as gym
import numpy as np
from common import REPO, free_port, machine_info, print_table, results_path, write_json

import sac_rlhf
from cleanrlhf_utils.envs import SegmentRenderer, check_env_id, get_physics_state, segment_frames, set_physics_state, write_mp4
from cleanrlhf_utils.feedback import CHOICE_LABELS, FeedbackClient, HumanTeacher
from cleanrlhf_utils.protocol import CHOICES

SERVER = REPO / "humanFeedback" / "feedback_server.py"
POLL_SECONDS = 0.02


def start_server(port: int, data_dir: Path, log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        process = subprocess.Popen(
            [sys.executable, str(SERVER), "--port", str(port), "--data-dir", str(data_dir)], stdout=out, stderr=subprocess.STDOUT
        )
    probe = FeedbackClient(f"http://127.0.0.1:{port}", retry_seconds=0, timeout=2)
    deadline = time.monotonic() + 30
    while not probe.alive():
        if process.poll() is not None or time.monotonic() > deadline:
            stop_process(process)
            raise SystemExit(f"the feedback server did not start on port {port}; see {log}")
        time.sleep(0.1)
    return process


def stop_process(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def random_replay(env_id: str, steps: int, seed: int) -> sac_rlhf.ReplayBuffer:
    """A replay buffer of random-action transitions, each with the simulator state behind its obs."""
    env = sac_rlhf.make_env(env_id, seed)()
    try:
        obs, _ = env.reset(seed=seed)
        state_dim = sac_rlhf.physics_state_size(env)
        rb = sac_rlhf.ReplayBuffer(steps, obs.shape[0], env.action_space.shape[0], state_dim)
        episode = 0
        for _ in range(steps):
            state = get_physics_state(env)
            action = env.action_space.sample()
            next_obs, reward, terminated, truncated, _ = env.step(action)
            rb.add(obs, next_obs, action, reward, terminated, episode, state)
            obs = next_obs
            if terminated or truncated:
                episode += 1
                obs, _ = env.reset()
        return rb
    finally:
        env.close()


class ScriptedLabeller(threading.Thread):
    """A person at the page: takes the next pair, plays both clips, answers `answer_seconds` after the
    pair became available, then is ready for the next pair. Records when each pair was available and
    how long the labeller had been waiting for it."""

    def __init__(self, base: str, run_id: int, count: int, answer_seconds: float, t0: float):
        super().__init__(daemon=True)
        self.base, self.run_id, self.count, self.answer_seconds, self.t0 = base, run_id, count, answer_seconds, t0
        self.client = FeedbackClient(base, retry_seconds=10, timeout=10)
        self.records: list[dict] = []
        self.error: BaseException | None = None
        self.stop = threading.Event()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def run(self) -> None:
        try:
            ready = 0.0
            while len(self.records) < self.count and not self.stop.is_set():
                polls_waiting = 0
                while not self.stop.is_set():
                    query = self.client.request("GET", f"/api/next?annotator=bench&run_id={self.run_id}")
                    if not query.get("waiting"):
                        break
                    polls_waiting += 1
                    self.stop.wait(POLL_SECONDS)
                else:
                    return
                available = self.now()
                for side in ("left_url", "right_url"):
                    with urllib.request.urlopen(self.base + query[side], timeout=10) as response:
                        if response.read()[4:8] != b"ftyp":
                            raise RuntimeError(f"{query[side]} is not an mp4")
                playable = self.now()
                choice = CHOICES[len(self.records) % len(CHOICES)]
                self.stop.wait(max(0.0, available + self.answer_seconds - self.now()))
                self.client.request("POST", f"/api/queries/{query['query_id']}/label", json_body={"choice": choice, "annotator": "bench"})
                answered = self.now()
                self.records.append(
                    {
                        "query_id": query["query_id"],
                        "ready": ready,
                        "available": available,
                        "playable": playable,
                        "answered": answered,
                        # Only time spent polling an empty queue counts as waiting, not one request's latency.
                        "wait": available - ready if polls_waiting else 0.0,
                        "choice": choice,
                    }
                )
                ready = answered
        except BaseException as error:  # reported by the main thread
            self.error = error


def instrument(teacher: HumanTeacher, t0_box: list) -> tuple[list, list]:
    """Wraps the teacher's render_clip and its client's upload_queries to record when each ran."""
    clips, uploads, render_seconds = [], [], []
    render_clip, upload_queries, render_states = teacher.render_clip, teacher.client.upload_queries, teacher.renderer.render_states

    def timed_render_states(states):
        start = time.perf_counter()
        frames = render_states(states)
        render_seconds.append(time.perf_counter() - start)
        return frames

    def timed_render_clip(name, states, mask):
        start = time.perf_counter()
        path = render_clip(name, states, mask)
        end = time.perf_counter()
        clips.append({"start": start - t0_box[0], "end": end - t0_box[0], "render": render_seconds[-1], "frames": int(mask.sum())})
        return path

    def timed_upload_queries(run_id, queries, files):
        start = time.perf_counter()
        ids = upload_queries(run_id, queries, files)
        uploads.append({"start": start - t0_box[0], "end": time.perf_counter() - t0_box[0]})
        return ids

    teacher.renderer.render_states = timed_render_states
    teacher.render_clip = timed_render_clip
    teacher.client.upload_queries = timed_upload_queries
    return clips, uploads


class NaiveRenderer:
    """The naive way: gym.make with rgb_array at its default 480x480, MuJoCo's default shadow map."""

    def __init__(self, env_id: str):
        check_env_id(env_id)
        kwargs = {"render_kwargs": {"width": 480, "height": 480, "camera_id": 0}} if env_id.startswith("dm_control/") else {}
        self.env = gym.make(env_id, render_mode="rgb_array", **kwargs)
        self.env.reset(seed=0)

    def render_states(self, states: np.ndarray) -> np.ndarray:
        frames = []
        for state in states:
            set_physics_state(self.env, state)
            frames.append(self.env.render())
        return np.stack(frames)

    def close(self) -> None:
        self.env.close()


def baseline(env_id: str, segments: dict, clip_numbers: list[int], fps: int, clip_dir: Path) -> dict:
    """Renders and encodes clips `clip_numbers` (clip n = pair n // 2, side n % 2) the naive way."""
    start = time.perf_counter()
    renderer = NaiveRenderer(env_id)
    renderer.render_states(segments["physics_states"][0, 0, :1])  # makes the GL context, untimed like the warm clips
    setup = time.perf_counter() - start
    try:
        durations, frame_shape = [], None
        for n in clip_numbers:
            start = time.perf_counter()
            frames = segment_frames(renderer, segments["physics_states"][n // 2, n % 2], segments["masks"][n // 2, n % 2])
            write_mp4(clip_dir / f"naive_{n}.mp4", frames, fps)
            durations.append(time.perf_counter() - start)
            frame_shape = frames.shape[1:3]
    finally:
        renderer.close()
    return {
        "setup_s": setup,
        "clip_numbers": clip_numbers,
        "clip_seconds": durations,
        "clips_per_s": len(durations) / sum(durations),
        "frame": f"{frame_shape[1]}x{frame_shape[0]}",
    }


def run_env(env_id: str, args: argparse.Namespace, workdir: Path) -> dict:
    rb = random_replay(env_id, args.replay_steps, args.seed)
    rng = np.random.default_rng(args.seed)
    idx, mask = rb.sample_segment_pairs(args.pairs, args.segment_length, rng)
    segments = rb.gather_segments(idx, mask)
    episodes = int(rb.episode_ids[: rb.size].max()) + 1

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = start_server(port, workdir / "feedback_data", workdir / "feedback_server.log")
    renderer = labeller = None
    try:
        client = FeedbackClient(base, retry_seconds=30)
        run_id = client.create_run(f"human_loop_{env_id.replace('/', '_')}", env_id, {"segment_length": args.segment_length})
        start = time.perf_counter()
        renderer = SegmentRenderer(env_id, args.width, args.height, shadows=args.shadows)
        renderer_setup = time.perf_counter() - start
        teacher = HumanTeacher(client, run_id, renderer, workdir / "clips", args.fps, poll_seconds=args.poll_seconds)
        t0_box = [0.0]
        clips, uploads = instrument(teacher, t0_box)

        t0_box[0] = time.perf_counter()
        labeller = ScriptedLabeller(base, run_id, args.pairs, args.answer_seconds, t0_box[0])
        labeller.start()  # the same moment as the session
        labels, _ = teacher.label(segments, 1)
        session = time.perf_counter() - t0_box[0]
        labeller.join(timeout=args.answer_seconds + 30)
        if labeller.error is not None:
            raise labeller.error
        expected = [CHOICE_LABELS[r["choice"]] for r in sorted(labeller.records, key=lambda r: r["query_id"])]
        np.testing.assert_array_equal(labels, np.array(expected, dtype=np.float32))  # the session got what was given
    finally:
        if labeller is not None:
            labeller.stop.set()
        try:
            if renderer is not None:
                renderer.close()
        finally:
            stop_process(server)

    records = labeller.records
    durations = [c["end"] - c["start"] for c in clips]
    warm = durations[1:] or durations  # the first clip also makes the renderer's GL context
    ready10 = uploads[9]["end"] if len(uploads) >= 10 else None
    # The naive way on the same warm clips (not the first), so the speedup compares identical work.
    numbers = list(range(1, len(clips)))[: args.baseline_clips] or [0]
    base_result = baseline(env_id, segments, numbers, args.fps, workdir / "naive_clips")
    same_clips = sum(durations[n] for n in numbers)
    wait = sum(r["wait"] for r in records[1:])
    return {
        "env_id": env_id,
        "frame": f"{args.width}x{args.height}",
        "segment_length": args.segment_length,
        "mean_valid_frames": float(mask.sum(-1).mean()),
        "replay_episodes": episodes,
        "renderer_setup_s": renderer_setup,
        "first_available_s": records[0]["available"],
        "first_pair_s": records[0]["playable"],
        "pairs_per_s": len(uploads) / (uploads[-1]["end"] - clips[0]["start"]),
        "first_clip_s": durations[0],
        "render_seconds_per_frame": sum(c["render"] for c in clips[1:] or clips) / sum(c["frames"] for c in clips[1:] or clips),
        "encode_seconds_per_clip": sum(c["end"] - c["start"] - c["render"] for c in clips[1:] or clips) / len(clips[1:] or clips),
        "clips_per_s": len(warm) / sum(warm),
        "ready10_s": ready10,
        "wait_s": wait,
        "session_s": session,
        "baseline_clips_per_s": base_result["clips_per_s"],
        "speedup": sum(base_result["clip_seconds"]) / same_clips,
        "first_pair_within_2s": records[0]["playable"] <= 2.0,
        "rendering_ahead": wait == 0.0,
        "baseline": base_result,
        "pairs": records,
        "clips": clips,
        "uploads": uploads,
    }


class PatientLabeller(threading.Thread):
    """Answers any pair of any run on the server `answer_seconds` after it got it (left/right/tie/skip by query id).
    Records how long it waited for a pair after each answer: the people's idle time as a person sees it (between
    sessions: the trainer's reading of the answers, its update, the selection and the first clip, or the schedule)."""

    def __init__(self, base: str, answer_seconds: float):
        super().__init__(daemon=True)
        self.base, self.answer_seconds = base, answer_seconds
        self.client = FeedbackClient(base, retry_seconds=0, timeout=10)
        self.given: dict[int, str] = {}
        self.posts, self.stop = 0, threading.Event()
        self.answered_at, self.waits = None, []

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                query = self.client.request("GET", "/api/next?annotator=bench", retry=False)
            except Exception:  # noqa: BLE001 (the trainer has not started its server yet, or has stopped it)
                self.stop.wait(0.2)
                continue
            if query.get("waiting"):
                self.stop.wait(POLL_SECONDS)
                continue
            if self.answered_at is not None:  # (session of the pair it waited for, seconds)
                self.waits.append((query["session"], time.perf_counter() - self.answered_at))
            if self.stop.wait(self.answer_seconds):
                return
            choice = CHOICES[query["query_id"] % len(CHOICES)]
            self.client.request("POST", f"/api/queries/{query['query_id']}/label", json_body={"choice": choice, "annotator": "bench"})
            self.given[query["query_id"]] = choice
            self.posts += 1
            self.answered_at = time.perf_counter()


def run_training(asynchronous: bool, args: argparse.Namespace, workdir: Path) -> dict:
    """One human-mode sac_rlhf.py run answered by a PatientLabeller; its idle seconds per session."""
    from common import read_summary, start_script
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    name = "async" if asynchronous else "sync"
    base = f"http://127.0.0.1:{free_port()}"
    explore = args.train_steps // (args.train_sessions + 1)
    flags = ["--env-id", "Hopper-v5", "--run-name", name, "--seed", str(args.seed), "--total-timesteps", str(args.train_steps)]
    flags += [
        "--learning-starts",
        str(min(1000, explore)),
        "--total-explore-steps",
        str(explore),
        "--teacher-feedback-frequency",
        str(explore),
    ]
    flags += ["--teacher-feedback-mode", "human", "--feedback-server-url", base, "--feedback-server-autostart"]
    flags += ["--teacher-feedback-total-queries", str(args.train_pairs * args.train_sessions)]
    flags += ["--teacher-feedback-num-queries-per-session", str(args.train_pairs), "--teacher-feedback-schedule", "linear"]
    flags += [
        "--segment-length",
        str(args.segment_length),
        "--feedback-check-clips",
        "0",
    ]
    flags += ["--actor-hidden-dim", "64", "--critic-hidden-dim", "64", "--reward-net-hidden-dim", "64", "--batch-size", "64"]
    flags += ["--evaluation-frequency", "0", "--checkpoint-frequency", "0", "--explore-knn-sample-size", "500"]
    flags += ["--feedback-async"] if asynchronous else []
    labeller = PatientLabeller(base, args.answer_seconds)
    labeller.start()
    start = time.perf_counter()
    try:
        process = start_script("sac_rlhf.py", flags, workdir, log=workdir / f"{name}.log")
        if process.wait() != 0:
            raise SystemExit(f"the {name} run failed; see {workdir / f'{name}.log'}")
    finally:
        labeller.stop.set()
    wall = time.perf_counter() - start
    summary = read_summary(workdir, name)
    events = EventAccumulator(str(workdir / "runs" / name))
    events.Reload()
    per_session = [(e.step, e.value) for e in events.Scalars("feedback/trainer_idle_seconds")]
    expected = sum(c != "skip" for c in labeller.given.values())
    return {
        "mode": "--feedback-async" if asynchronous else "sync (default)",
        "sessions": summary["feedback_sessions"],
        "trainer_idle_per_session_s": [round(v, 2) for _, v in per_session],
        "update_steps": [s for s, _ in per_session],
        "trainer_idle_s": summary["trainer_idle_seconds"],
        "people_idle_s": summary["people_idle_seconds"],
        # the gaps, not one request's latency: "s2: 4.1" = waited 4.1 s for a pair of session 2
        "labeller_waits_s": [f"s{session}: {wait:.2f}" for session, wait in labeller.waits if wait > 0.1],
        "wall_s": wall,
        "labels_given": labeller.posts,
        "labels_obtained": summary["labels_obtained"] + summary["queries_skipped"],
        "exactly_once": labeller.posts == len(labeller.given) and summary["labels_obtained"] == expected,
    }


def training_part(args: argparse.Namespace, tmp: Path) -> list[dict]:
    rows = []
    for asynchronous in (False, True):
        print(f"training run {'with' if asynchronous else 'without'} --feedback-async ({args.train_steps} steps)", flush=True)
        rows.append(run_training(asynchronous, args, tmp / ("async" if asynchronous else "sync")))
    columns = ["mode", "sessions", "trainer_idle_per_session_s", "trainer_idle_s", "people_idle_s", "labeller_waits_s", "wall_s"]
    print_table(rows, [*columns, "labels_obtained"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["render", "training", "all"], default="all")
    parser.add_argument("--train-steps", type=int, default=4500, help="training part: environment steps of each run")
    parser.add_argument("--train-sessions", type=int, default=2, help="training part: feedback sessions of each run")
    parser.add_argument("--train-pairs", type=int, default=5, help="training part: pairs per session")
    parser.add_argument(
        "--training-output", type=Path, default=results_path("human_loop", "human-loop", "training"), help="training part's results"
    )
    parser.add_argument("--env-ids", nargs="+", default=["Hopper-v5", "dm_control/walker-walk-v0"])
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--segment-length", type=int, default=50)
    parser.add_argument("--answer-seconds", type=float, default=3.0, help="the labeller answers this long after a pair is available")
    parser.add_argument("--shadows", action="store_true", help="render shadows and reflections (the trainer's clips have none)")
    parser.add_argument("--width", type=int, default=320)
    parser.add_argument("--height", type=int, default=240)
    parser.add_argument("--fps", type=int, default=30, help="clip frame rate (sac_rlhf's --clip-fps default)")
    parser.add_argument("--poll-seconds", type=float, default=0.25, help="HumanTeacher's answer polling interval")
    parser.add_argument("--replay-steps", type=int, default=2000, help="random-action transitions in the replay buffer")
    parser.add_argument("--baseline-clips", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--output", type=Path, default=results_path("human_loop", "human-loop", "rendering"))
    args = parser.parse_args()
    if args.pairs < 1 or args.segment_length < 1 or args.replay_steps < args.segment_length:
        parser.error("--pairs and --segment-length must be >= 1 and --replay-steps >= --segment-length")

    load_before = list(os.getloadavg())
    results = []
    with tempfile.TemporaryDirectory(prefix="human_loop_") as tmp:
        if args.part != "render":
            training = training_part(args, Path(tmp))
            machine = machine_info() | {"load_average_before": load_before, "load_average_after": list(os.getloadavg())}
            write_json(
                args.training_output,
                {
                    "benchmark": "human_loop training",
                    "machine": machine,
                    "settings": vars(args) | {"output": str(args.output), "training_output": str(args.training_output)},
                    "results": training,
                },
            )
            if args.part == "training":
                return
        for n, env_id in enumerate(args.env_ids):
            print(f"{env_id}: {args.pairs} pairs of {args.segment_length}-step clips at {args.width}x{args.height}", flush=True)
            results.append(run_env(env_id, args, Path(tmp) / str(n)))
            r = results[-1]
            print(f"{env_id}: first pair playable at {r['first_pair_s']:.2f} s, labeller waited {r['wait_s']:.2f} s", flush=True)

    columns = ["env_id", "frame", "segment_length", "mean_valid_frames", "first_pair_s", "pairs_per_s", "clips_per_s", "ready10_s"]
    columns += ["wait_s", "baseline_clips_per_s", "speedup"]
    print_table(results, columns)
    print_table(results, ["env_id", "renderer_setup_s", "first_clip_s", "render_seconds_per_frame", "encode_seconds_per_clip", "session_s"])
    print(f"targets: first pair playable <= 2 s; rendering ahead of a labeller answering every {args.answer_seconds:g} s (wait_s == 0)")
    for r in results:
        print(
            f"  {r['env_id']}: first pair {'met' if r['first_pair_within_2s'] else 'MISSED'}, ahead {'met' if r['rendering_ahead'] else 'MISSED'}"
        )
    write_json(
        args.output,
        {
            "benchmark": "human_loop",
            "machine": machine_info()
            | {"load_average_before": load_before, "load_average_after": list(os.getloadavg()), "mujoco_gl": os.environ.get("MUJOCO_GL")},
            "settings": vars(args) | {"output": str(args.output)},
            "results": json.loads(json.dumps(results, default=float)),
        },
    )


if __name__ == "__main__":
    main()
