# Label stores: list, merge, export and import the labels people gave, and how far two people agree.
#
#   python toolbox/labels.py list runs/                          # every runs/*/labels.sqlite; or a server's data dir
#   python toolbox/labels.py agreement runs/a runs/b             # Cohen's kappa on pairs labelled by two people
#   python toolbox/labels.py merge runs/a runs/b --out merged.sqlite
#   python toolbox/labels.py export runs/a --format npz --out labels.npz
#   python toolbox/labels.py export runs/a --format uni-rlhf --out uni/ --obs-dim 11 --env-id Hopper-v5
#   python toolbox/labels.py export runs/a --format imitation --out prefs.pkl --obs-dim 11
#   python toolbox/labels.py import labels.npz --out labels.sqlite   (or a uni-rlhf folder written by export)
#   python toolbox/labels.py check runs/<run>                   # does the run keep each label as its server has it?
#
# A label store is a run's runs/<run>/labels.sqlite (framework/cleanrlhf_utils/feedback.py's LabelLog: one row per
# label with the pair's arrays) or a feedback server's database (<data-dir>/feedback.sqlite3: labels of queries,
# with the trainer's segment ids and clip names but no arrays). A label is 0.0 (the first segment preferred, the
# left clip), 1.0 (the second, right) or 0.5 (tie); skips are not labels. merge and import write LabelLog's format,
# which --teacher-feedback-mode file --feedback-file reads. A ranking of k clips (--clips-per-query k) or the ratings of
# a query's clips (--rating-scale) are read as the k (k - 1) / 2 pairs of its clips they decide, in the order shown
# (clip i before clip j): 1.0 where clip j is ranked or rated above clip i, 0.0 below, 0.5 for two clips rated alike;
# so every command, and every export format, takes them as pairs.
#
# A pair is recognised across stores by the bytes of its two segments (obs_actions and mask of each; on a server: run
# name and segment id), in either order: for agreement, a pair shown the other way round has its label flipped into
# the order it was first met in.
#
# NPZ (--format npz, "cleanrlhf-labels-v1"), N labels of pairs of L steps:
#   obs_actions (N, 2, L, D) float32   observation then action at each step, as the reward model reads them
#   masks (N, 2, L) bool               False after the segment's episode ended
#   true_rewards (N, 2, L) float32     the environment's reward (what a synthetic teacher would have judged)
#   physics_states (N, 2, L, S) float64  simulator states, to re-render the clips
#   labels (N,) float32                0 first preferred, 1 second, 0.5 tie
#   annotators, sources (N,) str       who labelled, and the store it came from
#   sessions, global_steps (N,) int64  the session and the run's step when it was recorded
#   format () str                      "cleanrlhf-labels-v1"
# From a server's database (no arrays): labels, annotators, sources, sessions, plus runs (N,) str, segment_ids (N, 2)
# int64 and clips (N, 2) str.
import argparse
import hashlib
import itertools
import json
import pickle
import sqlite3
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cleanrlhf_utils.feedback import CHOICE_LABELS as FEEDBACK_CHOICE_LABELS
from cleanrlhf_utils.feedback import LabelLog, answer_label, query_pair_labels, reorder_label
from cleanrlhf_utils.protocol import RANKED, RATED
from cleanrlhf_utils.rankings import clip_pairs

ARRAYS = LabelLog.ARRAYS  # obs_actions, masks, true_rewards, physics_states
NPZ_FORMAT = "cleanrlhf-labels-v1"
CHOICE_LABELS = {choice: label for choice, label in FEEDBACK_CHOICE_LABELS.items() if choice != "skip"}  # skips are not labels
NAMES = {label: choice for choice, label in CHOICE_LABELS.items()}


class LabelsError(Exception):
    """A bad argument or store: one line naming the value and what is allowed."""


