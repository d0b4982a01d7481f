"""The launcher's promises beyond training itself: one live writer per run folder (a lock naming its
holder, taken over from a dead one), workers that die with their launcher, SIGHUP that saves and stops,
SIGQUIT that stops at once, both sent to the whole process group as a terminal sends them, a busy
rendezvous port named in one paragraph, nothing left outside the run.

The end-to-end test runs one job through four launches on CPU (2 gloo workers); MUONRUN_FAULT=hang@STEP
makes step STEP last until a stop request arrives, so each signal lands mid-run. The metrics row of step
N is written during step N+1, so a hang at step N leaves rows up to N-2.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from muonrun.cli import app
from muonrun.distributed import free_port
from muonrun.errors import UserError
from muonrun.launch import lock as lock_module
from muonrun.launch.lock import LOCK_FILE, RunLock

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()
RUN = [
    "data.seq_len=64",
    "train.micro_batch_size=4",
    "train.eval_interval=0",
    "logging.log_interval=1",
    "logging.console=plain",
    "train.max_steps=16",
    "checkpoint.interval=4",
    "checkpoint.keep_last=3",
    "--nproc-per-node",
    "2",
]
HOLD_LOCK = (  # another process holding a run folder's lock until it is killed
    "import sys, time; from muonrun.launch.lock import RunLock; "
    "held = RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(600)"
)


def env(tmp: Path, fault: str | None = None) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("MUONRUN_", "SLURM_"))}
    e |= {"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    e["TMPDIR"] = str(tmp)  # anything a launch leaves outside the run folder shows up here
    if fault:
        e["MUONRUN_FAULT"] = fault
    return e


def start(out: Path, tmp: Path, log: Path, fault: str | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "muonrun", "pretrain", "tiny", f"output_dir={out}", *RUN]
    return subprocess.Popen(  # its own process group, as a terminal's foreground job
        cmd,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env(tmp, fault),
        cwd=REPO,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen, log: Path, timeout: float = 300) -> tuple[int, str]:
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, log.read_text()


def rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def losses(out: Path) -> dict[int, list[float]]:
    found: dict[int, list[float]] = {}
    for r in rows(out):
        if "loss" in r:
            found.setdefault(r["step"], []).append(r["loss"])
    return found


def wait_until(what, proc: subprocess.Popen, log: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if what():
            return
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"never happened (exit code {proc.poll()}):\n{log.read_text()[-3000:]}")


def tree(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def checkpoints(out: Path) -> list[str]:
    return sorted((p.name for p in (out / "checkpoints").iterdir()), key=lambda n: int(n.split("-")[1]))


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.slow
def test_one_writer_per_run_folder_workers_die_with_their_launcher_and_hup_and_quit_stop(tmp_path):
    out, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()

    # 1. A 16-step job. A launch whose step 7 hangs: checkpoint step-4 is published, rows 1..5 are written.
    log1 = tmp_path / "first.log"
    first = start(out, tmp, log1, fault="hang@7")
    wait_until(lambda: 5 in losses(out), first, log1)
    holder = json.loads((out / LOCK_FILE).read_text())
    assert holder["pid"] == first.pid and holder["host"] == socket.gethostname()

    # 2. A second launch into the same folder: exit 2 naming the holder, no traceback, nothing touched.
    before = tree(out)
    second = subprocess.run(
        [sys.executable, "-m", "muonrun", "pretrain", "tiny", f"output_dir={out}", *RUN],
        capture_output=True, text=True, timeout=120, env=env(tmp), cwd=REPO,
    )  # fmt: skip
    text = " ".join(second.stderr.split())
    assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
    assert f"is in use by another muonrun launch (pid {first.pid} on {socket.gethostname()}, since" in text
    assert "Traceback" not in second.stdout + second.stderr
    assert tree(out) == before

    # 3. kill -9 of the launcher: its workers die with it, and nothing writes into the folder after.
    workers = [int(p.name) for p in (out / ".muonrun" / "node-0" / "workers").iterdir()]
    assert len(workers) == 2 and first.pid not in workers
    first.send_signal(signal.SIGKILL)
    first.wait()
    deadline = time.monotonic() + 10
    while not all(gone(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(gone(pid) for pid in workers), "a worker outlived its launcher"
    settled = {k: v for k, v in tree(out).items() if not k.startswith(".muonrun/")}
    time.sleep(2)
    assert {k: v for k, v in tree(out).items() if not k.startswith(".muonrun/")} == settled
    assert checkpoints(out) == ["step-4"] and max(losses(out)) == 5

    # 4. The rerun takes the dead launcher's lock over, resumes from step-4 exactly (step 5's loss is
    #    bit for bit the first launch's) and its step 10 hangs: SIGHUP there saves and stops.
    log3 = tmp_path / "third.log"
    third = start(out, tmp, log3, fault="hang@10")
    wait_until(lambda: 8 in losses(out), third, log3)
    os.killpg(third.pid, signal.SIGHUP)  # a closed terminal: to the launcher, its workers and their tracker
    code, text = finish(third, log3)
    assert code == 0, text[-3000:]
    assert f"lock was left by a launch that is gone (pid {first.pid} on" in text and "taking it over" in text
    assert "resumed from" in text and "step-4 at step 4" in text
    first_five, rerun_five = losses(out)[5]
    assert rerun_five == first_five
    assert "got SIGHUP: the workers save a checkpoint within two steps" in text
    # The stop is agreed one step late: after step 11, or 12 if it came in the hang; after step 10 if it
    # came before step 10 began (row 8 is written with step 8's save, so the signal can come that early).
    stopped = max(losses(out))
    assert stopped in (10, 11, 12) and f"Stopped by signal after step {stopped}" in text, text[-4000:]
    assert checkpoints(out) == ["step-4", "step-8", f"step-{stopped}"]
    assert "Traceback" not in text and "terminate called" not in text

    # 5. SIGQUIT during step 15 stops at once without saving: exit 131, one line each, no checkpoint
    #    changed (the step-12 one, if this launch saved it, was published before the hang).
    log4 = tmp_path / "fourth.log"
    fourth = start(out, tmp, log4, fault="hang@15")
    wait_until(lambda: 13 in losses(out), fourth, log4)
    saved = tree(out / "checkpoints")
    os.killpg(fourth.pid, signal.SIGQUIT)  # Ctrl-\ in a terminal: to every process of the job
    code, text = finish(fourth, log4)
    assert code == 131, text[-3000:]
    assert "got SIGQUIT: stopping the workers now, without saving" in text and "stopped by SIGQUIT" in text
    assert "Traceback" not in text and "terminate called" not in text and "leaked" not in text
    assert tree(out / "checkpoints") == saved and max(losses(out)) == 13

    # Nothing of the four launches is left outside the run folder, nor their control folders in it.
    assert not [p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor")]
    assert not (out / ".muonrun").exists()


def test_the_lock_names_its_live_holder_and_is_taken_over_from_a_dead_one(tmp_path, capsys):
    """Several processes: a holder in another process refuses this one (and the in-process single worker
    of `muonrun pretrain`, before it touches the folder); once the holder is killed the lock is taken
    over with a message naming it; a cleanly released lock is taken quietly."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env(tmp_path)
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match=f"in use by another muonrun launch \\(pid {holder.pid} on "):
            RunLock(tmp_path).acquire()
        result = runner.invoke(
            app, ["pretrain", "tiny", f"output_dir={tmp_path}", "train.max_steps=1", "--nproc-per-node", "1"]
        )
        assert result.exit_code == 2 and f"pid {holder.pid}" in result.output, result.output
        assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE]  # no config.yaml, no metrics
    finally:
        holder.kill()
        holder.wait()
    capsys.readouterr()
    with RunLock(tmp_path) as lock:
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    warned = capsys.readouterr().err
    assert f"left by a launch that is gone (pid {holder.pid} on {socket.gethostname()}" in warned
    assert (tmp_path / LOCK_FILE).read_text() == ""  # released cleanly: the next launch says nothing
    with RunLock(tmp_path):
        pass
    assert capsys.readouterr().err == ""


