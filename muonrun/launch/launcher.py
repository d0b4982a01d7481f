"""Start the workers: one in-process worker, or torch's elastic agent through torchrun's public API
(`elastic_launch` with a `LaunchConfig`), single- and multi-node.

Node 0 holds the run folder's lock for the whole launch (muonrun/launch/lock.py). The config travels to
each worker as resolved YAML; the workers die with their launcher, leave Ctrl-C to it and report a user
mistake (exit code 2) or a non-finite step (3) instead of raising it (muonrun/launch/worker.py); the
launcher forwards stop signals, stops the workers on a report and says which rank failed before a
restart (muonrun/launch/supervise.py). Anything else a worker raises is a crash (exit code 1).
"""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from muonrun import log
from muonrun.checkpoint.stop import LAUNCHER_PID_ENV
from muonrun.config import CheckpointConfig, Config, to_yaml
from muonrun.distributed import mesh_shape
from muonrun.errors import UserError
from muonrun.launch.lock import RunLock
from muonrun.launch.run_folder import CONTROL_DIR, check_output_dir, mark_checkpoints_owner
from muonrun.launch.supervise import Supervisor, WorkersReported, quiet_leak_warnings
from muonrun.launch.worker import (
    CONTROL_ENV,
    NON_FINITE_EXIT,
    REPORTS,
    STOPPED_EXIT,
    USER_ERROR_EXIT,
    worker_entry,
)
from muonrun.paths import own_folder, remove_own


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
    from muonrun.model.tensor_parallel import check_tp_fits_node

    check_tp_fits_node(cfg.parallel.tp, plan.nproc_per_node)
    if plan.nnodes > 1 and shard % plan.nproc_per_node and plan.nproc_per_node % shard:
        log.warning(
            f"parallel.dp_shard={shard} with {plan.nproc_per_node} workers per node: shard groups (consecutive "
            "ranks) straddle node boundaries unevenly; for HSDP shard within a node "
            f"(parallel.dp_shard={plan.nproc_per_node}, or parallel.dp_replicate=-1)."
        )
    if plan.rdzv_endpoint and not plan.in_process:
        check_endpoint_resolves(plan.rdzv_endpoint, plan.node_rank)
        if plan.node_rank == 0:
            check_endpoint_free(plan.rdzv_endpoint)
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


def _unwritable(out: Path, e: OSError) -> UserError:
    return UserError(
        f"output_dir '{out}' cannot be written ({e.strerror or type(e).__name__}"
        f"{': ' + e.filename if e.filename and str(e.filename) != str(out) else ''}); set output_dir to a "
        "folder you can write, on a filesystem every node shares."
    )


def claim_output_dir(out: Path, node_rank: int) -> RunLock:
    """output_dir must be a folder this node can create and write (checkpoints, metrics, logs). Node 0
    takes the run folder's lock (muonrun/launch/lock.py) before anything in it is touched, every other
    node its node rank's lock; each holds it until the `with` on the returned lock ends."""
    if out.exists() and not out.is_dir():
        raise UserError(f"output_dir '{out}' is a file, not a folder; set output_dir to a folder path.")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _unwritable(out, e) from None
    return RunLock(out, node_rank).acquire()


def check_fault_spec() -> None:
    """A drill's MUONRUN_FAULT that does not parse: refused here, not in every worker after start-up."""
    from muonrun import faults

    try:
        faults.parse(os.environ.get(faults.ENV))
    except ValueError as e:
        raise UserError(
            f"{e}. Fix or unset {faults.ENV} (fault injection for drills: docs/checkpoints.md)."
        ) from None


