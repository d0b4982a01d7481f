"""Start the workers: one in-process worker, or torch.distributed.run's elastic agent (in-process API).

The config travels to each worker as resolved YAML. A worker that finds a user mistake (exit code 2)
or a non-finite step (3) leaves its one-paragraph message in the launcher's error folder, and the
launcher exits with that code and prints the message once; anything else is a crash (exit code 1).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from muonrun.config import Config, to_yaml
from muonrun.distributed import mesh_shape
from muonrun.errors import UserError

USER_ERROR_EXIT = 2
NON_FINITE_EXIT = 3
ERROR_DIR_ENV = "MUONRUN_ERROR_DIR"  # where workers report a user mistake or a non-finite step
REPORTS = "exit*-rank*.txt"  # a report's name: the exit code it calls for and the reporting rank


@dataclass
class LaunchPlan:
    nproc_per_node: int
    nnodes: int
    node_rank: int
    rdzv_endpoint: str | None
    rdzv_id: str
    max_restarts: int
    local_addr: str | None = None

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def in_process(self) -> bool:
        return self.world_size == 1 and self.max_restarts == 0


def default_nproc(c) -> int:
    """Config value, else every local GPU, else one CPU worker."""
    if c.launch.nproc_per_node:
        return c.launch.nproc_per_node
    import torch

    return torch.cuda.device_count() if c.train.device != "cpu" and torch.cuda.is_available() else 1


def make_plan(cfg: Config) -> LaunchPlan:
    plan = LaunchPlan(
        nproc_per_node=default_nproc(cfg),
        nnodes=cfg.launch.nnodes,
        node_rank=cfg.launch.node_rank,
        rdzv_endpoint=cfg.launch.rdzv_endpoint,
        rdzv_id=cfg.launch.rdzv_id,
        max_restarts=cfg.launch.max_restarts,
        local_addr=cfg.launch.local_addr,
    )
    if plan.nnodes > 1 and not plan.rdzv_endpoint:
        raise UserError(
            f"launch.nnodes is {plan.nnodes} but no rendezvous endpoint is set: pass --rdzv-endpoint HEAD_HOST:PORT "
            "(the same on every node), or run under SLURM's srun."
        )
    # Before any worker starts: a mesh that cannot fit is the user's mistake (exit 2), not a crash.
    _, shard = mesh_shape(
        cfg, plan.world_size, f"{plan.nnodes} node(s) x {plan.nproc_per_node} workers per node"
    )
    if plan.nnodes > 1 and shard % plan.nproc_per_node and plan.nproc_per_node % shard:
        print(
            f"muonrun: WARNING: parallel.dp_shard={shard} with {plan.nproc_per_node} workers per node: shard "
            "groups (consecutive ranks) straddle node boundaries unevenly; for HSDP shard within a node "
            f"(parallel.dp_shard={plan.nproc_per_node}, or parallel.dp_replicate=-1).",
            file=sys.stderr,
        )
    if cfg.train.device == "cuda" or (cfg.train.device == "auto" and _has_cuda()):
        import torch

        if plan.nproc_per_node > torch.cuda.device_count():
            raise UserError(
                f"{plan.nproc_per_node} workers per node were asked for but this machine has "
                f"{torch.cuda.device_count()} GPUs; lower --nproc-per-node (launch.nproc_per_node)."
            )
    return plan


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def check_output_dir(out: Path) -> None:
    """output_dir must be a folder this node can create and write (checkpoints, metrics, logs)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"output_dir '{out}' is a file, not a folder; set output_dir to a folder path.")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".muonrun-write-check-"):
            pass
    except OSError as e:
        raise UserError(
            f"output_dir '{out}' cannot be written ({e.strerror or type(e).__name__}"
            f"{': ' + e.filename if e.filename and str(e.filename) != str(out) else ''}); set output_dir to a "
            "folder you can write, on a filesystem every node shares."
        ) from None


