"""Short runs of the default setting and of every preset, reduced to fingerprints: a hash of every network and buffer a
run ends with, and its summary's figures. tests/test_unchanged_runs.py compares them with the fingerprints recorded in
tests/data/unchanged_runs.json, so that moving code around the algorithm scripts provably changes no number.

    python tests/unchanged_runs.py --record     # record this code's fingerprints (do it on the code you trust)

Floating-point results depend on the CPU's instruction set and the library versions, so the recorded file names the
machine it was recorded on; the test compares bit for bit where it runs on such a machine."""

import argparse
import hashlib
import json
import os
import platform
import sys
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("WANDB_MODE", "offline")

import numpy as np  # noqa: E402
import torch  # noqa: E402

RECORD = Path(__file__).resolve().parent / "data" / "unchanged_runs.json"

# Steps cut to a few hundred SAC updates, two or three feedback sessions, one evaluation at the end; every other
# setting is the default's or the preset's. PrefPPO: two iterations of 1024 steps with a session after each.
SHORT_PEBBLE = [
    "--total-timesteps", "700", "--learning-starts", "100", "--total-explore-steps", "300", "--teacher-feedback-frequency", "200",
    "--teacher-feedback-total-queries", "30", "--teacher-feedback-num-queries-per-session", "10", "--evaluation-frequency", "0",
    "--evaluation-episodes", "1", "--checkpoint-frequency", "0", "--no-progress-bar",
]  # fmt: skip
# The dm_control presets' SAC (2 x 1024 units, batch 1024, the actor every step) costs half a second an update on one
# core: their runs learn from step 280, with sessions every 50 steps, to keep three sessions in 140 updates.
SHORT_DMC = [
    "--total-timesteps", "420", "--learning-starts", "280", "--total-explore-steps", "300", "--teacher-feedback-frequency", "50",
    "--teacher-feedback-total-queries", "30", "--teacher-feedback-num-queries-per-session", "10", "--evaluation-frequency", "0",
    "--evaluation-episodes", "1", "--checkpoint-frequency", "0", "--no-progress-bar",
]  # fmt: skip
SHORT_PREF_PPO = [
    "--total-timesteps", "3072", "--num-steps", "1024", "--num-minibatches", "4", "--update-epochs", "2",
    "--total-explore-steps", "1024", "--teacher-feedback-frequency", "1024", "--teacher-feedback-total-queries", "20",
    "--teacher-feedback-num-queries-per-session", "10", "--evaluation-frequency", "0", "--evaluation-episodes", "1",
    "--checkpoint-frequency", "0", "--no-progress-bar",
]  # fmt: skip
RUNS = {
    "pebble-default": ("sac_rlhf", ["--env-id", "Hopper-v5", *SHORT_PEBBLE]),
    "pebble-gym-mujoco": ("sac_rlhf", ["--preset", "gym-mujoco", "--env-id", "Walker2d-v5", *SHORT_PEBBLE]),
    "pebble-dmc": ("sac_rlhf", ["--preset", "dmc", "--env-id", "dm_control/walker-walk-v0", *SHORT_DMC]),
    "pebble-dmc-qpa": ("sac_rlhf", ["--preset", "dmc-qpa", "--env-id", "dm_control/cheetah-run-v0", *SHORT_DMC]),
    "pebble-metaworld": ("sac_rlhf", ["--preset", "metaworld", "--env-id", "metaworld/door-open-v3", *SHORT_PEBBLE]),
    "pebble-backflip": (
        "sac_rlhf",
        ["--env-id", "Hopper-v5", "--teacher-objective", "hopper-backflip", "--reset-agent-below-correlation", "0.9", *SHORT_PEBBLE],
    ),
    "pebble-rime": (
        "sac_rlhf_rime",
        ["--env-id", "Hopper-v5", "--rime-warm-start-steps", "20", "--teacher-eps-mistake", "0.2", *SHORT_PEBBLE],
    ),
    "pebble-smooth": ("sac_rlhf_mistake_aware", ["--env-id", "Hopper-v5", "--teacher-eps-mistake", "0.2", *SHORT_PEBBLE]),
    "prefppo-default": ("pref_ppo", ["--env-id", "Hopper-v5", *SHORT_PREF_PPO]),
    "prefppo-cartpole": ("pref_ppo", ["--env-id", "CartPole-v1", *SHORT_PREF_PPO]),
}


def machine() -> dict:
    """What a CPU run's floating-point results depend on."""
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in line), "")
    import mujoco

    return {
        "cpu": model or platform.processor(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "mujoco": mujoco.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def digest(value) -> str:
    """A hash of a (nested) state: tensors and arrays by their bytes, the rest by their repr."""
    h = hashlib.sha256()

    def feed(item) -> None:
        if isinstance(item, dict):
            for key in sorted(item, key=str):
                h.update(str(key).encode())
                feed(item[key])
        elif isinstance(item, list | tuple):
            for element in item:
                feed(element)
        elif isinstance(item, torch.Tensor):
            h.update(item.detach().cpu().contiguous().numpy().tobytes())
        elif isinstance(item, np.ndarray):
            h.update(np.ascontiguousarray(item).tobytes())
        else:
            h.update(repr(item).encode())

    feed(value)
    return h.hexdigest()[:16]


def fingerprint(name: str, workdir: Path) -> dict:
    """Run RUNS[name] in `workdir` and reduce it to its fingerprint."""
    import importlib

    from cleanrlhf_utils.cli import command_line_args

    script, argv = RUNS[name]
    module = importlib.import_module(script)
    args = replace(command_line_args(module.Args, argv), run_name=name, seed=1)
    previous = Path.cwd()
    os.chdir(workdir)
    try:
        summary = module.main(args)
        saved = torch.load(Path("models") / name / "latest" / "checkpoint.pt", map_location="cpu", weights_only=False)
    finally:
        os.chdir(previous)
    networks = {part: digest(saved[part]) for part in ("agent", "reward_model", "preference_buffer") if part in saved}
    figures = {
        key: value for key, value in summary.items() if isinstance(value, int | float) and "seconds" not in key and "sps" not in key.lower()
    }
    return {"networks": networks, "summary": {key: float(value) for key, value in sorted(figures.items())}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", action="store_true", help=f"write {RECORD.name}")
    parser.add_argument("--runs", nargs="*", default=list(RUNS))
    options = parser.parse_args()
    import tempfile

    torch.set_num_threads(1)
    results = {}
    for name in options.runs:
        with tempfile.TemporaryDirectory() as workdir:
            results[name] = fingerprint(name, Path(workdir))
        print(name, json.dumps(results[name]["networks"]), flush=True)
    if options.record:
        RECORD.parent.mkdir(exist_ok=True)
        earlier = json.loads(RECORD.read_text())["runs"] if RECORD.is_file() else {}
        RECORD.write_text(json.dumps({"machine": machine(), "runs": earlier | results}, indent=1) + "\n")
        print(f"wrote {RECORD}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "framework"))
    main()
