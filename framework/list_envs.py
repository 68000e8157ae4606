# Which environments work: builds every Gymnasium MuJoCo v5 id, every DeepMind Control Suite task
# (through shimmy) and every Meta-World task (metaworld/<task>), steps it, stores a short segment's simulator states, checks that restoring a state
# replays the transition exactly and that the segment re-renders to the same frames, and writes
# docs/reference/working-envs.md with pass/fail and the reason. Nothing in that list is maintained by hand:
#   python framework/list_envs.py                      # all of them (a few minutes)
#   python framework/list_envs.py --only walker Hopper # ids containing one of these
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import gymnasium as gym
import numpy as np

os.environ.setdefault("MUJOCO_GL", "egl")
FRAMEWORK_DIR = Path(__file__).resolve().parent
# The list is a page of the docs site (its environment reference), written here and nowhere else.
WORKING_ENVS_PAGE = FRAMEWORK_DIR.parent / "docs" / "reference" / "working-envs.md"


@dataclass
class Args:
    output: str = str(WORKING_ENVS_PAGE)
    """the Markdown table to write (by default the docs site's page, docs/reference/working-envs.md)"""
    only: list[str] = field(default_factory=list)
    """check only the ids containing one of these strings (default: every candidate)"""
    segment_length: int = 25
    """steps of the stored segment that is replayed and re-rendered"""
    width: int = 96
    """width of the re-rendered frames (small: the check is about identity, not looks)"""
    height: int = 96
    """height of the re-rendered frames"""
    jobs: int = 2
    """environments checked at once, each in its own process (a crash or hang fails one row, not the list)"""
    timeout: float = 300.0
    """seconds one environment may take before it is marked failed"""
    check_one: str | None = None
    """internal: check this id in this process and print the result as JSON"""


def candidate_env_ids() -> list[str]:
    """Every Gymnasium MuJoCo v5 id, every dm_control task shimmy registers and every Meta-World v3 task. A Gymnasium
    id names its own class (Ant-v5: gymnasium.envs.mujoco.ant_v5:AntEnv); a variant another module registered on one
    of those classes in this process (a benchmark's, say) is not one."""
    import shimmy

    from cleanrlhf_utils.envs import metaworld_env_ids

    def gymnasium_mujoco(name: str, entry_point: str) -> bool:
        module, _, env_class = entry_point.rpartition(":")
        return module.startswith("gymnasium.envs.mujoco.") and f"{env_class.removesuffix('Env')}-v5" == name

    gym.register_envs(shimmy)
    mujoco_ids = sorted(name for name, spec in gym.registry.items() if gymnasium_mujoco(name, str(spec.entry_point)))
    dmc_ids = sorted(name for name in gym.registry if name.startswith("dm_control/") and name != "dm_control/compatibility-env-v0")
    return mujoco_ids + dmc_ids + metaworld_env_ids()


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:200]


def joined(reasons: list[str]) -> str:
    """The reasons as one cell; when both scripts refuse an env for the same reason, it is said once."""
    if len(reasons) == 2 and reasons[0].split(": ", 1)[1] == reasons[1].split(": ", 1)[1]:
        reasons = [reasons[0].split(": ", 1)[1]]
    return "; ".join(reasons)


def check_env(env_id: str, segment_length: int = 25, width: int = 96, height: int = 96) -> dict:
    """Build, step, store and restore states, re-render: what both algorithm scripts need from an environment."""
    import pref_ppo
    import sac_rlhf
    from cleanrlhf_utils.envs import SegmentRenderer, get_physics_state, set_physics_state

    row = {"env_id": env_id, "sac_rlhf": "fail", "pref_ppo": "fail", "replay": "-", "render": "-", "obs_dim": "-", "action_dim": "-"}
    start = time.time()
    built, reasons = {}, []
    for name, script in (("sac_rlhf", sac_rlhf), ("pref_ppo", pref_ppo)):
        try:
            script.make_env(env_id, 0)().close()
            built[name] = script
        except Exception as error:
            reasons.append(f"{name}.py: {first_line(error)}")
    if not built:
        return row | {"reason": joined(reasons), "seconds": round(time.time() - start, 1)}
    script = next(iter(built.values()))  # the segment checks run through sac_rlhf.py's code where it takes the env
    env = script.make_env(env_id, 0)()
    try:
        row["obs_dim"], row["action_dim"] = int(np.prod(env.observation_space.shape)), int(np.prod(env.action_space.shape or (1,)))
        obs, _ = env.reset(seed=0)
        if obs.ndim != 1 or obs.shape != env.observation_space.shape:
            raise ValueError(f"observation shape {obs.shape} is not the flat {env.observation_space.shape}")
        states, actions, next_obs = [], [], []
        for _ in range(segment_length):
            action = env.action_space.sample()
            states.append(get_physics_state(env))
            obs, _, terminated, truncated, _ = env.step(action)
            actions.append(action)
            next_obs.append(obs)
            if terminated or truncated:
                break
        states = np.stack(states)
        # Restoring a stored state and repeating its action must reproduce the next observation: the state is complete.
        # "close": contact forces can differ in the last digits when the solver restarts from a restored state.
        mismatches, inexact = 0, 0
        for t in reversed(range(len(states))):  # reversed: nothing may leak from the previous restore
            set_physics_state(env, states[t])
            replayed, *_ = env.step(actions[t])
            inexact += not np.array_equal(replayed, next_obs[t])
            mismatches += not np.allclose(replayed, next_obs[t], rtol=1e-5, atol=1e-8)
        row["replay"] = f"{mismatches}/{len(states)} differ" if mismatches else ("close" if inexact else "exact")
    except Exception as error:
        return row | {"reason": "; ".join([*reasons, first_line(error)]), "seconds": round(time.time() - start, 1)}
    finally:
        env.close()
    try:  # the renderer human feedback uses; a second one, fed the states in reverse, must draw the same frames
        frames, again = [], []
        for order, out in ((1, frames), (-1, again)):
            renderer = SegmentRenderer(env_id, width, height, shadows=False)
            try:
                out.append(renderer.render_states(states[::order])[::order])
            finally:
                renderer.close()
        frames, again = frames[0], again[0]
        blank = frames.reshape(len(frames), -1).std(axis=1).min() == 0
        row["render"] = "identical" if np.array_equal(frames, again) and not blank else ("blank" if blank else "differs")
    except Exception as error:
        row["render"] = "error"
        reasons.append(f"rendering: {first_line(error)}")
    if row["render"] != "identical":
        reasons.append(f"re-rendered segment: {row['render']}")
    elif mismatches:
        # Clips still show what happened, but a restored state does not determine the next step.
        reasons.append("a restored state does not reproduce the next step, so resuming is not exact; clips re-render consistently")
    status = "fail" if row["render"] != "identical" else ("partial" if mismatches else "pass")
    for name in built:
        row[name] = status
    row["reason"] = joined(reasons)
    row["seconds"] = round(time.time() - start, 1)
    return row