@dataclass
class Label:
    source: str
    annotator: str
    label: float
    session: object
    global_step: int = 0
    segments: tuple = ()  # identity of each of the two segments (hashes, or run:segment id)
    arrays: dict | None = None  # name -> (2, L, ...) array, for label logs
    extra: dict = field(default_factory=dict)  # server: run, segment_ids, clips


# --------------------------------------------------------------------------------------------- reading stores


def find_stores(paths: list[str]) -> list[Path]:
    stores = []
    for text in paths:
        path = Path(text)
        if path.is_file():
            stores.append(path)
        elif (path / "labels.sqlite").is_file():
            stores.append(path / "labels.sqlite")
        elif (path / "feedback.sqlite3").is_file():
            stores.append(path / "feedback.sqlite3")
        elif path.is_dir() and sorted(path.glob("*/labels.sqlite")):
            stores.extend(sorted(path.glob("*/labels.sqlite")))
        else:
            raise LabelsError(
                f"{text} is not a label store; give a labels.sqlite, a run folder holding one, a folder of run folders, "
                "or a feedback server's data dir (feedback.sqlite3)"
            )
    return stores


def segment_hash(obs_actions: np.ndarray, mask: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(obs_actions).tobytes() + np.ascontiguousarray(mask).tobytes()).hexdigest()


def read_store(path: Path) -> tuple[str, list[Label], int]:
    """(kind, labels in the order they were obtained, skips); kind is "label log" or "server"."""
    try:
        db = sqlite3.connect(f"file:{path.resolve()}?mode=ro", uri=True)
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.DatabaseError as error:
        raise LabelsError(f"{path} is not an SQLite label store ({error})") from None
    try:
        if "queries" in tables and "labels" in tables:
            return "server", *read_server(db, str(path))
        if "labels" in tables:
            return "label log", read_label_log(db, str(path)), 0
        raise LabelsError(f"{path} holds no labels table; give a runs/<run>/labels.sqlite or a server's feedback.sqlite3")
    finally:
        db.close()


def columns_or_null(db: sqlite3.Connection, table: str, alias: str, names: tuple[str, ...]) -> str:
    """The SELECT list of `names` in `table` (as `alias`.name), NULL for each one a database of an older version lacks
    (before rankings, ratings or reorders of the check)."""
    present = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
    return ", ".join(f"{alias}.{name}" if name in present else "NULL" for name in names)


def decided_pairs(label: float, clips: int, rating_scale: int) -> list[tuple[int, int, float]]:
    """The pairs of a query's clips (i, j) its label decides, with each one's label: a pair's own label; a ranking's
    or ratings' pairs (query_pair_labels)."""
    values = query_pair_labels(np.array([label], dtype=np.float32), clips, rating_scale).reshape(-1)
    return [(int(i), int(j), float(value)) for i, j, value in zip(*clip_pairs(clips), values)]


def read_label_log(db: sqlite3.Connection, source: str) -> list[Label]:
    columns = [row[1] for row in db.execute("PRAGMA table_info(labels)")]
    scale = "rating_scale" if "rating_scale" in columns else "0"  # a log from before ratings holds none
    rows = db.execute(
        "SELECT global_step, session, label, annotator, obs_actions, masks, true_rewards, physics_states, shapes, "
        f"{scale} FROM labels ORDER BY id"
    )
    labels = []
    for step, session, label, annotator, *blobs, shapes, rating_scale in rows:
        shapes = json.loads(shapes)
        arrays = {name: np.frombuffer(blob, dtype=shapes[name][1]).reshape(shapes[name][0]) for name, blob in zip(ARRAYS, blobs)}
        hashes = [segment_hash(arrays["obs_actions"][k], arrays["masks"][k]) for k in range(arrays["masks"].shape[0])]
        for i, j, value in decided_pairs(label, len(hashes), rating_scale or 0):
            pair_arrays = {name: values[[i, j]] for name, values in arrays.items()}
            labels.append(Label(source, annotator or "", value, session, int(step or 0), (hashes[i], hashes[j]), pair_arrays))
    return labels