def test_a_second_launcher_of_one_node_rank_exits_2_naming_the_first(tmp_path):
    """Each node rank's launcher holds its own lock in the run folder: a second launch of node rank 1
    (two srun tasks on one node) exits 2 naming the first before it joins the rendezvous, where it would
    have waited silently until the job ended; other node ranks, and node 0's run lock, are apart."""
    hold = HOLD_LOCK.replace("RunLock(sys.argv[1])", "RunLock(sys.argv[1], 1)")
    holder = subprocess.Popen(
        [sys.executable, "-c", hold, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env(tmp_path)
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        port = free_port()
        args = ["pretrain", "tiny", f"output_dir={tmp_path}", "--nnodes", "2", "--node-rank", "1"]
        result = runner.invoke(app, [*args, "--rdzv-endpoint", f"127.0.0.1:{port}", "--nproc-per-node", "1"])
        out = " ".join(result.output.split())
        assert result.exit_code == 2 and "node rank 1 of the run" in out and f"pid {holder.pid}" in out, out
        for node_rank in (0, 2):
            with RunLock(tmp_path, node_rank):
                pass
    finally:
        holder.kill()
        holder.wait()


def test_without_file_locks_a_live_holder_on_this_machine_still_stops_a_second_launch(
    tmp_path, monkeypatch, capsys
):
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lock_module.fcntl, "flock", no_locks)
    (tmp_path / LOCK_FILE).write_text(
        json.dumps({"host": socket.gethostname(), "pid": os.getppid(), "since": "t"})
    )
    with pytest.raises(UserError, match=f"pid {os.getppid()} on"):
        RunLock(tmp_path).acquire()
    assert "does not support file locks" in capsys.readouterr().err
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    (tmp_path / LOCK_FILE).write_text(
        json.dumps({"host": socket.gethostname(), "pid": int(dead.stdout), "since": "t"})
    )
    with RunLock(tmp_path):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert "muonrun cannot keep a second launch on another machine out" in capsys.readouterr().err


def test_a_rendezvous_port_another_program_holds_exits_2_naming_it(tmp_path):
    port = free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        result = runner.invoke(
            app,
            ["pretrain", "tiny", f"output_dir={tmp_path / 'run'}", "--nproc-per-node", "2",
             "--rdzv-endpoint", f"127.0.0.1:{port}"],
        )  # fmt: skip
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and f"port {port} is already in use on this machine" in text, result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_a_stop_request_during_start_up_is_kept_and_sigquit_stops_at_once(monkeypatch, capsys):
    """In one process (the in-process worker, or a worker starting up): SIGHUP before the trainer's
    StopFlag exists is kept by it; SIGQUIT raises Quit (the CLI: exit 131), saying nothing is saved."""
    from muonrun.checkpoint import stop

    monkeypatch.setattr(stop, "detach_from_terminal", lambda: None)  # leave the test runner's terminal be
    monkeypatch.delenv(stop.LAUNCHER_PID_ENV, raising=False)
    saved = {sig: signal.getsignal(sig) for sig in (*stop.STOP_SIGNALS, signal.SIGQUIT)}
    try:
        stop.record_early()
        os.kill(os.getpid(), signal.SIGHUP)
        flag = stop.StopFlag()
        assert flag.raised == signal.SIGHUP and stop.requested()
        with pytest.raises(stop.Quit):
            os.kill(os.getpid(), signal.SIGQUIT)
        assert "got SIGQUIT: stopping now, without saving" in capsys.readouterr().out
        flag.restore()
        assert not stop.requested()
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@pytest.mark.parametrize(
    ("endpoint", "says"),
    [
        ("127.0.0.1:99999", "is not HOST:PORT with a port in 1..65535"),
        (
            "nosuchhost.invalid:29511",
            "its host 'nosuchhost.invalid' does not resolve on this machine (node 0",
        ),
    ],
)
def test_a_rendezvous_endpoint_that_cannot_work_exits_2_before_anything_is_written(tmp_path, endpoint, says):
    """A port out of range failed in a bind deep in torch; a host that does not resolve made torch retry
    for minutes and end in pages of C++ frames."""
    result = runner.invoke(
        app,
        ["pretrain", "tiny", f"output_dir={tmp_path / 'run'}", "--nnodes", "2", "--rdzv-endpoint", endpoint],
    )
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and says in text and "Traceback" not in result.output, result.output
    assert not (tmp_path / "run").exists()


def test_a_worker_reaped_before_its_waiter_runs_is_still_named_in_the_restart_message(
    tmp_path, monkeypatch, capsys
):
    """The restart message names the failed worker and how it died even when the agent reaps it before
    the worker's waiter thread reads its status (a loaded machine). Forced here: the waiter's waitid is
    held until the main thread, standing in for the agent, has reaped the worker; the SIGCHLD handler,
    which runs in the main thread before it reaps, kept the status."""
    from muonrun.launch import supervise

    control = tmp_path / "control"
    (control / "workers").mkdir(parents=True)
    real_waitid = os.waitid
    reaped = threading.Event()

    def held_waitid(idtype, pid, options):
        if not options & os.WNOHANG:  # the waiter's blocking call: only once the worker is reaped
            reaped.wait(30)
        return real_waitid(idtype, pid, options)

    monkeypatch.setattr(supervise.os, "waitid", held_waitid)
    with supervise.Supervisor(control, tmp_path / "run", max_restarts=2):
        worker = subprocess.Popen(
            [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
        )
        (control / "workers" / str(worker.pid)).write_text(json.dumps({"rank": 3, "attempt": 0}))
        real_waitid(os.P_PID, worker.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: SIGCHLD is pending
        assert worker.wait() == -signal.SIGKILL  # the agent's reap (the handler ran on the way here)
        reaped.set()
        said = ""
        for _ in range(100):  # the waiter finds its worker gone and reads the handler's record
            said += "".join(capsys.readouterr())
            if "restarting" in said:
                break
            time.sleep(0.1)
    assert "worker rank 3 failed (killed by SIGKILL); restarting the workers (restart 1 of 2)" in said, said


def test_the_restart_message_names_what_the_restart_loads(tmp_path):
    """By the checkpointer's own rule: a run started with resume_from restarts from that checkpoint (or
    its line's latest), not from the folder's newest, which the restart sets aside; init_from's weights
    where the folder has none."""
    from muonrun.checkpoint.files import META, seal
    from muonrun.launch import supervise

    def checkpoint(path: Path, started_from: str | None = None) -> Path:
        path.mkdir(parents=True)
        meta = {"step": int(path.name.split("-")[1]), "files": {}}
        (path / META).write_text(
            json.dumps(seal(meta | ({"started_from": started_from} if started_from else {})))
        )
        return path

    run, other = tmp_path / "run", tmp_path / "other"
    point = lambda **kw: supervise.Supervisor(tmp_path / "control", run, 1, **kw)._restart_point()  # noqa: E731
    assert point() == "resuming from the start (no checkpoint yet)"
    init = checkpoint(other / "checkpoints" / "step-3")
    assert point(init_from=str(init)) == f"starting from the weights of {init} (checkpoint.init_from)"
    assert point(resume_from=str(init)) == f"resuming from {init}"
    newest = checkpoint(run / "checkpoints" / "step-8")  # the line this run goes back from
    back = checkpoint(run / "checkpoints" / "step-4")
    assert point() == point(init_from=str(init)) == f"resuming from {newest}"
    assert point(resume_from=str(back)) == f"resuming from {back}"
    line = checkpoint(run / "checkpoints" / "step-6", started_from=str(back.resolve()))
    assert point(resume_from=str(back)) == f"resuming from {line}"


def test_a_stop_request_reaches_workers_once_they_registered_never_while_they_start(tmp_path):
    """A worker still importing has no handler for a stop signal and would die of it (a crash, not a
    save): the launcher passes a request only to registered workers, and the watcher passes it to a
    worker that registers later."""
    import multiprocessing

    from muonrun.launch import supervise

    control = tmp_path / "control"
    (control / "workers").mkdir(parents=True)
    fork = multiprocessing.get_context("fork")
    registered, starting = (fork.Process(target=time.sleep, args=(60,)) for _ in range(2))
    registered.start()
    starting.start()
    try:
        with supervise.Supervisor(control, tmp_path / "run", max_restarts=0) as supervisor:
            (control / "workers" / str(registered.pid)).write_text(json.dumps({"rank": 0, "attempt": 0}))
            supervisor._stop_request(signal.SIGTERM, None)
            registered.join(10)
            assert registered.exitcode == -signal.SIGTERM
            time.sleep(0.5)  # the watcher looks every 0.2 s: an unregistered worker is left alone
            assert starting.is_alive()
            (control / "workers" / str(starting.pid)).write_text(json.dumps({"rank": 1, "attempt": 0}))
            starting.join(10)
            assert starting.exitcode == -signal.SIGTERM  # once registered, it gets the request
    finally:
        for p in (registered, starting):
            p.kill()
            p.join()
