"""Short runs of the default setting and of every preset, reduced to fingerprints: a hash of every network and buffer a
run ends with, and its summary's figures. tests/test_unchanged_runs.py compares them with the fingerprints recorded in
tests/data/unchanged_runs.json, so that moving code around the algorithm scripts provably changes no number.

    python tests/unchanged_runs.py --record     # record this code's fingerprints (do it on the code you trust)
    python tests/unchanged_runs.py              # print this code's fingerprints and whether they match the record

Floating point depends on the instructions the libraries pick at run time for the CPU they find: torch's vectorised
kernels (AVX2 or AVX-512), MKL's matrix products, oneDNN's, numpy's SIMD loops and numpy's OpenBLAS (its dot products
and norms). Every run therefore goes in a child process whose environment pins all five to AVX2 (PINNED), which every
x86-64 CPU of the last decade has, so one record holds for every such host, whichever of those instruction sets it has
beyond AVX2. Library versions change results too: the record names the versions it was made with (the locks pin
them), and a host with others is told so."""

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

RECORD = Path(__file__).resolve().parent / "data" / "unchanged_runs.json"
FRAMEWORK = Path(__file__).resolve().parents[1] / "framework"

AVX512 = "AVX512F AVX512CD AVX512_KNL AVX512_KNM AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL AVX512_SPR"
PINNED = {
    "ATEN_CPU_CAPABILITY": "avx2",  # torch's own vectorised kernels
    "MKL_CBWR": "AVX2",  # MKL's conditional numerical reproducibility: the AVX2 code path on any CPU that has it
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "NPY_DISABLE_CPU_FEATURES": AVX512,  # numpy's dispatched loops (AVX-512 versions of exp, log, sort ...)
    "OPENBLAS_CORETYPE": "Haswell",  # numpy's OpenBLAS picks its kernels by CPU model: SkylakeX on AMD's AVX-512 EPYCs
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "MUJOCO_GL": "egl",
    "WANDB_MODE": "offline",
}
"""the child's environment beside the caller's: one instruction set and one thread, whatever the host offers"""

# Steps cut to a few hundred SAC updates, two or three feedback sessions of reward fits of at most 10 epochs (a fit to
# its stopping accuracy took most of a run's time), one evaluation at the end; every other setting is the default's or
# the preset's. PrefPPO: two iterations of 1024 steps with a session after each.
QUERIES = [
    *["--teacher-feedback-total-queries", "30", "--teacher-feedback-num-queries-per-session", "10"],
    *["--reward-net-epochs", "10"],
]
ENDING = ["--evaluation-frequency", "0", "--evaluation-episodes", "1", "--checkpoint-frequency", "0", "--no-progress-bar"]
SHORT_PEBBLE = [
    *["--total-timesteps", "500", "--learning-starts", "200", "--total-explore-steps", "300"],
    *["--teacher-feedback-frequency", "100", *QUERIES, *ENDING],
]
# The dm_control presets' SAC (2 x 1024 units, batch 1024, the actor every step) costs half a second an update on one
# core: their runs learn from step 295, with sessions every 10 steps, to keep three sessions in 30 updates.
SHORT_DMC = [
    *["--total-timesteps", "325", "--learning-starts", "295", "--total-explore-steps", "300"],
    *["--teacher-feedback-frequency", "10", *QUERIES, *ENDING],
]
SHORT_PREF_PPO = [
    *["--total-timesteps", "3072", "--num-steps", "1024", "--num-minibatches", "4", "--update-epochs", "2"],
    *["--total-explore-steps", "1024", "--teacher-feedback-frequency", "1024", "--teacher-feedback-total-queries", "20"],
    *["--teacher-feedback-num-queries-per-session", "10", *ENDING],
]
BACKFLIP = ["--teacher-objective", "hopper-backflip", "--reset-agent-below-correlation", "0.9"]
RUNS = {
    "pebble-default": ("sac_rlhf", ["--env-id", "Hopper-v5", *SHORT_PEBBLE]),
    "pebble-gym-mujoco": ("sac_rlhf", ["--preset", "gym-mujoco", "--env-id", "Walker2d-v5", *SHORT_PEBBLE]),
    "pebble-dmc": ("sac_rlhf", ["--preset", "dmc", "--env-id", "dm_control/walker-walk-v0", *SHORT_DMC]),
    "pebble-dmc-qpa": ("sac_rlhf", ["--preset", "dmc-qpa", "--env-id", "dm_control/cheetah-run-v0", *SHORT_DMC]),
    "pebble-metaworld": ("sac_rlhf", ["--preset", "metaworld", "--env-id", "metaworld/door-open-v3", *SHORT_PEBBLE]),
    "pebble-backflip": ("sac_rlhf_agent_reset", ["--env-id", "Hopper-v5", *BACKFLIP, *SHORT_PEBBLE]),
    "pebble-rime": (
        "sac_rlhf_rime",
        ["--env-id", "Hopper-v5", "--rime-warm-start-steps", "20", "--teacher-eps-mistake", "0.2", *SHORT_PEBBLE],
    ),
    "pebble-smooth": ("sac_rlhf_mistake_aware", ["--env-id", "Hopper-v5", "--teacher-eps-mistake", "0.2", *SHORT_PEBBLE]),
    "prefppo-default": ("pref_ppo", ["--env-id", "Hopper-v5", *SHORT_PREF_PPO]),
    "prefppo-cartpole": ("pref_ppo", ["--env-id", "CartPole-v1", *SHORT_PREF_PPO]),
}