def read_server(db: sqlite3.Connection, source: str) -> tuple[list[Label], int]:
    scale, answers = columns_or_null(db, "queries", "q", ("rating_scale",)), columns_or_null(db, "labels", "l", ("ranking", "ratings"))
    rows = db.execute(
        "SELECT r.name, q.id, q.session, q.left_segment_id, q.right_segment_id, q.left_clip, q.right_clip, l.choice, l.annotator, "
        f"{scale}, {answers} FROM labels l JOIN queries q ON q.id = l.query_id JOIN runs r ON r.id = q.run_id ORDER BY l.id"
    ).fetchall()
    labels, skips = [], 0
    for run, query_id, session, left, right, left_clip, right_clip, choice, annotator, rating_scale, ranking, ratings in rows:
        if choice == "skip":
            skips += 1
            continue
        if choice in (RANKED, RATED):  # every clip of the query, in the order shown; its answer as the pairs it decides
            shown = db.execute("SELECT clip, segment_id FROM query_clips WHERE query_id = ? ORDER BY position", (query_id,)).fetchall()
            answer = {"choice": choice, "ranking": json.loads(ranking or "null"), "ratings": json.loads(ratings or "null")}
            decided = decided_pairs(answer_label(answer, rating_scale or 0), len(shown), rating_scale or 0)
        else:
            shown, decided = [(left_clip, left), (right_clip, right)], [(0, 1, CHOICE_LABELS[choice])]
        for i, j, value in decided:
            (clip_i, segment_i), (clip_j, segment_j) = shown[i], shown[j]
            extra = {"run": run, "segment_ids": (segment_i, segment_j), "clips": (clip_i, clip_j)}
            segments = (f"{run}:{segment_i}", f"{run}:{segment_j}")
            labels.append(Label(source, annotator, value, session, 0, segments, None, extra))
    return labels, skips


def read_all(paths: list[str]) -> list[Label]:
    return [label for store in find_stores(paths) for label in read_store(store)[1]]


# --------------------------------------------------------------------------------------------- agreement


def cohen_kappa(first: list[float], second: list[float]) -> float:
    """Cohen's kappa of two people's labels of the same pairs (categories: first, second, tie): (p_o - p_e) / (1 - p_e),
    p_o the fraction of pairs they agree on, p_e the agreement expected from each one's own frequencies; nan when
    p_e is 1 (both gave one and the same answer throughout: agreement beyond chance is undefined)."""
    a, b = np.asarray(first), np.asarray(second)
    if len(a) == 0:
        return float("nan")
    observed = float(np.mean(a == b))
    expected = sum(float(np.mean(a == c)) * float(np.mean(b == c)) for c in (0.0, 0.5, 1.0))
    return float("nan") if expected >= 1.0 else (observed - expected) / (1.0 - expected)


def agreement(labels: list[Label]) -> list[dict]:
    """Per pair of annotators: the pairs both labelled, how many they agree on, and Cohen's kappa, with every pair in
    the order it was first shown (in the order of the stores given). A person's later label of a pair replaces their
    earlier one."""
    by_person: dict[str, dict] = {}
    shown: dict[frozenset, tuple] = {}  # each pair in the order it was first met: labels of it the other way round flip
    for label in labels:
        pair = frozenset(label.segments)
        order = shown.setdefault(pair, label.segments)
        by_person.setdefault(label.annotator, {})[pair] = label.label if order == label.segments else 1.0 - label.label
    people = sorted(by_person)
    rows = []
    for i, a in enumerate(people):
        for b in people[i + 1 :]:
            common = sorted(set(by_person[a]) & set(by_person[b]))
            if not common:
                continue
            x, y = [by_person[a][p] for p in common], [by_person[b][p] for p in common]
            agree = int(sum(u == v for u, v in zip(x, y)))
            rows.append({"annotators": (a, b), "pairs": len(common), "agree": agree, "kappa": cohen_kappa(x, y)})
    return rows