def launch(cfg: Config) -> int:
    """Run the job described by a validated config; returns the process exit code."""
    from muonrun.checkpoint.resume import load_order
    from muonrun.config.inert import warn_inert
    from muonrun.data import check_data
    from muonrun.distributed import check_device, pick_device_type
    from muonrun.eval import check_tasks
    from muonrun.features import enabled
    from muonrun.model.build import check_model
    from muonrun.model.expert_parallel import check_expert_parallel
    from muonrun.model.tensor_parallel import check_tensor_parallel
    from muonrun.optim.groups import split_params

    check_device(cfg)
    check_fault_spec()
    plan = make_plan(cfg)
    if not plan.in_process:
        quiet_leak_warnings()  # before anything can start the resource tracker
    features = enabled(cfg)
    device_type = pick_device_type(cfg)
    for feature in features:
        feature.check(device_type)
    warn_inert(cfg, device_type)  # settings that do nothing on this device: one line each
    tokenizer = check_data(cfg)
    check_tasks(cfg, tokenizer)  # eval.tasks' files, record by record
    model = check_model(
        cfg.model, tokenizer.vocab_size, cfg.data.seq_len, features, cfg.train.router_z_loss_coef
    )
    check_tensor_parallel(cfg, model, features)
    check_expert_parallel(cfg, model, mesh_shape(cfg, plan.world_size)[1])
    if cfg.optimizer.name == "muon":  # its patterns against the (meta) model's parameters
        split_params(model, cfg.optimizer.muon.muon_patterns, cfg.optimizer.muon.adamw_patterns)
    config_yaml = to_yaml(cfg)
    out = Path(cfg.output_dir)
    check_output_dir(out, cfg.name, plan.node_rank)  # before anything is created there
    # a resume_from / init_from that names no checkpoint: refused here, not by every worker after spawn
    load_order(cfg.checkpoint.resume_from, cfg.checkpoint.init_from, out / "checkpoints")
    run_lock = claim_output_dir(out, plan.node_rank)  # before anything in output_dir is touched
    # OUTPUT_DIR/config.yaml is written by the training itself, once its checkpoint is loaded: a run
    # refused at resume leaves the folder's config as it was.
    with run_lock:
        if plan.node_rank == 0:
            mark_checkpoints_owner(out)  # a second run linking its checkpoints/ here is refused
        # the workers' parent (they die with it) and where MUONRUN_FAULT=term@STEP sends SIGTERM
        os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
        if plan.in_process:
            return _in_process(config_yaml)
        return _elastic(plan, config_yaml, out, cfg.checkpoint)


def _in_process(config_yaml: str) -> int:
    """The single worker, in this process (no process group port, no spawn)."""
    from muonrun.distributed import release_process_groups
    from muonrun.train.trainer import NonFiniteError, run_worker

    code, mistake = 0, None
    try:
        run_worker(config_yaml)
    except NonFiniteError as e:
        log.error(str(e))
        code = NON_FINITE_EXIT
    except UserError as e:
        mistake = e.with_traceback(None)  # its traceback's frames hold the trainer, and so its context's
        mistake.__context__ = None
    release_process_groups()
    if mistake is not None:
        raise mistake
    return code


# torch's agent turns the signals named here into an immediate stop of the workers (SignalException).
# muonrun handles the stop signals itself (muonrun/launch/supervise.py: the workers save on them), so the
# agent keeps only SIGXCPU, a CPU-time limit, where no time is left to save.
TORCH_HANDLES = "SIGXCPU"


