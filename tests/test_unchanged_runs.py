"""Moving code around the algorithm scripts changes no number: short runs of the default setting, every preset, the
backflip setting and the noisy-label variants end with networks, labels and summaries identical, bit for bit, to the
fingerprints recorded in tests/data/unchanged_runs.json. Each run goes in a child process pinned to AVX2 kernels
(tests/unchanged_runs.py, PINNED), so the record holds on every x86-64 host with AVX2, AVX-512 ones included."""

import json

import pytest
from unchanged_runs import PINNED, RECORD, RUNS, differences, fingerprint, unsupported_host, versions

RECORDED = json.loads(RECORD.read_text())


def test_every_recorded_run_is_still_run_and_the_record_says_how_it_was_made():
    assert set(RECORDED["runs"]) == set(RUNS)
    assert RECORDED["pinned"] == PINNED, "the record was made with another pinning: record it again"


def test_the_comparison_names_a_changed_network_a_changed_figure_and_a_lost_one():
    recorded = {"networks": {"agent": "aaaa", "reward_model": "bbbb"}, "summary": {"x": 1.0, "y": float("nan"), "z": 2.0}}
    assert differences(recorded, recorded) == []
    now = {"networks": {"agent": "aaaa", "reward_model": "cccc"}, "summary": {"x": 1.0000001, "y": float("nan")}}
    assert differences(recorded, now) == ["reward_model bbbb -> cccc", "x 1.0 -> 1.0000001", "summary lost z"]


@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_short_run_ends_where_the_recorded_one_did(name, tmp_path):
    reason = unsupported_host()
    if reason:
        pytest.skip(reason)
    if versions() != RECORDED["versions"]:
        pytest.skip(f"recorded with {RECORDED['versions']}, installed {versions()}: install the locked versions")
    changed = differences(RECORDED["runs"][name], fingerprint(name, tmp_path))
    assert not changed, f"{name} differs from the recorded run: {'; '.join(changed)}"
