#!/usr/bin/env bash
# Re-lock the environment, re-export the pip constraints from the lock and re-lock Poetry at the lock's versions, in
# one step, so the three never disagree (tests/test_lock.py fails when they do).
#   bash dev/update_lock.sh            # after editing pyproject.toml: keep every other pin where it is
#   bash dev/update_lock.sh --upgrade  # move every package to its newest allowed version (try it first with
#                                          # dev/try_newest.sh)
# Needs uv (in the dev extra), Poetry (bash dev/install_test_deps.sh) and PyPI; Poetry's part takes minutes. Commit
# pyproject.toml, uv.lock, requirements/constraints.txt and poetry.lock together.
set -euo pipefail
cd "$(dirname "$0")/.."
uv lock "$@"
uv export --frozen --no-hashes --no-emit-project --all-extras -o requirements/constraints.txt
python dev/lock_poetry.py
echo "updated uv.lock, requirements/constraints.txt and poetry.lock; run the tests, then commit them with pyproject.toml"