def _elastic(plan: LaunchPlan, config_yaml: str, output_dir: Path, checkpoint: CheckpointConfig) -> int:
    import logging

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from muonrun.distributed import free_port

    endpoint = plan.rdzv_endpoint or f"127.0.0.1:{free_port()}"
    # This node's control folder: worker registrations and reports, torch's per-worker error files.
    # Inside the run folder (nothing of a launch is left elsewhere), removed when the launch ends.
    # Never through a link (muonrun/paths.py): the clean-up below would delete what it points to.
    control = own_folder(output_dir / CONTROL_DIR, "the launch's control folder") / f"node-{plan.node_rank}"
    stale = [control]
    if plan.node_rank == 0:  # and those of nodes a killed launch with more nodes left
        numbered = [(p, p.name.removeprefix("node-")) for p in (output_dir / CONTROL_DIR).glob("node-*")]
        stale += [p for p, n in numbered if n.isdigit() and int(n) >= plan.nnodes]
    for folder in stale:
        remove_own(folder)
    control.mkdir()
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
        # The agent stops a failed worker's peers at its next look; the supervisor names the worker
        # whose waiter speaks first (launch/supervise.py), so a peer stopped sooner than torch's 0.1 s
        # allows could be named instead on a loaded machine.
        monitor_interval=0.5,
        logs_specs=DefaultLogsSpecs(log_dir=str(control / "torchelastic")),
        signals_to_handle=TORCH_HANDLES,
    )
    # The agent logs each worker failure with its own traceback, and each worker it stops; muonrun reports
    # failures itself below.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    logging.getLogger("torch.multiprocessing").setLevel(logging.ERROR)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // plan.nproc_per_node)))
    if plan.max_restarts:
        # By default the agents share one worker store across restarts, still holding the dead workers'
        # addresses: a restarted rank can read a stale one and fail to connect (pytorch/pytorch#135712;
        # every time on several nodes, where only the failed node counts the restart). Unshared, rank 0
        # of each attempt hosts a fresh store on a fresh port.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if plan.nnodes > 1:
        _announce_node(plan, endpoint)
    os.environ[CONTROL_ENV] = str(control)  # the spawned workers inherit it
    # What torch's multiprocessing leaves in the temporary folder of the launcher's process (a stopped
    # worker's error file) goes into the control folder too.
    (control / "tmp").mkdir()
    tmp, tempfile.tempdir = tempfile.tempdir, str(control / "tmp")
    try:
        supervisor = Supervisor(
            control, output_dir, plan.max_restarts, checkpoint.resume_from, checkpoint.init_from
        )
        with supervisor:
            elastic_launch(lc, worker_entry)(config_yaml)
        code = 0
    except WorkersReported:
        reported = report_worker_errors(control / "reports")
        code = 1 if reported is None else reported
    except ChildFailedError as e:
        reported = report_worker_errors(control / "reports")
        code = _report_failure(e, supervisor.cause()) if reported is None else reported
    except SignalException as e:
        log.error(f"got {e.sigval.name}: the workers were stopped without saving.")
        code = 128 + int(e.sigval)
    except RendezvousError as e:
        log.error(
            f"the rendezvous '{plan.rdzv_id}' at {endpoint} ended ({type(e).__name__}: {e}); another node "
            "stopped the job or never joined: see its output."
        )
        code = 1
    except KeyboardInterrupt as e:  # a second Ctrl-C, or SIGQUIT (Quit): the workers are stopped already
        code, stopped = None, type(e)
    finally:
        tempfile.tempdir = tmp
        os.environ.pop(CONTROL_ENV, None)
        remove_own(control)
        with contextlib.suppress(OSError):
            control.parent.rmdir()  # when no other node's folder is left in it
    # An exception that stopped the agent kept it, and the queues and semaphores of the workers it
    # started, alive in its traceback's frames: free them while the interpreter is whole, or the
    # resource tracker warns of leaked semaphores at exit.
    gc.collect()
    if code is None:
        raise stopped
    return code


def _report_failure(e, cause: tuple[int, str] | None = None) -> int:
    """A worker crashed (nothing reported): one paragraph on the failure that caused it, exit code 1.
    `cause` (the supervisor's, `Supervisor.cause`): a worker killed by a signal, which is named rather
    than a peer that exited with an error because of it (its lost connection: gloo's "Connection reset
    by peer")."""
    killed = [(rank, f.signal_name()) for rank, f in sorted(e.failures.items()) if f.exitcode < 0]
    cause = cause or (killed[0] if killed else None)
    if cause is not None:
        rank, signal_name = cause
        log.error(
            f"worker rank {rank} failed (killed by {signal_name}); the other workers stopped with it. A rerun "
            "resumes from the latest checkpoint."
        )
        return 1
    rank, failure = e.get_first_failure()
    message = failure.message if isinstance(failure.message, str) else failure.message.get("message", "")
    log.error(f"worker rank {rank} failed (exit code {failure.exitcode}).\n{message}".rstrip())
    return 1


