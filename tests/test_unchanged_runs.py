"""Moving code around the algorithm scripts changes no number: short runs of the default setting, every preset, the
backflip setting and both noisy-label variants end with networks and summaries identical, bit for bit, to recorded
fingerprints (tests/unchanged_runs.py says how they are made, and tests/data/unchanged_runs.json on which machine)."""

import json
import math

import pytest
from unchanged_runs import RECORD, RUNS, fingerprint, machine

RECORDED = json.loads(RECORD.read_text())


def test_every_recorded_run_is_still_run():
    assert set(RECORDED["runs"]) == set(RUNS)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_short_run_ends_where_the_recorded_one_did(name, tmp_path):
    if machine() != RECORDED["machine"]:
        pytest.skip(f"fingerprints were recorded on {RECORDED['machine']}; floating point differs on {machine()}")
    recorded, now = RECORDED["runs"][name], fingerprint(name, tmp_path)
    assert now["networks"] == recorded["networks"], f"{name}: the networks or labels differ from the recorded run"
    missing = set(recorded["summary"]) - set(now["summary"])
    assert not missing, f"{name}: the summary lost {sorted(missing)}"
    same = lambda a, b: a == b or (math.isnan(a) and math.isnan(b))  # noqa: E731
    changed = {key: (value, now["summary"][key]) for key, value in recorded["summary"].items() if not same(value, now["summary"][key])}
    assert not changed, f"{name}: recorded vs now {changed}"
