#!/usr/bin/env bash
# Re-lock the environment and re-export the pip constraints from the lock, in one step, so the two never disagree
# (tests/test_lock.py fails when they do).
#   bash dev/update_lock.sh            # after editing pyproject.toml: keep every other pin where it is
#   bash dev/update_lock.sh --upgrade  # move every package to its newest allowed version (try it first with
#                                          # dev/try_newest.sh)
# Needs uv (in the dev extra) and PyPI. Commit pyproject.toml, uv.lock and requirements/constraints.txt together.
set -euo pipefail
cd "$(dirname "$0")/.."
uv lock "$@"
uv export --frozen --no-hashes --no-emit-project --all-extras -o requirements/constraints.txt
echo "updated uv.lock and requirements/constraints.txt; run the tests, then commit them with pyproject.toml"
