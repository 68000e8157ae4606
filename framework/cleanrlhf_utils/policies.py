"""Shipped policies (policies/<name>.pt): the manifest beside them that says what each is, who taught it (TAUGHT_BY),
and the README gallery's GIF and caption of each. Light on purpose (no torch): dev/gen_docs.py reads it."""

import json
from pathlib import Path

from .errors import ConfigError, need

MANIFEST = "manifest.json"
"""the file beside shipped policies that describes each (policies/manifest.json): file name -> entry"""

TAUGHT_BY = {
    "synthetic-teacher": "preferences of the synthetic teacher",
    "simulated-person": "preferences of a simulated person on the feedback page",
    "person": "preferences of a person on the feedback page",
    "objective-ceiling": "SAC on the objective (the ceiling), not preferences",
    "true-reward": "SAC on the env's own reward (the baseline), not preferences",
}
"""who taught a shipped policy (its entry's `taught_by`) -> how the gallery's caption says it"""

FROM_PREFERENCES = {"synthetic-teacher", "simulated-person", "person"}
"""the TAUGHT_BY values whose policies learned from labels (the others from a reward, with 0 labels)"""

GALLERY = "docs/gallery"
"""where the gallery's GIFs go, relative to the repository: <GALLERY>/<policy name>.gif"""


def check_caption(behaviour: str, taught_by: str, labels: int, flags: bool = False) -> None:
    """What a manifest entry needs for its gallery caption: a short title, a TAUGHT_BY value, labels that fit it. The
    one-line errors name the entry's keys, or with `flags` the flags of toolbox/export_policy.py that set them."""
    name = {key: f"--{key.replace('_', '-')}" if flags else key for key in ("behaviour", "taught_by", "labels")}
    need(0 < len(behaviour.strip()) <= 60, f"{name['behaviour']} {behaviour!r}: a short title, 1 to 60 characters")
    need(taught_by in TAUGHT_BY, f"{name['taught_by']} {taught_by!r} is not one of: {', '.join(TAUGHT_BY)}")
    if taught_by in FROM_PREFERENCES:
        need(labels > 0, f"{name['labels']} {labels}: a policy taught by {taught_by} learned from at least 1 label")
    else:
        need(labels == 0, f"{name['labels']} {labels}: a policy taught by {taught_by} learned from no labels (0)")


def caption(entry: dict) -> str:
    """How the entry's policy was taught, with its label count: `preferences of the synthetic teacher, 44 labels`."""
    taught = TAUGHT_BY[entry["taught_by"]]
    return f"{taught}, {entry['labels']} labels" if entry["taught_by"] in FROM_PREFERENCES else taught


def read_manifest(folder: str | Path) -> dict[str, dict]:
    """The manifest of the policies in `folder` (file name -> entry), every entry checked for its caption."""
    path = Path(folder) / MANIFEST
    need(path.is_file(), f"{path}: no such file (it lists the shipped policies)")
    manifest = json.loads(path.read_text())
    for name, entry in manifest.items():
        try:
            check_caption(entry.get("behaviour", ""), entry.get("taught_by", ""), entry["labels"])
        except ConfigError as error:
            raise ConfigError(f"{path}: {name}: {error}") from None
    return manifest


def gallery_gif(name: str) -> str:
    """The gallery GIF of the policy file `name` (x.pt -> docs/gallery/x.gif), relative to the repository."""
    return f"{GALLERY}/{Path(name).stem}.gif"
