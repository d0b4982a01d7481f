"""Multi-node on one machine: two "nodes" (two launchers) meeting over loopback through torchrun's c10d
rendezvous, CPU workers on gloo.

- 2 nodes x 2 workers through scripts/multinode.sh, HSDP with Muon (parallel.dp_replicate=-1: one
  replica per node, so a 2 x 2 mesh), one node's worker killed: --max-restarts brings both nodes back
  from the latest checkpoint;
- scripts/slurm/pretrain.sbatch under a fake `srun`/`scontrol` (the fake srun starts its command once
  per "node" with SLURM_NODEID set, as srun does in a 2-node allocation): muonrun reads SLURM's
  variables, SIGUSR1 before the time limit saves a checkpoint and requeues, the requeued job resumes.

Process start-up dominates on a 2-core machine, so runs are short and each launch serves several checks.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from muonrun.distributed import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
# Small and quick: 128-token windows, 4 per worker, short warmup, plain logs.
FAST = [
    "data.seq_len=128",
    "train.micro_batch_size=4",
    "train.eval_interval=0",
    "schedule.warmup_steps=2",
    "logging.console=plain",
]
MUONRUN_BIN = shutil.which("muonrun", path=str(Path(sys.executable).parent)) or shutil.which("muonrun")


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MUONRUN_"))}
    return {**env, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **extra}


def start(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=REPO)


def finish(procs: list[subprocess.Popen], logs: list[Path], timeout: float = 300) -> list[str]:
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    texts = [log.read_text() for log in logs]
    for p, log, text in zip(procs, logs, texts, strict=True):
        assert p.returncode == 0, f"{log.name} exited {p.returncode}:\n{text[-4000:]}"
    return texts


def rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in rows(run) if "loss" in r]


@pytest.mark.skipif(MUONRUN_BIN is None, reason="the muonrun console script is not installed")
def test_two_nodes_hsdp_muon_train_one_run_and_a_lost_node_restarts_both_from_the_latest_checkpoint(tmp_path):
    """2 nodes x 2 workers through scripts/multinode.sh, HSDP with Muon (one replica per node): one run,
    each step logged once by global rank 0; node 1's second worker dies after step 5 and --max-restarts
    brings both nodes back from step-3."""
    run = tmp_path / "run"
    port = free_port()
    args = [
        "tiny", f"output_dir={run}", *FAST, "optimizer.name=muon", "parallel.dp_replicate=-1",
        "train.max_steps=8", "logging.log_interval=1", "checkpoint.interval=3",
    ]  # fmt: skip
    script = str(REPO / "scripts" / "multinode.sh")
    logs = [tmp_path / f"node{i}.log" for i in (0, 1)]
    env = dict(HEAD="127.0.0.1", NNODES="2", PORT=str(port), RDZV_ID="restart-test", NPROC_PER_NODE="2")
    env |= dict(MAX_RESTARTS="1", MUONRUN=MUONRUN_BIN, MUONRUN_FAULT="kill@5:r3")  # node 1's rank 3 dies
    procs = [start(["bash", script, *args], logs[i], base_env(NODE_RANK=str(i), **env)) for i in (0, 1)]
    node0, node1 = finish(procs, logs)
    text = node0 + node1

    starts = [r for r in rows(run) if r.get("event") == "start"]
    assert [r["step"] for r in starts] == [0, 3], starts  # the restart resumed from step-3
    assert all(r["world_size"] == 4 and r["mesh"] == {"dp_replicate": 2, "dp_shard": 2} for r in starts)
    assert "resumed from" in text and "step-3" in text
    steps = [s for s, _ in losses(run)]  # one run: each step once per attempt, 4 ranks, one metrics.jsonl
    assert steps[:3] == [1, 2, 3] and steps[-5:] == [4, 5, 6, 7, 8] and steps.count(4) == 2, steps
    assert losses(run)[-1][1] < losses(run)[0][1] - 0.5
    assert rows(run)[-1]["tokens_seen"] == 8 * 4 * 4 * 128  # steps x ranks x micro-batch x seq_len
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-6", "step-8"]
    assert "node 0 of 2" in node0 and "(hosted here)" in node0 and "node 1 of 2" in node1
    assert ("step      8/8" in node0) and ("step      8/8" not in node1)  # only global rank 0 prints


FAKE_SRUN = r"""#!/bin/bash
# srun for tests: start the command once per "node" (SLURM_NNODES) on this machine, with the variables
# srun sets per task; forward USR1/TERM to the tasks; exit with the highest exit code.
echo "srun $*" >> "$FAKE_SLURM_LOG"
while [[ $# -gt 0 && $1 == -* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do
    SLURM_NODEID=$i SLURM_PROCID=$i SLURM_LOCALID=0 SLURM_STEP_ID=0 SLURM_STEP_NUM_NODES=$SLURM_NNODES \
    SLURM_STEP_NUM_TASKS=$SLURM_NNODES SLURM_STEP_NODELIST=$SLURM_JOB_NODELIST "$@" &
    pids+=($!)
done
trap 'kill -USR1 "${pids[@]}" 2>/dev/null' USR1
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM
rc=0
for p in "${pids[@]}"; do
    while :; do wait "$p"; r=$?; kill -0 "$p" 2>/dev/null || break; done
    (( r > rc )) && rc=$r
done
exit $rc
"""
# `scontrol show hostnames` fails here, so muonrun expands the node list itself.
FAKE_SCONTROL = '#!/bin/bash\necho "scontrol $*" >> "$FAKE_SLURM_LOG"\n[ "$1" = requeue ]\n'


def wait_for_step(run: Path, step: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if any(s >= step for s, _ in losses(run)):
            return
        time.sleep(0.2)
    raise AssertionError(f"step {step} never logged (exit code {proc.poll()})")


@pytest.mark.skipif(MUONRUN_BIN is None, reason="the muonrun console script is not installed")
def test_sbatch_script_preempted_requeued_and_resumed(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    slurm_log = tmp_path / "slurm-calls.log"
    run = tmp_path / "run"
    env = base_env(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        FAKE_SLURM_LOG=str(slurm_log),
        MUONRUN=MUONRUN_BIN,
        MUONRUN_RDZV_PORT=str(free_port()),
        SLURM_JOB_ID="777",
        SLURM_NNODES="2",
        SLURM_JOB_NUM_NODES="2",
        SLURM_JOB_NODELIST="127.0.0.[1-2]",  # two "nodes", the first one 127.0.0.1
        SLURM_CPUS_PER_TASK="1",
        SLURM_NODEID="0",  # the batch shell's own value; srun sets each task's
    )
    cmd = [
        "bash", str(REPO / "scripts" / "slurm" / "pretrain.sbatch"), "tiny", f"output_dir={run}", *FAST,
        "train.max_steps=14", "logging.log_interval=1", "checkpoint.interval=0", "--nproc-per-node", "1",
    ]  # fmt: skip

    # First allocation: SLURM's SIGUSR1 (--signal=B:USR1@...) reaches the batch shell mid-run.
    job = start(cmd, tmp_path / "job.log", env)
    wait_for_step(run, 3, job)
    job.send_signal(signal.SIGUSR1)
    (first,) = finish([job], [tmp_path / "job.log"])
    saved = sorted(int(p.name.removeprefix("step-")) for p in (run / "checkpoints").iterdir())
    assert len(saved) == 1 and 3 <= saved[0] < 14, (saved, first[-3000:])
    assert "Stopped by signal" in first and "requeueing job 777" in first
    calls = slurm_log.read_text()
    assert "srun --ntasks-per-node=1 --cpus-per-task=1 --kill-on-bad-exit=1" in calls
    assert "scontrol requeue 777" in calls
    assert "rendezvous '777' at 127.0.0.1:" in first  # from SLURM_JOB_ID and the expanded node list

    # The requeued job (same id, same output_dir) resumes from that checkpoint and finishes.
    job = start(cmd, tmp_path / "requeued.log", {**env, "SLURM_RESTART_COUNT": "1"})
    (second,) = finish([job], [tmp_path / "requeued.log"])
    assert f"resumed from {run / 'checkpoints' / f'step-{saved[0]}'}" in second
    assert "requeueing" not in second
    steps = losses(run)
    assert steps[-1][0] == 14 and steps[-1][1] < steps[0][1] - 1.0, steps
    start_rows = [r for r in rows(run) if r.get("event") == "start"]
    assert [r["step"] for r in start_rows] == [0, saved[0]] and start_rows[0]["world_size"] == 2