def launch(cfg: Config) -> int:
    """Run the job described by a validated config; returns the process exit code."""
    from muonrun.checkpoint import check_run_folder
    from muonrun.data import check_data
    from muonrun.distributed import check_device, pick_device_type
    from muonrun.features import enabled
    from muonrun.model.build import check_model
    from muonrun.train.trainer import run_worker

    check_device(cfg)
    plan = make_plan(cfg)
    features = enabled(cfg)
    device_type = pick_device_type(cfg)
    for feature in features:
        feature.check(device_type)
    tokenizer = check_data(cfg)
    check_model(cfg.model, tokenizer.vocab_size, cfg.data.seq_len, features)
    config_yaml = to_yaml(cfg)
    out = Path(cfg.output_dir)
    check_run_folder(out)  # before anything is created there
    check_output_dir(out)
    # OUTPUT_DIR/config.yaml is written by the training itself, once its checkpoint is loaded: a run
    # refused at resume leaves the folder's config as it was.
    os.environ["MUONRUN_LAUNCHER_PID"] = str(os.getpid())  # where MUONRUN_FAULT=term@STEP sends SIGTERM
    if plan.in_process:
        from muonrun.distributed import release_process_groups
        from muonrun.train.trainer import NonFiniteError

        code, mistake = 0, None
        try:
            run_worker(config_yaml)
        except NonFiniteError as e:
            print(f"muonrun: {e}", file=sys.stderr, flush=True)
            code = NON_FINITE_EXIT
        except UserError as e:
            mistake = e.with_traceback(None)  # its traceback's frames hold the trainer, and so its context's
            mistake.__context__ = None
        release_process_groups()
        if mistake is not None:
            raise mistake
        return code
    return _elastic(plan, config_yaml, out)


STOP_SIGNALS = ("SIGTERM", "SIGUSR1")
_interrupts = 0


def _worker_pids() -> list[int]:
    """This launcher's worker processes (multiprocessing spawn children; not its resource tracker)."""
    pids = []
    for children in Path("/proc/self/task").glob("*/children"):
        for pid in children.read_text().split():
            try:
                if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    pids.append(int(pid))
            except OSError:
                pass
    return pids


def _forward_to_workers(signum, frame, quiet: bool = False) -> None:
    """SIGTERM/SIGUSR1 to the launcher (SLURM preemption, `--signal`, `kill`): pass it on to the workers,
    which save a checkpoint at the current step and exit 0; the launcher then returns normally."""
    import signal

    for pid in _worker_pids():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
    if not quiet:
        name = signal.Signals(signum).name
        print(f"muonrun: got {name}; the workers save a checkpoint and stop.", file=sys.stderr, flush=True)


def _interrupt_workers(signum, frame) -> None:
    """Ctrl-C (which the workers ignore: they get it only through here, once). The first asks the
    workers to save a checkpoint at the current step and stop, as SIGTERM does; the second kills them."""
    import signal

    global _interrupts
    _interrupts += 1
    if _interrupts == 1:
        print(
            "\nmuonrun: Ctrl-C: the workers save a checkpoint after this step, then stop "
            "(Ctrl-C again stops at once, without saving).",
            file=sys.stderr,
            flush=True,
        )
        _forward_to_workers(signal.SIGTERM, frame, quiet=True)
        return
    _forward_to_workers(signal.SIGKILL, frame, quiet=True)
    raise KeyboardInterrupt


