#!/usr/bin/env bash
# Submits a sweep as a SLURM job array whose tasks all join one sweep, and prints the job id.
#
#   bash slurm/start_job.sh --config-filename sweep_config/hopper.yaml --algorithm sac-rlhf \
#       --storage journal:///shared/sweeps/hopper.log --array-size 10 --sweep-count 2 --venv /shared/venvs/cleanrlhf
#   bash slurm/start_job.sh --config-filename sweep_config/hopper.yaml --backend wandb --project-name P --entity E \
#       --array-size 10 --sweep-count 2 --venv /shared/venvs/cleanrlhf
#
# Options of this script: --array-size N (array tasks, default 4), --venv DIR (the environment of slurm/setup_venv.sh;
# default $VENV_DIR, or none: $PYTHON / python on PATH), --log-dir DIR (default slurm/logs: <job>_<task>.out).
# Everything else goes to framework/sweep.py unchanged, flags after `--` to the training script. Run it from the
# folder the outputs (runs/, models/) should go to, usually the repository root; the Optuna storage must be on a
# filesystem every node sees (a journal file is the safer choice there than SQLite).
# Before submitting, the sweep is created here (sweep.py --create-only): a bad config fails now, not in every task,
# and with --backend wandb every task gets the new sweep's id.
set -euo pipefail

# Resources of each array task; override from the environment, e.g. SWEEP_PARTITION=gpu SWEEP_GPUS=1 bash slurm/start_job.sh ...
SWEEP_PARTITION="${SWEEP_PARTITION:-}"  # empty: the cluster's default partition
SWEEP_TIME="${SWEEP_TIME:-24:00:00}"    # wall-clock limit of a task (all its --sweep-count trials)
SWEEP_MEM="${SWEEP_MEM:-16G}"           # memory of a task (a 1M-transition replay buffer with simulator states needs a few GB)
SWEEP_CPUS="${SWEEP_CPUS:-1}"           # CPUs of a task (OMP_NUM_THREADS follows)
SWEEP_GPUS="${SWEEP_GPUS:-0}"           # GPUs of a task (0: none)
SWEEP_JOB_NAME="${SWEEP_JOB_NAME:-cleanrlhf-sweep}"
SWEEP_SBATCH_ARGS="${SWEEP_SBATCH_ARGS:-}"  # more sbatch options, e.g. "--account=myproject --qos=normal"

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; }
die() { echo "error: $*" >&2; exit 2; }

array_size=4
venv="${VENV_DIR:-}"
log_dir="slurm/logs"
sweep_args=()
script_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --array-size) [ $# -ge 2 ] || die "--array-size needs a number"; array_size="$2"; shift 2 ;;
    --array-size=*) array_size="${1#*=}"; shift ;;
    --venv) [ $# -ge 2 ] || die "--venv needs a folder"; venv="$2"; shift 2 ;;
    --venv=*) venv="${1#*=}"; shift ;;
    --log-dir) [ $# -ge 2 ] || die "--log-dir needs a folder"; log_dir="$2"; shift 2 ;;
    --log-dir=*) log_dir="${1#*=}"; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; script_args=("$@"); break ;;
    *) sweep_args+=("$1"); shift ;;
  esac
done
[[ "$array_size" =~ ^[1-9][0-9]*$ ]] || die "--array-size must be a positive integer, got '$array_size'"
if [ -n "$venv" ]; then
  [ -f "$venv/bin/activate" ] || die "--venv $venv has no bin/activate (create it with: bash slurm/setup_venv.sh $venv)"
  set +u
  source "$venv/bin/activate"
  set -u
fi
PYTHON="${PYTHON:-python}"
command -v sbatch >/dev/null || die "sbatch not found: run this on a SLURM login node"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$log_dir"  # sbatch does not create it: without it a task's output is lost

# Create the sweep once, here; its output goes to stderr so that stdout is only the job id.
created="$("$PYTHON" "$repo/framework/sweep.py" "${sweep_args[@]}" --create-only ${script_args[@]+-- "${script_args[@]}"})" || exit $?
printf '%s\n' "$created" >&2
sweep_id="$(printf '%s\n' "$created" | sed -n 's/^W&B sweep id: //p' | tail -n 1)"
if [ -n "$sweep_id" ] && [[ " ${sweep_args[*]} " != *" --sweep-id "* && " ${sweep_args[*]} " != *" --sweep-id="* ]]; then
  sweep_args+=(--sweep-id "$sweep_id")
fi

sbatch_args=(
  --parsable
  --job-name="$SWEEP_JOB_NAME"
  --array="0-$((array_size - 1))"
  --cpus-per-task="$SWEEP_CPUS"
  --mem="$SWEEP_MEM"
  --time="$SWEEP_TIME"
  --output="$log_dir/%A_%a.out"
)
[ -n "$SWEEP_PARTITION" ] && sbatch_args+=(--partition="$SWEEP_PARTITION")
[ "$SWEEP_GPUS" != 0 ] && sbatch_args+=(--gres="gpu:$SWEEP_GPUS")
# The tasks inherit this environment (sbatch --export=ALL): the repository, the venv and the interpreter.
export SWEEP_REPO="$repo" VENV_DIR="$venv" PYTHON
# shellcheck disable=SC2086  # SWEEP_SBATCH_ARGS is a list of options
job_id="$(sbatch "${sbatch_args[@]}" $SWEEP_SBATCH_ARGS "$repo/slurm/sweep.sbatch" "${sweep_args[@]}" ${script_args[@]+-- "${script_args[@]}"})"
job_id="${job_id%%;*}"  # --parsable prints <id> or <id>;<cluster>
echo "submitted job array $job_id ($array_size tasks), logs: $log_dir/${job_id}_<task>.out" >&2
echo "$job_id"
