#!/usr/bin/env bash
# Installs SLURM's controller, node daemon and client commands and MUNGE (Debian packages) for tests/test_slurm.py,
# which starts its own single-node cluster under a temporary folder. A failure is only a warning: the test then
# skips, saying why.
set -uo pipefail
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null && command -v munged >/dev/null; then
  exit 0
fi
if ! (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null); then
  echo "warning: could not install SLURM (slurmctld slurmd slurm-client munge); tests/test_slurm.py will be skipped"
fi
exit 0
