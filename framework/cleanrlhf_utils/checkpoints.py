"""Checkpoints: the flags that save and resume them, writing them so a kill mid-write loses nothing, and reading a
run's whole training state back (networks, optimisers, buffers, RNGs) for a bit-exact resume."""

import os
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from .errors import need, unreadable


@dataclass
class ResumeArgs:
    """Periodic checkpoints and an exact resume from them (sac_rlhf.py, pref_ppo.py and the SAC baseline sac.py)."""

    help_group: ClassVar[str] = "checkpoint"

    checkpoint_frequency: int = 100_000
    """environment steps between checkpoints to models/<run>/latest (PrefPPO: checked after each iteration; 0: only
    at the end)"""
    resume: str | None = None
    """continue a run from a checkpoint folder (models/<run>/latest)"""


@dataclass
class CheckpointArgs(ResumeArgs):
    """Checkpoints of the preference-learning scripts: ResumeArgs' and a reusable end of exploration."""

    help_group: ClassVar[str] = "checkpoint"

    exploration_from: str | None = None
    """skip exploration: start from the agent and replay buffer another run saved when its exploration ended
    (models/<run>/<explore_steps>)"""


def validate_resume_args(args: ResumeArgs) -> None:
    """--checkpoint-frequency and --resume."""
    need(args.checkpoint_frequency >= 0, f"--checkpoint-frequency must be >= 0, got {args.checkpoint_frequency}")
    if args.resume is not None:
        need((Path(args.resume) / "checkpoint.pt").is_file(), f"--resume {args.resume}: no checkpoint.pt in that folder")


def validate_checkpoint_args(args: CheckpointArgs) -> None:
    """--checkpoint-frequency, --resume and --exploration-from of the preference-learning scripts."""
    validate_resume_args(args)
    if args.exploration_from is not None:
        folder = checkpoint_file(args.exploration_from, "--exploration-from").parent
        need(
            (folder / "replay_buffer.npz").is_file(),
            f"--exploration-from {args.exploration_from}: no replay_buffer.npz beside its checkpoint",
        )


def save_checkpoint(folder: Path, state: dict, rb=None) -> None:
    """checkpoint.pt (networks, optimisers, buffers of labels, RNGs, counters) + replay_buffer.npz, each
    written to a temporary name first so that a kill mid-write leaves the previous checkpoint intact."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "checkpoint.pt.tmp"
    torch.save(state, tmp)
    if rb is not None:
        rb.save(folder / "replay_buffer.npz")
    os.replace(tmp, folder / "checkpoint.pt")


def checkpoint_file(path: str | Path, flag: str = "--path-to-model") -> Path:
    """A checkpoint given to `flag` as its checkpoint.pt or the folder holding it (models/<run>/latest); one line
    naming the flag when there is none."""
    file = Path(path) / "checkpoint.pt" if Path(path).is_dir() else Path(path)
    need(file.is_file(), f"{flag} {path}: no checkpoint there (give models/<run>/latest or its checkpoint.pt)")
    return file


def load_checkpoint(path: str | Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError, zipfile.BadZipFile) as error:
        raise unreadable(Path(path), error) from None


def load_optimizer(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """An optimizer's saved state, stepped with this run's kernel: a checkpoint's own settings (an older checkpoint's,
    or one from a run with other --compile/--cudagraphs) would replace it, or clash with it."""
    kernel = [{key: group[key] for key in ("foreach", "fused", "capturable")} for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, settings in zip(optimizer.param_groups, kernel):
        group.update(settings)
        if settings["fused"] or settings["capturable"]:  # these kernels keep the step count beside the parameter
            for param in group["params"]:
                param_state = optimizer.state.get(param, {})
                if "step" in param_state:
                    param_state["step"] = param_state["step"].to(device=param.device, dtype=torch.float32)


def rng_states(rng: np.random.Generator) -> dict:
    """The run's RNGs: numpy's, torch's, and the GPU's where the run used one (the policy's action noise is drawn
    there: without it a resumed GPU run draws other actions than the run that never stopped)."""
    states = {"rng": rng.bit_generator.state, "torch_rng": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda_rng"] = torch.cuda.get_rng_state()
    return states


def training_state(parts: dict, rng: np.random.Generator) -> dict:
    """What a checkpoint carries besides the replay buffer and the env: each part's state_dict() (networks,
    optimisers, buffers, normalisers, teacher) and the RNGs."""
    return {name: part.state_dict() for name, part in parts.items()} | rng_states(rng)


OPTIONAL_PARTS = ("reward_training", "after_session")
"""parts that only some runs checkpoint (a variant's state: RIME's reward training, the agent resets of
sac_rlhf_agent_reset.py): a run starting from another run's exploration checkpoint (--exploration-from), which had
none, starts them fresh"""


def load_training_state(parts: dict, rng: np.random.Generator, state: dict) -> None:
    for name, part in parts.items():
        if name == "session" and name not in state:  # a checkpoint from before sessions were saved: none was open
            continue
        if name in OPTIONAL_PARTS and name not in state:  # e.g. a RIME run starting from a PEBBLE run's exploration
            continue
        part.load_state_dict(state[name])
    rng.bit_generator.state = state["rng"]
    torch.set_rng_state(state["torch_rng"])
    if "cuda_rng" in state and torch.cuda.is_available():  # a GPU run's checkpoint; resumed on a CPU it is not needed
        torch.cuda.set_rng_state(state["cuda_rng"])


def earlier_wall_seconds(resume_state: dict | None) -> float:
    """The training seconds a run spent before the checkpoint it resumes from (0: a fresh run, or a checkpoint from
    before checkpoints kept them)."""
    return float(resume_state.get("wall_seconds", 0.0)) if resume_state else 0.0
