# Ship a trained SAC policy: the actor's weights from a run's checkpoint (sac.py or sac_rlhf.py) to policies/<name>.pt,
# with an entry in policies/manifest.json that says what it is (env, objective, the settings that rebuild the actor and
# the env, how it was trained) and what it measured: evaluation.py's result over --episodes episodes, on this machine.
#
#   python toolbox/export_policy.py models/<run>/latest --name hopper-landed-backflip-sac \
#       --setting "SAC on the objective as its reward (sac.py --reward-objective)" --commit abc1234 \
#       --behaviour "Hopper attempting a landed backflip" --taught-by objective-ceiling
#   python framework/evaluation.py --policy policies/hopper-landed-backflip-sac.pt --episodes 10 --video
#
# The weights alone (a few hundred kB) are enough to watch and measure a policy; to continue training, keep the run's
# checkpoint instead.
import hashlib
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import torch
import tyro

import evaluation
from cleanrlhf_utils.arguments import parse_args
from cleanrlhf_utils.checkpoints import checkpoint_file, load_checkpoint
from cleanrlhf_utils.envs import CAMERAS
from cleanrlhf_utils.errors import ConfigError, need
from cleanrlhf_utils.policies import MANIFEST, check_caption
from cleanrlhf_utils.tracking import machine

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Args:
    checkpoint: Annotated[str, tyro.conf.Positional]
    """a run's checkpoint.pt, or the folder holding it (models/<run>/latest)"""
    name: str
    """the shipped file's name, without .pt (letters, digits, - and _)"""
    setting: str
    """how it was trained, in a few words (e.g. "SAC on the objective as its reward (sac.py --reward-objective)")"""
    behaviour: str
    """what it does, as the README gallery's title says it (a few words, e.g. "Windmill turning clockwise")"""
    taught_by: str
    """who taught it, for the gallery's caption: synthetic-teacher, simulated-person, person (from --labels labels),
    objective-ceiling (SAC on the objective as its reward) or true-reward (SAC on the env's reward)"""
    command: str = ""
    """the command that trained it"""
    labels: int = 0
    """labels the run learned from (0: trained on a reward)"""
    commit: str = ""
    """the commit of the code that trained it (default: this checkout's HEAD)"""
    episodes: int = 10
    """evaluation episodes to measure and record (seeds --seed, --seed + 1, ...)"""
    check_episodes: int = 2
    """how many of them tests/test_policies.py runs again to check the record"""
    seed: int = 0
    """the first evaluation episode's seed"""
    camera: str = "side"
    """the view evaluation.py --video uses for it (env, side)"""
    film_seed: int | None = None
    """the episode the README gallery films (toolbox/gallery.py; default: --seed, the first one measured)"""
    out_dir: str = str(REPO / "policies")
    """where the .pt and manifest.json go"""


def entry_for(checkpoint: dict, args: Args) -> dict:
    """The manifest entry of a SAC checkpoint: what rebuilds its actor and env, and how it was trained."""
    need(checkpoint.get("algorithm") not in ("pref_ppo", "ppo"), "only SAC actors (sac.py, sac_rlhf.py) are shipped")
    trained = checkpoint["args"]
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    return {
        "env_id": trained["env_id"],
        "objective": trained.get("teacher_objective") or trained.get("reward_objective") or "",
        "actor_hidden_dim": trained["actor_hidden_dim"],
        "actor_hidden_layers": trained["actor_hidden_layers"],
        "terminate_when_unhealthy": trained["terminate_when_unhealthy"],
        "terminate_when_tilted": trained["terminate_when_tilted"],
        "camera": args.camera,
        "film_seed": args.seed if args.film_seed is None else args.film_seed,
        "setting": args.setting,
        "behaviour": args.behaviour,
        "taught_by": args.taught_by,
        "command": args.command,
        "seed": trained["seed"],
        "labels": args.labels,
        "steps": checkpoint["loop"]["global_step"],
        "commit": commit,
    }


def main(args: Args) -> dict:
    need(args.name.replace("-", "").replace("_", "").isalnum(), f"--name {args.name}: letters, digits, - and _ only")
    need(args.camera in CAMERAS, f"--camera {args.camera} is not one of: {', '.join(CAMERAS)}")
    need(1 <= args.check_episodes <= args.episodes, "--check-episodes must be between 1 and --episodes")
    check_caption(args.behaviour, args.taught_by, args.labels, flags=True)
    checkpoint = load_checkpoint(checkpoint_file(args.checkpoint, "checkpoint"))
    entry = entry_for(checkpoint, args)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    policy, manifest_path = out_dir / f"{args.name}.pt", out_dir / MANIFEST
    torch.save(checkpoint["agent"]["actor"], policy)
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    manifest[policy.name] = entry | {"sha256": hashlib.sha256(policy.read_bytes()).hexdigest()}
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")  # the entry the evaluation below reads
    result = evaluation.main(evaluation.Args(policy=str(policy), episodes=args.episodes, seed=args.seed))
    manifest[policy.name]["measure"] = {"seed": args.seed, "check_episodes": args.check_episodes, "machine": machine()} | result
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"{policy} ({policy.stat().st_size // 1024} kB) and its entry in {manifest_path}")
    return manifest[policy.name]


if __name__ == "__main__":
    try:
        main(parse_args(Args))
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