def summary(path: Path) -> dict:
    kind, labels, skips = read_store(path)
    people: dict[str, dict] = {}
    for label in labels:
        counts = people.setdefault(label.annotator, {"labels": 0, "left": 0, "right": 0, "tie": 0})
        counts["labels"] += 1
        counts[NAMES[label.label]] += 1
    sessions = sorted({str(label.session) for label in labels})
    return {"store": str(path), "kind": kind, "labels": len(labels), "skips": skips, "sessions": sessions, "annotators": people}


# --------------------------------------------------------------------------------------------- writing label logs


def stack(labels: list[Label]) -> dict:
    if any(label.arrays is None for label in labels):
        sources = sorted({label.source for label in labels if label.arrays is None})
        raise LabelsError(
            f"{sources[0]} is a server database: it has segment ids and clips but not the segments' arrays; "
            "merge, import and the uni-rlhf/imitation exports need label logs (runs/<run>/labels.sqlite)"
        )
    arrays = {}
    for name in ARRAYS:
        shapes = {label.arrays[name].shape for label in labels}
        if len(shapes) > 1:
            raise LabelsError(
                f"{name} has shapes {sorted(shapes)} across the stores; only pairs of one shape (one env, one segment length) go together"
            )
        arrays[name] = np.stack([label.arrays[name] for label in labels]) if labels else np.zeros((0,))
    return arrays


def write_label_log(labels: list[Label], out: Path) -> int:
    """Appends labels to a LabelLog file (created if missing), one row per pair and annotator: a label already there
    (same pair, same person) is not written again. Returns the rows written."""
    log = LabelLog(out)  # the file and its schema, as a run creates them
    db = log.db
    columns = [row[1] for row in db.execute("PRAGMA table_info(labels)")]
    keyed = "pair_key" in columns
    rows = db.execute("SELECT annotator, obs_actions, masks FROM labels")
    present = {(annotator or "", hashlib.sha256(obs_actions + masks).hexdigest()) for annotator, obs_actions, masks in rows}
    written = 0
    with db:
        for label in labels:
            arrays = {name: np.ascontiguousarray(label.arrays[name]) for name in ARRAYS}
            blobs = [a.tobytes() for a in arrays.values()]
            identity = (label.annotator, hashlib.sha256(blobs[0] + blobs[1]).hexdigest())
            if identity in present:
                continue
            present.add(identity)
            shapes = json.dumps({name: [list(a.shape), str(a.dtype)] for name, a in arrays.items()})
            values = [label.global_step, label.session, label.label, label.annotator, *blobs, shapes]
            names = "global_step, session, label, annotator, obs_actions, masks, true_rewards, physics_states, shapes"
            if keyed:  # LabelLog's key of a label (session and segments), made unique per annotator past the first
                key = f"{label.session}:{identity[1]}"
                taken = db.execute("SELECT 1 FROM labels WHERE pair_key = ?", (key,)).fetchone()
                values.append(key if taken is None else f"{key}|{label.annotator}")
                names += ", pair_key"
            db.execute(f"INSERT INTO labels ({names}) VALUES ({', '.join('?' * len(values))})", values)
            written += 1
    log.close()
    return written


# --------------------------------------------------------------------------------------------- export / import


def export_npz(labels: list[Label], out: Path) -> None:
    meta = {
        "labels": np.array([label.label for label in labels], dtype=np.float32),
        "annotators": np.array([label.annotator for label in labels], dtype=str),
        "sources": np.array([label.source for label in labels], dtype=str),
        "sessions": np.array([str(label.session) for label in labels], dtype=str),
        "format": np.array(NPZ_FORMAT),
    }
    if labels and labels[0].arrays is None and all(label.arrays is None for label in labels):
        meta |= {
            "runs": np.array([label.extra["run"] for label in labels], dtype=str),
            "segment_ids": np.array([[str(s) for s in label.extra["segment_ids"]] for label in labels], dtype=str),
            "clips": np.array([label.extra["clips"] for label in labels], dtype=str),
        }
        np.savez_compressed(out, **meta)
        return
    meta["sessions"] = np.array([int(label.session) for label in labels], dtype=np.int64)
    meta["global_steps"] = np.array([label.global_step for label in labels], dtype=np.int64)
    np.savez_compressed(out, **stack(labels), **meta)