def cpu_flags() -> set[str]:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return set()
    line = next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def unsupported_host() -> str | None:
    """Why this host cannot run the pinned runs (None: it can): they need an x86-64 CPU with AVX2 and FMA."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the fingerprints are of x86-64 with AVX2; this host is {platform.machine()}"
    missing = {"avx2", "fma"} - cpu_flags()
    return f"the fingerprints are of AVX2; this CPU lacks {', '.join(sorted(missing))}" if missing else None


def versions() -> dict:
    """The library versions a run's numbers depend on (uv.lock and poetry.lock pin them)."""
    import mujoco
    import numpy as np
    import torch

    return {"torch": torch.__version__, "numpy": np.__version__, "mujoco": mujoco.__version__}


def digest(value) -> str:
    """A hash of a (nested) state: tensors and arrays by their bytes, the rest by their repr."""
    import numpy as np
    import torch

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


def fingerprint_here(name: str, workdir: Path) -> dict:
    """Run RUNS[name] in this process, in `workdir`, and reduce it to its fingerprint (what the child does)."""
    import importlib

    import torch

    from cleanrlhf_utils.cli import command_line_args

    torch.set_num_threads(1)
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


def fingerprint(name: str, workdir: Path) -> dict:
    """RUNS[name]'s fingerprint, run in a child process with the PINNED instruction set, in `workdir`."""
    command = [sys.executable, __file__, "--child", name, "--workdir", str(workdir)]
    done = subprocess.run(command, env=os.environ | PINNED, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def differences(recorded: dict, now: dict) -> list[str]:
    """What differs between a recorded fingerprint and one made now (empty: the same run, bit for bit)."""
    found = [f"{part} {recorded['networks'][part]} -> {now['networks'].get(part)}" for part in recorded["networks"]]
    found = [line for line, part in zip(found, recorded["networks"]) if recorded["networks"][part] != now["networks"].get(part)]
    for key, value in recorded["summary"].items():
        new = now["summary"].get(key)
        if new is None:
            found.append(f"summary lost {key}")
        elif not (value == new or (value != value and new != new)):  # NaN equals NaN here
            found.append(f"{key} {value!r} -> {new!r}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", action="store_true", help=f"write {RECORD.name}")
    parser.add_argument("--runs", nargs="*", default=list(RUNS))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        print(json.dumps(fingerprint_here(options.child, Path(options.workdir))))
        return
    reason = unsupported_host()
    if reason:
        sys.exit(f"error: {reason}")
    recorded = json.loads(RECORD.read_text()) if RECORD.is_file() else {"runs": {}}
    results = {}
    for name in options.runs:
        with tempfile.TemporaryDirectory() as workdir:
            results[name] = fingerprint(name, Path(workdir))
        changed = differences(recorded["runs"][name], results[name]) if name in recorded["runs"] else ["not recorded"]
        print(name, json.dumps(results[name]["networks"]), "same" if not changed else "; ".join(changed), flush=True)
    if options.record:
        RECORD.parent.mkdir(exist_ok=True)
        record = {"pinned": PINNED, "versions": versions(), "runs": recorded["runs"] | results}
        RECORD.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {RECORD}")


if __name__ == "__main__":
    sys.path.insert(0, str(FRAMEWORK))
    main()