def check_in_subprocess(env_id: str, args: Args) -> dict:
    command = [sys.executable, __file__, "--check-one", env_id, "--segment-length", str(args.segment_length)]
    command += ["--width", str(args.width), "--height", str(args.height)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired:
        return {"env_id": env_id, "sac_rlhf": "fail", "pref_ppo": "fail", "reason": f"timed out after {args.timeout:.0f} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    crash = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1][:200]
    return {"env_id": env_id, "sac_rlhf": "fail", "pref_ppo": "fail", "reason": f"crashed: {crash}"}


def write_markdown(rows: list[dict], path: str | Path, settings: dict) -> None:
    import mujoco

    passed = sum(row["sac_rlhf"] == "pass" for row in rows)
    lines = [
        "# Working environments",
        "",
        "Generated by `python framework/list_envs.py`; do not edit by hand. Each id is built by both scripts, stepped",
        f"with random actions for a {settings['segment_length']}-step segment whose simulator states are stored; restoring each state and",
        "repeating its action must reproduce the next observation (`replay`: exact, or close to 1e-5), and the segment re-rendered by",
        "the human-feedback renderer, once forwards and once backwards in a fresh renderer, must give identical, non-blank",
        "frames (`render`). `pass`: all of it holds; `partial`: clips re-render consistently but a restored state does not determine the",
        "next step; `fail`: the reason says why. `pref_ppo.py` also takes unbounded actions.",
        "",
        f"{passed} of {len(rows)} pass for sac_rlhf.py. Generated {time.strftime('%Y-%m-%d')} on {platform.machine()} with "
        f"Python {platform.python_version()}, gymnasium {gym.__version__}, mujoco {mujoco.__version__}, "
        f"MUJOCO_GL={os.environ.get('MUJOCO_GL')}.",
        "",
        "| env id | obs dim | action dim | sac_rlhf.py | pref_ppo.py | replay | render | reason |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        cells = [f"`{row['env_id']}`", row.get("obs_dim", "-"), row.get("action_dim", "-"), row["sac_rlhf"], row["pref_ppo"]]
        cells += [row.get("replay", "-"), row.get("render", "-"), str(row.get("reason", "")).replace("|", "/")]
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    Path(path).write_text("\n".join(lines) + "\n")


def read_markdown(path: str | Path) -> dict[str, dict]:
    """The rows of a working-envs page (as write_markdown writes it), by env id."""
    rows = {}
    for line in Path(path).read_text().splitlines():
        if line.startswith("| `"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            keys = ["env_id", "obs_dim", "action_dim", "sac_rlhf", "pref_ppo", "replay", "render", "reason"]
            row = dict(zip(keys, cells, strict=True))
            row["env_id"] = row["env_id"].strip("`")
            rows[row["env_id"]] = row
    return rows


def main(args: Args) -> list[dict]:
    env_ids = [env_id for env_id in candidate_env_ids() if not args.only or any(part in env_id for part in args.only)]
    if not env_ids:
        raise SystemExit(f"error: --only {' '.join(args.only)} matches none of the {len(candidate_env_ids())} candidate ids")
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        rows = []
        for row in pool.map(lambda env_id: check_in_subprocess(env_id, args), env_ids):
            print(f"{row['env_id']:55s} sac_rlhf {row['sac_rlhf']:4s}  pref_ppo {row['pref_ppo']:4s}  {row.get('reason', '')}", flush=True)
            rows.append(row)
    write_markdown(rows, args.output, {"segment_length": args.segment_length})
    print(f"wrote {args.output}: {sum(row['sac_rlhf'] == 'pass' for row in rows)} of {len(rows)} pass for sac_rlhf.py")
    return rows


if __name__ == "__main__":
    from cleanrlhf_utils.arguments import parse_args  # tyro, its parse errors as one line

    cli_args = parse_args(Args)
    if cli_args.check_one:
        print(json.dumps(check_env(cli_args.check_one, cli_args.segment_length, cli_args.width, cli_args.height)))
    else:
        main(cli_args)
