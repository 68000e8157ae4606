#!/usr/bin/env bash
# Installs what the full test suite needs beyond `pip install -e ".[dev]"`, so that no test skips for want of it:
#   - Chromium (Debian's `chromium` package): the browser test of the feedback page, tests/test_feedback_page.py
#   - Xvfb (`xvfb-run`): the seed README's headless and --render-mode human commands, tests/test_seed_commands.py
#   - a one-node SLURM (controller, node daemon, client commands, MUNGE), through .ci/install_slurm.sh:
#     tests/test_slurm.py starts its own cluster with them
#   - Poetry, in a venv of its own (its dependencies stay out of the project's), linked onto PATH: the clean-clone
#     `poetry install` of tests/test_first_run.py and the `poetry check --lock` of tests/test_lock.py
# Idempotent: what is already installed is left alone, so running it again installs nothing. Each part prints one
# line saying what it did; one that cannot be installed prints a warning (its tests then skip, saying why), and the
# last line says whether everything is in place. Exit code 0, or 1 with --strict where something is missing.
#   bash dev/install_test_deps.sh [--strict]
# Debian or Ubuntu, as root or with sudo (for apt-get). Poetry's venv goes to $POETRY_VENV (default
# ~/.local/share/cleanrlhf/poetry), its `poetry` is linked into $POETRY_BIN (default ~/.local/bin), and $PYTHON
# (default python) makes the venv.
set -uo pipefail
cd "$(dirname "$0")/.."
strict=0
[ "${1:-}" = "--strict" ] && strict=1
missing=()

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else return 1; fi
}

# --- Chromium ---
if command -v chromium >/dev/null; then
  echo "chromium: already installed ($(command -v chromium))"
elif as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null &&
  command -v chromium >/dev/null; then
  echo "chromium: installed (apt-get install chromium)"
else
  echo "warning: chromium: could not install it (apt-get install chromium); tests/test_feedback_page.py will skip"
  missing+=(chromium)
fi

# --- Xvfb (xvfb-run): the seed README's headless command and --render-mode human, tests/test_seed_commands.py ---
if command -v xvfb-run >/dev/null; then
  echo "xvfb: already installed ($(command -v xvfb-run))"
elif as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq xvfb >/dev/null &&
  command -v xvfb-run >/dev/null; then
  echo "xvfb: installed (apt-get install xvfb)"
else
  echo "warning: xvfb: could not install it (apt-get install xvfb); tests/test_seed_commands.py's Xvfb runs will skip"
  missing+=(xvfb)
fi

# --- SLURM (the CI's installer, which warns itself where it fails) ---
slurm_ready() {
  for tool in slurmctld slurmd sbatch munged; do command -v "$tool" >/dev/null || return 1; done
}
if slurm_ready; then
  echo "slurm: already installed"
else
  as_root bash .ci/install_slurm.sh
  if slurm_ready; then
    echo "slurm: installed (.ci/install_slurm.sh: slurmctld slurmd slurm-client munge)"
  else
    echo "warning: slurm: could not install it (.ci/install_slurm.sh); tests/test_slurm.py will skip"
    missing+=(slurm)
  fi
fi

# --- Poetry, in its own venv ---
poetry_venv="${POETRY_VENV:-$HOME/.local/share/cleanrlhf/poetry}"
poetry_bin="${POETRY_BIN:-$HOME/.local/bin}"
if command -v poetry >/dev/null; then
  echo "poetry: already installed ($(command -v poetry))"
else
  if [ -x "$poetry_venv/bin/poetry" ]; then
    how="found in its venv, $poetry_venv"
  elif "${PYTHON:-python}" -m venv "$poetry_venv" && "$poetry_venv/bin/python" -m pip install -q poetry; then
    how="installed in a venv of its own, $poetry_venv"
  else
    how=""
  fi
  if [ -n "$how" ] && mkdir -p "$poetry_bin" && ln -sf "$poetry_venv/bin/poetry" "$poetry_bin/poetry"; then
    echo "poetry: $how; linked as $poetry_bin/poetry"
    case ":$PATH:" in
      *":$poetry_bin:"*) ;;
      *) echo "  $poetry_bin is not on PATH: export PATH=\"\$PATH:$poetry_bin\" (or add it to your shell's profile)" ;;
    esac
  else
    echo "warning: poetry: could not install it into $poetry_venv; the Poetry tests of tests/test_first_run.py and tests/test_lock.py will skip"
    missing+=(poetry)
  fi
fi

if [ ${#missing[@]} -eq 0 ]; then
  echo "all test dependencies are in place: python -m pytest -q runs every test"
else
  echo "missing: ${missing[*]} (their tests skip, saying why)"
  [ "$strict" -eq 1 ] && exit 1
fi
exit 0