def read_npz(path: Path) -> list[Label]:
    with np.load(path, allow_pickle=False) as data:
        if "format" not in data or str(data["format"]) != NPZ_FORMAT:
            raise LabelsError(f"{path} is not a {NPZ_FORMAT} NPZ (written by toolbox/labels.py export --format npz)")
        if "obs_actions" not in data:
            raise LabelsError(f"{path} holds a server's labels without segment arrays; a label log needs the arrays")
        arrays = {name: data[name] for name in ARRAYS}
        fields = (data["labels"], data["annotators"], data["sessions"], data["global_steps"])
        return [
            Label(str(path), str(a), float(value), int(s), int(step), (), {name: arrays[name][i] for name in ARRAYS})
            for i, (value, a, s, step) in enumerate(zip(*fields))
        ]


def split_obs_actions(labels: list[Label], obs_dim: int | None) -> int:
    width = labels[0].arrays["obs_actions"].shape[-1] if labels else 0
    if obs_dim is None or not 0 < obs_dim < width:
        raise LabelsError(
            f"--obs-dim {obs_dim} is not allowed; give the environment's observation size, from 1 to {width - 1} (obs_actions has {width} columns)"
        )
    return obs_dim


def uni_rlhf_names(env_id: str, domain: str, count: int, length: int) -> dict:
    suffix = f"domain_{domain}_env_{env_id}_num_{count}_len_{length}"
    return {"labels": f"human_label_{suffix}", "indices_1": f"indices_1_{suffix}", "indices_2": f"indices_2_{suffix}"}


def export_uni_rlhf(labels: list[Label], out: Path, obs_dim: int | None, env_id: str, domain: str) -> None:
    """Uni-RLHF's (Clean-Offline-RLHF) label files: three pickles named by domain, env, count and length (sorted, they
    are the labels, indices_1, indices_2) in <out>/<env>_human_labels/, and dataset.npz, the D4RL-style dataset the
    indices point into: the pairs' segments laid end to end (pair i's first segment starts at 2*i*L, its second at
    (2*i+1)*L). Labels: 0 first segment better, 1 second, -1 equally good (Preference Transformer's convention)."""
    arrays = stack(labels)
    split_obs_actions(labels, obs_dim)
    count, length = arrays["masks"].shape[0], arrays["masks"].shape[-1]
    folder = out / f"{env_id}_human_labels"
    folder.mkdir(parents=True, exist_ok=True)
    flat = {name: a.reshape(count * 2 * length, *a.shape[3:]) for name, a in arrays.items()}
    np.savez_compressed(
        folder / "dataset.npz",
        observations=flat["obs_actions"][:, :obs_dim],
        actions=flat["obs_actions"][:, obs_dim:],
        rewards=flat["true_rewards"],
        terminals=np.zeros(count * 2 * length, dtype=bool),
        masks=flat["masks"],
        physics_states=flat["physics_states"],
        annotators=np.array([label.annotator for label in labels], dtype=str),
        sessions=np.array([int(label.session) for label in labels], dtype=np.int64),
        global_steps=np.array([label.global_step for label in labels], dtype=np.int64),
    )
    values = np.array([{0.0: 0, 1.0: 1, 0.5: -1}[label.label] for label in labels], dtype=np.int64)
    starts = np.arange(count, dtype=np.int64) * 2 * length
    names = uni_rlhf_names(env_id, domain, count, length)
    for key, value in (("labels", values), ("indices_1", starts), ("indices_2", starts + length)):
        with open(folder / names[key], "wb") as f:
            pickle.dump(value, f)