def report_worker_errors(folder: Path) -> int | None:
    """After a stopped job: print the user mistakes, non-finite steps and early stops the workers reported
    (each distinct message once) and return the exit code they call for; None if no worker reported one.

    The reports decide, not the workers' exit statuses: the launcher stops every worker once one
    reports (the others die of its SIGKILL)."""
    reports = sorted(folder.glob(REPORTS))
    if not reports:
        return None
    codes = {int(p.name.removeprefix("exit").split("-")[0]) for p in reports}
    for message in dict.fromkeys(p.read_text() for p in reports):
        (log.info if codes == {STOPPED_EXIT} else log.error)(message)
    return next(c for c in (USER_ERROR_EXIT, NON_FINITE_EXIT, *sorted(codes)) if c in codes)


def split_endpoint(endpoint: str, default_port: int = 29500) -> tuple[str, int]:
    """HOST:PORT (an IPv6 host in brackets: [::1]:29500) as (host, port)."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or "]" in port:  # no port, or the colons of a bare IPv6 address
        host, port = endpoint, ""
    host = host.strip("[]") or "localhost"
    if port and not (port.isdigit() and 1 <= int(port) <= 65535):
        raise UserError(
            f"--rdzv-endpoint '{endpoint}' (launch.rdzv_endpoint) is not HOST:PORT with a port in 1..65535; "
            "e.g. node0.cluster:29500."
        )
    return host, int(port) if port else default_port


def check_endpoint_resolves(endpoint: str, node_rank: int) -> None:
    """Every node must find the rendezvous host's address; torch would retry for minutes, then fail with
    pages of C++ frames."""
    import socket

    host, _ = split_endpoint(endpoint)
    try:
        socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError as e:
        raise UserError(
            f"--rdzv-endpoint '{endpoint}' (launch.rdzv_endpoint): its host '{host}' does not resolve on this "
            f"machine (node {node_rank}: {e.strerror or e}). Give node 0's host name or address as the other "
            "nodes can reach it."
        ) from None


def check_endpoint_free(endpoint: str) -> None:
    """On node 0, which hosts the rendezvous: its port must be free, or torch would wait minutes on a
    program that is not a rendezvous and then fail with pages of C++ frames."""
    import socket

    _, port = split_endpoint(endpoint)
    for family, address in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's store does
                s.bind((address, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise UserError(
                    f"--rdzv-endpoint {endpoint} (launch.rdzv_endpoint): port {port} is already in use on this "
                    "machine, which as node 0 hosts the rendezvous there. Pick a free port (the same on every "
                    "node), or stop the program that holds it."
                ) from None
            if family == socket.AF_INET6:
                continue  # no IPv6 on this machine
            raise


def names_this_machine(host: str) -> bool:
    """Whether `host` resolves to an address of this machine (one a socket can bind to)."""
    import socket

    try:
        addresses = {(ai[0], ai[4][0]) for ai in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except OSError:
        return False
    for family, address in addresses:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((address, 0))
            return True
        except OSError:
            continue
    return False


def _announce_node(plan: LaunchPlan, endpoint: str) -> None:
    """One line per node (a multi-node job's log shows every node joining), and a warning when node 0
    is not the machine the endpoint names: it would host the store where nobody looks for it."""
    import socket

    log.info(
        f"node {plan.node_rank} of {plan.nnodes} ({socket.gethostname()}): {plan.nproc_per_node} workers, "
        f"rendezvous '{plan.rdzv_id}' at {endpoint}{' (hosted here)' if plan.node_rank == 0 else ''}"
    )
    host, _ = split_endpoint(endpoint)
    if plan.node_rank == 0 and not names_this_machine(host):
        log.warning(
            f"this is node 0, which hosts the rendezvous, but the endpoint host '{host}' does not look like "
            "this machine; the other nodes will look for it there. Point --rdzv-endpoint at node 0."
        )
