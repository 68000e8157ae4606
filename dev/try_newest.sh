#!/usr/bin/env bash
# See the future early: install the newest release of every dependency that pyproject.toml allows (ignoring the lock)
# into a scratch venv and run the test suite there. Not run by CI: a failure here is news about an upgrade to decide
# on, not a broken build. A pass means `bash dev/update_lock.sh --upgrade` is safe to commit.
#   bash dev/try_newest.sh                 # the whole suite
#   bash dev/try_newest.sh tests/test_components.py -x   # arguments go to pytest
# TORCH_SPEC picks the torch to try (default: the newest CPU build from PyTorch's CPU index); where that index cannot be
# reached, set e.g. TORCH_SPEC="torch==2.13.0" to keep torch and move everything else.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$(mktemp -d)/newest"
python -m venv "$venv"
if [ -n "${TORCH_SPEC:-}" ]; then
  "$venv/bin/pip" install -q "$TORCH_SPEC"
else
  "$venv/bin/pip" install -q --upgrade torch --index-url https://download.pytorch.org/whl/cpu
fi
"$venv/bin/pip" install -q --upgrade --upgrade-strategy eager -e ".[dev]"
echo "newest versions allowed by pyproject.toml, where they differ from requirements/constraints.txt:"
"$venv/bin/python" - <<'PY'
import re
from importlib import metadata

locked = {}
for line in open("requirements/constraints.txt"):
    match = re.match(r"^([A-Za-z0-9_.-]+)==([^\s;]+)", line)
    if match:
        locked.setdefault(match[1].lower().replace("_", "-"), set()).add(match[2])
for dist in sorted(metadata.distributions(), key=lambda d: d.metadata["Name"].lower()):
    name = dist.metadata["Name"].lower().replace("_", "-")
    if name in locked and dist.version not in locked[name]:
        print(f"  {name}: {' / '.join(sorted(locked[name]))} -> {dist.version}")
PY
MUJOCO_GL="${MUJOCO_GL:-egl}" WANDB_MODE=offline "$venv/bin/python" -m pytest -q "$@"