def read_uni_rlhf(folder: Path) -> list[Label]:
    if not (folder / "dataset.npz").is_file():
        raise LabelsError(f"{folder} has no dataset.npz; import reads the Uni-RLHF folders this tool exports (their indices point into it)")
    files = sorted(p.name for p in folder.iterdir() if p.name.startswith(("human_label_", "indices_1_", "indices_2_")))
    if len(files) != 3:
        raise LabelsError(f"{folder} should hold one human_label_*, indices_1_* and indices_2_* pickle, found {files}")
    loaded = []
    for name in files:  # sorted: labels, indices_1, indices_2
        with open(folder / name, "rb") as f:
            loaded.append(np.asarray(pickle.load(f)))  # noqa: S301 (files this tool wrote; never open others' pickles)
    values, first, second = loaded
    with np.load(folder / "dataset.npz", allow_pickle=False) as data:
        length = int(second[0] - first[0]) if len(first) else 0
        obs_actions = np.concatenate([data["observations"], data["actions"]], axis=-1)
        labels = []
        for i, value in enumerate(values):
            rows = [np.arange(start, start + length) for start in (first[i], second[i])]
            arrays = {
                "obs_actions": np.stack([obs_actions[r] for r in rows]),
                "masks": np.stack([data["masks"][r] for r in rows]),
                "true_rewards": np.stack([data["rewards"][r] for r in rows]),
                "physics_states": np.stack([data["physics_states"][r] for r in rows]),
            }
            label = {0: 0.0, 1: 1.0, -1: 0.5}[int(value)]
            session, step = int(data["sessions"][i]), int(data["global_steps"][i])
            labels.append(Label(str(folder), str(data["annotators"][i]), label, session, step, (), arrays))
    return labels


def export_imitation(labels: list[Label], out: Path, obs_dim: int | None) -> None:
    """imitation's PreferenceDataset (imitation.algorithms.preference_comparisons), saved with its own save(): pairs of
    TrajectoryWithRew fragments (obs: the L observations and the last one again, as the next observation is not
    stored; acts; rews: the true rewards) and preferences, the probability that the first fragment is preferred
    (1 - label). Written with imitation's own classes, which only exist where imitation is installed: this project
    does not depend on it (it pulls in stable-baselines3 and its own gymnasium pins)."""
    try:
        from imitation.algorithms.preference_comparisons import PreferenceDataset
        from imitation.data.types import TrajectoryWithRew
    except ImportError:
        raise LabelsError(
            "--format imitation needs the imitation package (pip install imitation), which this project does not depend on; "
            "or export --format npz and build a PreferenceDataset from it where imitation is installed"
        ) from None
    arrays = stack(labels)
    split_obs_actions(labels, obs_dim)
    pairs = []
    for i in range(len(labels)):
        fragments = []
        for k in range(2):
            valid = int(arrays["masks"][i, k].sum())
            obs = arrays["obs_actions"][i, k, :valid, :obs_dim]
            fragments.append(
                TrajectoryWithRew(
                    obs=np.concatenate([obs, obs[-1:]]),
                    acts=arrays["obs_actions"][i, k, :valid, obs_dim:],
                    infos=None,
                    terminal=valid < arrays["masks"].shape[-1],
                    rews=arrays["true_rewards"][i, k, :valid].astype(np.float32),
                )
            )
        pairs.append(tuple(fragments))
    dataset = PreferenceDataset()
    dataset.push(pairs, np.array([1.0 - label.label for label in labels], dtype=np.float32))
    dataset.save(out)


# --------------------------------------------------------------------------------------------- command line


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"labels.py: error: {message}\n")


# --------------------------------------------------------------------------------------------- check


def label_name(label: float) -> str:
    """A kept label as check reports it: a pair's choice, else the number a ranking or ratings are written as."""
    return NAMES.get(label, f"label {label:g}")


