"""slurm/: a sweep submitted with slurm/start_job.sh as a 2-task job array on a real single-node SLURM cluster
(slurmctld, slurmd and a private munged, all started here under a temporary folder) fills one Optuna storage.
Skips, saying why, where SLURM is not installed (.ci/install_slurm.sh installs it) or the cluster cannot start."""

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.trial import TrialState

import sweep

REPO = Path(__file__).resolve().parents[1]
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scontrol")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_resources() -> tuple[int, int]:
    """CPUs and RealMemory (MB) of this machine, as slurmd sees them."""
    found = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30).stdout
    cpus = re.search(r"CPUs=(\d+)", found)
    memory = re.search(r"RealMemory=(\d+)", found)
    return int(cpus.group(1)) if cpus else os.cpu_count() or 1, int(memory.group(1)) if memory else 1000


def slurm_conf(root: Path, cpus: int, memory: int) -> str:
    # One node on 127.0.0.1, no cgroups, no accounting, everything under `root`; root runs the daemons and the jobs.
    return f"""ClusterName=cleanrlhftest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
MinJobAge=600
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def log_tail(*paths: Path, lines: int = 5) -> str:
    return " | ".join(f"{p.name}: " + " / ".join(p.read_text(errors="replace").splitlines()[-lines:]) for p in paths if p.is_file())


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """A private single-node cluster; yields the environment for its client commands. Stops every daemon it started."""
    missing = [name for name in BINARIES if shutil.which(name) is None]
    if missing:
        pytest.skip(f"SLURM is not installed (missing {', '.join(missing)}; .ci/install_slurm.sh installs it)")
    if os.geteuid() != 0:
        pytest.skip("the test cluster runs slurmd as root (it starts jobs as their user)")
    root = tmp_path_factory.mktemp("slurm")
    for name in ("munge", "state", "spool"):
        (root / name).mkdir()
    (root / "munge").chmod(0o711)
    key = root / "munge" / "munge.key"  # a key of our own: the system's munged, if any, is left alone
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, *node_resources()))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons = []
    try:
        daemons.append(
            subprocess.Popen(
                ["munged", "--foreground", "--force", f"--socket={root}/munge/munge.socket", f"--key-file={key}",
                 f"--pid-file={root}/munge/munged.pid", f"--seed-file={root}/munge/munged.seed", f"--log-file={root}/munge/munged.log"],
                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            )
        )  # fmt: skip
        deadline = time.time() + 10
        while not (root / "munge" / "munge.socket").exists() and time.time() < deadline:
            time.sleep(0.1)
        for command in (["slurmctld", "-D", "-f", str(conf)], ["slurmd", "-D", "-f", str(conf), "-N", "localhost"]):
            daemons.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        deadline, state, dead = time.time() + 30, "", []
        while time.time() < deadline:
            dead = [d.args[0] for d in daemons if d.poll() is not None]
            if dead:
                break
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, timeout=10).stdout.strip()
            if state == "idle":
                break
            time.sleep(0.5)
        if state != "idle":
            why = f"{', '.join(dead)} exited" if dead else f"node state {state or 'unknown'} after 30 s"
            pytest.skip(
                f"the test SLURM cluster did not start ({why}): {log_tail(root / 'munge/munged.log', root / 'slurmctld.log', root / 'slurmd.log')}"
            )
        yield env
    finally:
        for daemon in reversed(daemons):  # slurmd, slurmctld, munged: only what this fixture started
            daemon.terminate()
        for daemon in reversed(daemons):
            try:
                daemon.wait(timeout=20)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()


def wait_for_job(job_id: str, env: dict, timeout: float = 240) -> dict[str, str]:
    """Polls squeue until the array has left the queue; returns each task's final JobState (scontrol keeps finished
    jobs for MinJobAge seconds, and there is no accounting database for sacct)."""
    deadline = time.time() + timeout
    while subprocess.run(["squeue", "-h", "-j", job_id], env=env, capture_output=True, text=True, timeout=10).stdout.strip():
        assert time.time() < deadline, f"job {job_id} still queued or running after {timeout} s"
        time.sleep(1)
    shown = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=env, capture_output=True, text=True, timeout=10).stdout
    return {
        re.search(r"ArrayTaskId=(\S+)", line).group(1): re.search(r"JobState=(\S+)", line).group(1) for line in shown.splitlines() if line
    }


def test_start_job_runs_an_array_whose_tasks_join_one_optuna_study(slurm_cluster, tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "program": "framework/sac.py",
                "method": "random",
                "metric": {"name": "eval/mean_return", "goal": "maximize"},
                "parameters": {
                    "env_id": {"value": "Hopper-v5"},
                    "total_timesteps": {"value": 300},
                    "learning_starts": {"value": 100},
                    "evaluation_frequency": {"value": 0},
                    "evaluation_episodes": {"value": 1},
                    "q_lr": {"distribution": "log_uniform_values", "min": 1e-4, "max": 1e-3},
                },
            }
        )
    )
    storage = f"journal://{tmp_path}/sweeps/tiny.log"  # journal:///abs/path: file locks, fine for concurrent tasks
    logs = tmp_path / "logs"
    env = {
        **slurm_cluster,
        "PYTHON": sys.executable,  # no venv: the tasks use this interpreter
        "SWEEP_MEM": "1G",
        "SWEEP_TIME": "00:10:00",
        "SWEEP_CPUS": "1",  # two tasks fit on two cores
        "OMP_NUM_THREADS": "1",
        "MUJOCO_GL": "egl",
        "WANDB_MODE": "offline",
    }
    env.pop("VENV_DIR", None)
    submitted = subprocess.run(
        ["bash", str(REPO / "slurm/start_job.sh"), "--config-filename", str(config), "--storage", storage, "--array-size", "2",
         "--sweep-count", "1", "--log-dir", str(logs), "--", "--no-progress-bar", "--actor-hidden-dim", "32", "--critic-hidden-dim", "32"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    assert job_id.isdigit(), f"start_job.sh prints only the job id, got {submitted.stdout!r}"

    states = wait_for_job(job_id, env)
    task_logs = [logs / f"{job_id}_{task}.out" for task in (0, 1)]
    assert states == {"0": "COMPLETED", "1": "COMPLETED"}, f"{states}: {log_tail(*task_logs, lines=15)}"
    for log in task_logs:
        assert log.is_file() and "framework/sweep.py" in log.read_text(), log

    study = optuna.load_study(study_name="tiny__sac", storage=sweep.make_storage(storage))
    trials = study.trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2, f"{trials}: {log_tail(*task_logs, lines=15)}"
    assert trials[0].params["q_lr"] != trials[1].params["q_lr"], "each array task seeds its sampler differently"
    for t in trials:
        assert (tmp_path / "runs" / t.user_attrs["run_name"] / "summary.json").is_file(), "outputs go below the submit folder"
        assert t.user_attrs["args"]["actor_hidden_dim"] == 32, "flags after -- reach the training script"


def test_start_job_and_setup_venv_reject_bad_arguments_before_submitting(tmp_path):
    for command, expected in [
        (["bash", str(REPO / "slurm/start_job.sh"), "--array-size", "0"], "--array-size must be a positive integer"),
        (["bash", str(REPO / "slurm/start_job.sh"), "--venv", str(tmp_path / "nope")], "has no bin/activate"),
        (["bash", str(REPO / "slurm/setup_venv.sh")], "usage: bash slurm/setup_venv.sh VENV_DIR"),
    ]:
        result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=30)
        assert result.returncode == 2 and expected in result.stderr, (command, result.stderr)


def test_slurm_files_name_no_home_folder_user_or_address():
    for path in [REPO / "slurm/sweep.sbatch", REPO / "slurm/start_job.sh", REPO / "slurm/setup_venv.sh"]:
        text = path.read_text()
        assert text.startswith("#!/usr/bin/env bash\n"), path
        assert not re.search(r"/home/|/Users/|~/|\$HOME|[\w.-]+@[\w-]+\.\w+|git@|ssh://", text), path
    sbatch = (REPO / "slurm/sweep.sbatch").read_text()
    assert "#SBATCH --output=slurm/logs/%A_%a.out" in sbatch and "--cpus-per-task=1" in sbatch
    start = (REPO / "slurm/start_job.sh").read_text()
    for variable in ("SWEEP_PARTITION", "SWEEP_TIME", "SWEEP_MEM", "SWEEP_CPUS", "SWEEP_GPUS"):
        assert f'{variable}="${{{variable}:-' in start, f"{variable} is set at the top and overridable from the environment"
    setup = (REPO / "slurm/setup_venv.sh").read_text()
    assert setup.index("torch==2.13.0") < setup.index('[dev]"'), "torch is pinned before the project's dependencies"