@contextlib.contextmanager
def _reporting_restarts(output_dir: Path, error_dir: Path):
    """While the elastic agent runs: before it restarts the workers (--max-restarts), say which rank
    failed, how, and which checkpoint the restart resumes from. (The agent's own log says it only at
    INFO level, without the reason, and muonrun silences the agent's logging.)

    A failure a worker reported (a user mistake, a non-finite step) is not restarted: resuming is exact,
    so the restart would meet it again at the same step."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from muonrun.checkpoint import complete_checkpoints

    monitor, restart = LocalElasticAgent._monitor_workers, LocalElasticAgent._restart_workers

    def monitored(agent, group):
        agent._muonrun_last = result = monitor(agent, group)
        if result.state in {WorkerState.FAILED, WorkerState.UNHEALTHY} and any(error_dir.glob(REPORTS)):
            agent._remaining_restarts = 0  # the agent then stops the workers and the job fails
        return result

    def restarting(agent, group):
        result = getattr(agent, "_muonrun_last", None)
        failures = getattr(result, "failures", None) or {}
        if failures:
            rank, failure = min(failures.items())
            how = (
                f"killed by {failure.signal_name()}"
                if failure.exitcode < 0
                else f"exit code {failure.exitcode}"
            )
            message = (
                failure.message if isinstance(failure.message, str) else failure.message.get("message", "")
            )
            reason = " ".join(str(message).split())[:300]
            what = f"worker rank {rank} failed ({how}{': ' + reason if reason and 'Signal' not in reason else ''})"
        else:
            what = "a worker of another node failed"
        found = complete_checkpoints(output_dir / "checkpoints")
        resume = f"from {found[-1]}" if found else "from the start (no checkpoint yet)"
        used = group.spec.max_restarts - agent._remaining_restarts
        print(
            f"muonrun: {what}; restarting the workers (restart {used} of {group.spec.max_restarts}), resuming {resume}.",
            file=sys.stderr,
            flush=True,
        )
        return restart(agent, group)

    LocalElasticAgent._monitor_workers, LocalElasticAgent._restart_workers = monitored, restarting
    try:
        yield
    finally:
        LocalElasticAgent._monitor_workers, LocalElasticAgent._restart_workers = monitor, restart


def _elastic(plan: LaunchPlan, config_yaml: str, output_dir: Path) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from muonrun.distributed import free_port

    endpoint = plan.rdzv_endpoint or f"127.0.0.1:{free_port()}"
    lc = LaunchConfig(
        min_nodes=plan.nnodes,
        max_nodes=plan.nnodes,
        nproc_per_node=plan.nproc_per_node,
        run_id=plan.rdzv_id,
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        # Node 0 hosts the c10d store at the endpoint, the others connect to it. Explicit, because torch's
        # guess (does the endpoint name this machine?) sees every "node" as the host when they share one.
        # Global ranks are handed out by the rendezvous (a node's workers get consecutive ranks), not by
        # node_rank, as with torchrun.
        rdzv_configs={"is_host": plan.node_rank == 0} if plan.nnodes > 1 else {},
        max_restarts=plan.max_restarts,
        local_addr=plan.local_addr,
        start_method="spawn",
        monitor_interval=0.5,
    )
    # torch.distributed.run's agent turns SIGTERM into an exception that SIGTERMs the workers and
    # SIGKILLs them 30 s later (and it leaves SIGUSR1 at its default: death). Keep SIGTERM and SIGUSR1
    # away from it and forward them instead, so the workers' checkpoint save can take as long as it needs.
    if hasattr(lc, "signals_to_handle"):
        lc.signals_to_handle = "SIGHUP,SIGQUIT"
    import signal

    global _interrupts
    _interrupts = 0
    previous = {name: signal.signal(getattr(signal, name), _forward_to_workers) for name in STOP_SIGNALS}
    previous["SIGINT"] = signal.signal(signal.SIGINT, _interrupt_workers)
    # The agent logs each worker failure with its own traceback; muonrun reports failures itself below.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // plan.nproc_per_node)))
    if plan.max_restarts:
        # By default the agents share one worker store across restarts, still holding the dead workers'
        # addresses: a restarted rank can read a stale one and fail to connect (pytorch/pytorch#135712;
        # every time on several nodes, where only the failed node counts the restart). Unshared, rank 0
        # of each attempt hosts a fresh store on a fresh port.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if plan.nnodes > 1:
        _announce_node(plan, endpoint)
    error_dir = tempfile.TemporaryDirectory(prefix="muonrun-errors-")
    os.environ[ERROR_DIR_ENV] = error_dir.name  # the spawned workers inherit it
    try:
        with _reporting_restarts(output_dir, Path(error_dir.name)):
            elastic_launch(lc, worker_entry)(config_yaml)
    except ChildFailedError as e:
        reported = report_worker_errors(Path(error_dir.name))
        if reported is not None:
            return reported
        rank, failure = e.get_first_failure()
        message = failure.message if isinstance(failure.message, str) else failure.message.get("message", "")
        print(
            f"muonrun: worker rank {rank} failed (exit code {failure.exitcode}).\n{message}", file=sys.stderr
        )
        return 1
    finally:
        for name, handler in previous.items():
            signal.signal(getattr(signal, name), handler)
        os.environ.pop(ERROR_DIR_ENV, None)
        error_dir.cleanup()
    return 0


def report_worker_errors(folder: Path) -> int | None:
    """After a failed job: print the user mistakes and non-finite steps the workers reported (each
    distinct message once) and return the exit code they call for; None if no worker reported one.

    The reports decide, not the workers' exit statuses: the other ranks may have crashed in a collective
    with the reporting one, and a reporting worker can still die after its report (a C++ thread aborting
    in interpreter teardown turns its exit code 3 into -6)."""
    reports = sorted(folder.glob(REPORTS))
    if not reports:
        return None
    for message in dict.fromkeys(p.read_text() for p in reports):
        print(f"muonrun: {message}", file=sys.stderr, flush=True)
    codes = {int(p.name.removeprefix("exit").split("-")[0]) for p in reports}
    return USER_ERROR_EXIT if USER_ERROR_EXIT in codes else NON_FINITE_EXIT


def _announce_node(plan: LaunchPlan, endpoint: str) -> None:
    """One line per node (a multi-node job's log shows every node joining), and a warning when node 0
    is not the machine the endpoint names: it would host the store where nobody looks for it."""
    import socket

    from torch.distributed.elastic.rendezvous.utils import (
        _matches_machine_hostname,
        parse_rendezvous_endpoint,
    )

    print(
        f"muonrun: node {plan.node_rank} of {plan.nnodes} ({socket.gethostname()}): {plan.nproc_per_node} workers, "
        f"rendezvous '{plan.rdzv_id}' at {endpoint}{' (hosted here)' if plan.node_rank == 0 else ''}",
        file=sys.stderr,
        flush=True,
    )
    host, _ = parse_rendezvous_endpoint(endpoint, default_port=29500)
    if plan.node_rank == 0 and not _matches_machine_hostname(host):
        print(
            f"muonrun: WARNING: this is node 0, which hosts the rendezvous, but the endpoint host '{host}' does "
            "not look like this machine; the other nodes will look for it there. Point --rdzv-endpoint at node 0.",
            file=sys.stderr,
            flush=True,
        )


def worker_entry(config_yaml: str) -> None:
    """What each spawned worker runs: a user mistake exits 2 with one paragraph, anything else raises."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the workers through the launcher only

    from torch.distributed.elastic.multiprocessing.errors import record

    from muonrun.distributed import release_process_groups
    from muonrun.train.trainer import NonFiniteError, run_worker

    code = 0
    try:
        record(run_worker)(config_yaml)
    except (UserError, NonFiniteError) as e:
        # The launcher prints it (once, whichever ranks found it); without a launcher, rank 0 does.
        code = USER_ERROR_EXIT if isinstance(e, UserError) else NON_FINITE_EXIT
        folder = os.environ.get(ERROR_DIR_ENV)
        if folder:
            (Path(folder) / f"exit{code}-rank{os.environ.get('RANK', '0')}.txt").write_text(str(e))
        elif os.environ.get("RANK", "0") == "0":
            print(f"muonrun: {e}", file=sys.stderr, flush=True)
    # Outside the except block: the error's traceback (and the trainer its frames hold) is gone by now.
    release_process_groups()
    if code:
        sys.exit(code)