def check(run_folder: Path, server_data: Path | None = None) -> list[str]:
    """Where a human-mode run's label log (runs/<run>/labels.sqlite) and its feedback server's answers disagree, one line
    per query: a label the run keeps that the server has otherwise or not at all (undone), and an answer on the server the
    run does not keep. A reorder of the reward-model check is kept as the labels of every set of the run's clips per
    query among its clips (cleanrlhf_utils.feedback.reorder_label): the run must keep exactly those. The server's
    database is the run's autostarted one (runs/<run>/feedback_data) unless given."""
    log_path, name = run_folder / "labels.sqlite", run_folder.name
    server_path = (server_data or run_folder / "feedback_data") / "feedback.sqlite3"
    for path, what in ((log_path, "the run's label log"), (server_path, "the feedback server's database (give --server-data DIR)")):
        if not path.is_file():
            raise LabelsError(f"{path} does not exist: it should hold {what}")
    with sqlite3.connect(f"file:{log_path.resolve()}?mode=ro", uri=True) as db:
        columns = [row[1] for row in db.execute("PRAGMA table_info(labels)")]
        if "query_id" not in columns:
            raise LabelsError(f"{log_path} keeps no query ids: its run labelled nothing through a feedback server")
        kept: dict[int, list[float]] = {}
        clips_per_query = 2
        for query, label, shapes in db.execute("SELECT query_id, label, shapes FROM labels WHERE query_id IS NOT NULL ORDER BY id"):
            kept.setdefault(query, []).append(label)
            clips_per_query = json.loads(shapes)["masks"][0][0]
    with sqlite3.connect(f"file:{server_path.resolve()}?mode=ro", uri=True) as db:
        run = db.execute("SELECT id FROM runs WHERE name = ?", (name,)).fetchone()
        if run is None:
            raise LabelsError(f"{server_path} holds no run named {name}")
        extra = columns_or_null(db, "queries", "q", ("rating_scale", "check_step"))
        answers = columns_or_null(db, "labels", "l", ("ranking", "ratings"))
        rows = db.execute(
            f"SELECT q.id, l.choice, {extra}, {answers}, (SELECT COUNT(*) FROM query_clips c WHERE c.query_id = q.id) "
            "FROM queries q LEFT JOIN labels l ON l.query_id = q.id WHERE q.run_id = ?",
            run,
        ).fetchall()
    differ = []
    for query, choice, rating_scale, check_step, ranking, ratings, shown in sorted(rows):
        labels = sorted(kept.get(query, []))
        if choice in CHOICE_LABELS or choice in (RANKED, RATED):  # an answer the run learns from
            answer = {"choice": choice, "ranking": json.loads(ranking or "null"), "ratings": json.loads(ratings or "null")}
            if check_step is None:
                expected = [answer_label(answer, rating_scale or 0)]
            else:  # a reorder: every set of the run's clips per query among the check's clips (two: a pair)
                subsets = itertools.combinations(range(shown or 2), clips_per_query)
                expected = sorted(reorder_label(answer, subset) for subset in subsets)
            if labels != expected:
                given = choice if choice in CHOICE_LABELS else answer["ranking"] or answer["ratings"]
                differ.append(f"pair {query}: the server has {given!r}, the run {' '.join(map(label_name, labels)) or 'no label'!r}")
        elif labels:
            now = "a skip" if choice == "skip" else "no answer (undone)"
            differ.append(f"pair {query}: the run keeps {' '.join(map(label_name, labels))!r}, the server has {now}")
    served = {row[0] for row in rows}
    differ += [
        f"pair {query}: the run keeps {' '.join(map(label_name, labels))!r}, the server has no such pair"
        for query, labels in kept.items()
        if query not in served
    ]
    return differ


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(prog="labels.py", description="List, merge, export and import label stores; agreement between people.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for name, text in (
        ("list", "labels, sessions and per-annotator counts of each store"),
        ("agreement", "Cohen's kappa on pairs labelled by two people"),
    ):
        s = sub.add_parser(name, help=text)
        s.add_argument("stores", nargs="+", help="labels.sqlite files, run folders, folders of runs, or a server's data dir")
    s = sub.add_parser("merge", help="one label log (for --teacher-feedback-mode file) from several")
    s.add_argument("stores", nargs="+")
    s.add_argument("--out", required=True, help="labels.sqlite to write (appended to if it exists; nothing is written twice)")
    s = sub.add_parser("export", help="to NPZ, Uni-RLHF's pickles or imitation's PreferenceDataset")
    s.add_argument("stores", nargs="+")
    s.add_argument("--format", required=True, choices=("npz", "uni-rlhf", "imitation"))
    s.add_argument("--out", required=True, help="file (npz, imitation) or folder (uni-rlhf)")
    s.add_argument("--obs-dim", type=int, default=None, help="observation size (uni-rlhf, imitation): obs_actions is [obs, action]")
    s.add_argument("--env-id", default="env", help="uni-rlhf: the env name in the file names (default 'env')")
    s.add_argument("--domain", default="mujoco", help="uni-rlhf: the domain in the file names (default mujoco)")
    s = sub.add_parser("check", help="whether a human-mode run keeps each label as its feedback server has it (exit 1 if not)")
    s.add_argument("run", help="the run's folder, runs/<run>")
    s.add_argument("--server-data", default=None, help="the feedback server's data dir (default: the run's autostarted one)")
    s = sub.add_parser("import", help="an NPZ or Uni-RLHF folder written by export, into a label log")
    s.add_argument("source", help="labels.npz, or a <env>_human_labels folder")
    s.add_argument("--out", required=True, help="labels.sqlite to write (appended to if it exists)")
    return p.parse_args(argv)


