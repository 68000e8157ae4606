#!/usr/bin/env bash
# Creates the Python environment that the sweep's array tasks activate. Run it once, from anywhere, on a node
# that can reach the package index, with a path on a filesystem the compute nodes see:
#   bash slurm/setup_venv.sh /shared/venvs/cleanrlhf
# then pass --venv /shared/venvs/cleanrlhf to slurm/start_job.sh.
# PYTHON picks the interpreter (default python3, >= 3.10). torch is installed first, pinned, so that the project's
# `torch>=2.5` does not pull another build; TORCH_INDEX_URL picks which one, e.g.
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 bash slurm/setup_venv.sh /shared/venvs/cleanrlhf
set -euo pipefail
if [ $# -ne 1 ] || [ -z "$1" ] || [ "${1#-}" != "$1" ]; then
  echo "usage: bash slurm/setup_venv.sh VENV_DIR   (the folder to create the virtual environment in)" >&2
  exit 2
fi
venv_dir="$1"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"${PYTHON:-python3}" -m venv "$venv_dir"
"$venv_dir/bin/python" -m pip install --upgrade pip
"$venv_dir/bin/python" -m pip install torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
"$venv_dir/bin/python" -m pip install -e "$repo[dev]"
echo "created $venv_dir: submit sweeps with  bash slurm/start_job.sh --venv $venv_dir ..."
