#!/usr/bin/env bash
# Creates the Python environment that the sweep's array tasks activate. Run it once, from anywhere, on a node
# that can reach the package index, with a path on a filesystem the compute nodes see:
#   bash slurm/setup_venv.sh /shared/venvs/cleanrlhf
# then pass --venv /shared/venvs/cleanrlhf to slurm/start_job.sh.
# PYTHON picks the interpreter (default python3, >= 3.10). As the README's "Installing" says, torch comes first, pinned,
# from PyTorch's own index of CPU builds (on Linux, PyPI's torch is the CUDA build, ~3 GB of CUDA packages, which the
# project's `torch>=2.5` would otherwise pull). TORCH_INDEX_URL picks another build, e.g. for GPU nodes
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 bash slurm/setup_venv.sh /shared/venvs/cleanrlhf
# and an empty TORCH_INDEX_URL= takes torch from pip's configured index (a local mirror that holds the CPU wheel).
set -euo pipefail
if [ $# -ne 1 ] || [ -z "$1" ] || [ "${1#-}" != "$1" ]; then
  echo "usage: bash slurm/setup_venv.sh VENV_DIR   (the folder to create the virtual environment in)" >&2
  exit 2
fi
venv_dir="$1"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"${PYTHON:-python3}" -m venv "$venv_dir"
"$venv_dir/bin/python" -m pip install --upgrade pip
torch_index="${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}"
"$venv_dir/bin/python" -m pip install torch==2.13.0 ${torch_index:+--index-url "$torch_index"}
# Every other package at the version the lock holds (requirements/constraints.txt is exported from uv.lock).
"$venv_dir/bin/python" -m pip install -e "$repo[dev]" -c "$repo/requirements/constraints.txt"
echo "created $venv_dir: submit sweeps with  bash slurm/start_job.sh --venv $venv_dir ..."