def kappa_text(value: float) -> str:
    return "n/a (each gave one answer throughout)" if np.isnan(value) else f"{value:.3f}"


def main(argv=None):
    args = parse_args(argv)
    try:
        if args.command == "list":
            result = [summary(store) for store in find_stores(args.stores)]
            for s in result:
                print(f"{s['store']} ({s['kind']}): {s['labels']} labels, {s['skips']} skips, sessions {', '.join(s['sessions']) or '-'}")
                for person, c in sorted(s["annotators"].items()):
                    print(f"  {person or '(none)'}: {c['labels']} labels (left {c['left']}, right {c['right']}, tie {c['tie']})")
            return result
        if args.command == "agreement":
            result = agreement(read_all(args.stores))
            for row in result:
                a, b = row["annotators"]
                print(
                    f"{a} / {b}: {row['pairs']} pairs labelled by both, {row['agree']} the same, Cohen's kappa {kappa_text(row['kappa'])}"
                )
            if not result:
                print("no pair was labelled by two people")
            return result
        if args.command == "merge":
            labels = read_all(args.stores)
            stack(labels)  # one shape, arrays present
            written = write_label_log(labels, Path(args.out))
            print(f"{args.out}: {written} labels written, {len(labels) - written} already there")
            return written
        if args.command == "check":
            differ = check(Path(args.run), Path(args.server_data) if args.server_data else None)
            for line in differ:
                print(line)
            print(f"{args.run}: {'the run keeps every label as the server has it' if not differ else f'{len(differ)} pairs differ'}")
            if differ:
                raise SystemExit(1)
            return differ
        if args.command == "export":
            labels, out = read_all(args.stores), Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            if args.format == "npz":
                export_npz(labels, out)
            elif args.format == "uni-rlhf":
                export_uni_rlhf(labels, out, args.obs_dim, args.env_id, args.domain)
            else:
                export_imitation(labels, out, args.obs_dim)
            print(f"{args.out}: {len(labels)} labels ({args.format})")
            return len(labels)
        source = Path(args.source)
        if source.is_dir():
            labels = read_uni_rlhf(source)
        elif source.is_file():
            labels = read_npz(source)
        else:
            raise LabelsError(f"{args.source} does not exist; give a labels.npz or a Uni-RLHF folder written by export")
        written = write_label_log(labels, Path(args.out))
        print(f"{args.out}: {written} labels written, {len(labels) - written} already there")
        return written
    except LabelsError as error:
        print(f"labels.py: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
