# The README's gallery: a short GIF of each shipped policy (policies/*.pt), from one deterministic episode on the env,
# objective and settings its manifest entry records, filmed from the entry's camera. The README's captions come from
# the same entries (python dev/gen_docs.py).
#
#   python toolbox/gallery.py && python dev/gen_docs.py                   # every policy, then the README
#   python toolbox/gallery.py --names windmill-clockwise-pebble --seconds 2
#
# The same seed gives the same GIF, byte for byte, on the same machine.
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import evaluation
from cleanrlhf_utils.cli import cli
from cleanrlhf_utils.envs import SegmentRenderer, write_gif
from cleanrlhf_utils.errors import need
from cleanrlhf_utils.evaluate import evaluate_episodes
from cleanrlhf_utils.objectives import load_objective
from cleanrlhf_utils.policies import GALLERY, gallery_gif, read_manifest
from cleanrlhf_utils.training import set_torch_threads

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Args:
    names: tuple[str, ...] = ()
    """the shipped policies to film, by file name (with or without .pt; default: every one the manifest lists)"""
    policies: str = str(REPO / "policies")
    """the folder of the shipped policies and their manifest.json"""
    out_dir: str = str(REPO / GALLERY)
    """where <name>.gif goes"""
    seed: int | None = None
    """the filmed episode's seed (default: each entry's film_seed, 0 where it records none)"""
    start: float = 0.0
    """seconds into the episode where the GIF starts"""
    seconds: float = 3.0
    """how long the GIF lasts, in the env's time (less where the episode ends sooner)"""
    fps: float = 20.0
    """the GIF's frames per second: every n-th step is kept, n the env's frame rate over this (rounded, at least 1)"""
    width: int = 240
    """frame width in pixels"""
    height: int = 180
    """frame height in pixels"""
    colors: int = 48
    """the GIF's palette, shared by all its frames (2 to 256): fewer colours, a smaller file (48 keeps the Hopper,
    tracked, with the floor passing under it, below the README's 400 kB a GIF)"""


def episode_states(policy_file: Path, entry: dict, seed: int) -> list[np.ndarray]:
    """The simulator state before each step of one deterministic episode of the shipped policy, on the env, objective
    (its own end of an episode) and termination settings its entry records."""
    actor, _ = evaluation.load_shipped_policy(policy_file)
    states: list[np.ndarray] = []
    evaluate_episodes(
        actor,
        entry["env_id"],
        1,
        seed,
        torch.device("cpu"),
        terminate_when_unhealthy=entry["terminate_when_unhealthy"],
        task_seed=entry["seed"],
        objective=load_objective(entry["objective"]) if entry["objective"] else None,
        terminate_when_tilted=entry["terminate_when_tilted"],
        first_states=states,
    )
    return states


def film(policy_file: Path, entry: dict, gif: Path, args: Args) -> int:
    """Writes the policy's GIF: the episode's states from --start for --seconds, every n-th re-rendered from the entry's
    camera. Returns the number of frames."""
    states = episode_states(policy_file, entry, entry.get("film_seed", 0) if args.seed is None else args.seed)
    renderer = SegmentRenderer(entry["env_id"], args.width, args.height, camera=entry["camera"])
    try:
        step = max(1, round(renderer.fps / args.fps))
        first, stop = round(args.start * renderer.fps), round((args.start + args.seconds) * renderer.fps)
        ends = len(states) / renderer.fps
        need(first < len(states), f"--start {args.start}: {policy_file.name}'s episode ends at {ends:.2f} s")
        frames = renderer.render_states(np.asarray(states[first:stop:step]))
    finally:
        renderer.close()
    write_gif(gif, frames, 1000 * step / renderer.fps, colors=args.colors)
    return len(frames)


def main(args: Args) -> list[Path]:
    need(args.seconds > 0 and args.fps > 0, f"--seconds {args.seconds} and --fps {args.fps} must be > 0")
    need(args.start >= 0, f"--start {args.start} must be >= 0")
    need(args.width >= 16 and args.height >= 16, f"--width {args.width} and --height {args.height} must be >= 16")
    need(2 <= args.colors <= 256, f"--colors {args.colors} must be between 2 and 256")
    manifest = read_manifest(args.policies)
    files = [name if name.endswith(".pt") else f"{name}.pt" for name in args.names] or list(manifest)
    allowed = ", ".join(Path(name).stem for name in manifest)
    for name in files:
        need(name in manifest, f"--names {Path(name).stem}: not a shipped policy; allowed: {allowed}")
        need((Path(args.policies) / name).is_file(), f"--names {Path(name).stem}: {Path(args.policies) / name} is missing")
    set_torch_threads(1)
    written = []
    for name in files:
        gif = Path(args.out_dir) / Path(gallery_gif(name)).name
        frames = film(Path(args.policies) / name, manifest[name], gif, args)
        print(f"{gif}: {frames} frames of {args.width}x{args.height}, {gif.stat().st_size // 1024} kB")
        written.append(gif)
    return written


if __name__ == "__main__":
    cli(Args, main)
