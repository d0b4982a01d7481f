"""SLURM: the multi-node launch settings of a job step, read from its environment.

Inside `srun --ntasks-per-node=1 muonrun pretrain cfg.yaml` (one launcher per node; each starts its
node's workers) these fill the `launch.*` keys the preset, the overrides and the flags leave unset
(precedence: schema defaults < SLURM < preset < overrides < flags):

    launch.nnodes         SLURM_STEP_NUM_NODES, else SLURM_NNODES, else SLURM_JOB_NUM_NODES
    launch.node_rank      SLURM_NODEID
    launch.rdzv_endpoint  first host of SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST), expanded by
                          `scontrol show hostnames` or expand_hostlist(); port MUONRUN_RDZV_PORT or 29500
                          (more than one node only; one node takes a free local port)
    launch.rdzv_id        SLURM_JOB_ID

Only inside a job step (srun sets SLURM_STEP_ID): the batch shell of an sbatch job also carries
SLURM_NODEID=0 and the job's node count, and a launcher started there must not wait for nodes that
never come. `pytest tests/test_slurm.py` checks the mapping; tests/test_cluster.py runs
scripts/slurm/pretrain.sbatch with a fake srun.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping

from muonrun import log
from muonrun.errors import UserError

DEFAULT_PORT = 29500
PORT_ENV = "MUONRUN_RDZV_PORT"


def _split_top_level(text: str) -> list[str]:
    """Split at commas outside brackets: `a[1,3],b` -> [`a[1,3]`, `b`]."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "["
        depth -= ch == "]"
        if depth < 0:
            raise ValueError(f"unbalanced ']' in host list '{text}'")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced '[' in host list '{text}'")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_one(name: str) -> list[str]:
    """`rack[1-2]-n[01-02]` -> rack1-n01, rack1-n02, rack2-n01, rack2-n02 (zero padding kept)."""
    m = re.search(r"\[([^\[\]]*)\]", name)
    if not m:
        return [name]
    prefix, body, rest = name[: m.start()], m.group(1), name[m.end() :]
    values = []
    for item in body.split(","):
        lo, sep, hi = item.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range '{item}' in host list entry '{name}'")
        if not sep:
            values.append(lo)
            continue
        width = len(lo) if lo.startswith("0") else 0
        values += [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
    return [prefix + v + tail for v in values for tail in _expand_one(rest)]


def expand_hostlist(hostlist: str) -> list[str]:
    """SLURM's compressed host list (`node[01-03,07],gpu5`) as host names, in order."""
    return [host for part in _split_top_level(hostlist) for host in _expand_one(part)]


def hostnames(hostlist: str) -> list[str]:
    """`scontrol show hostnames` when it is there and works (site-specific forms), else expand_hostlist()."""
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(
                ["scontrol", "show", "hostnames", hostlist], capture_output=True, text=True, timeout=30
            )
            if out.returncode == 0 and out.stdout.split():
                return out.stdout.split()
        except (OSError, subprocess.TimeoutExpired):
            pass
    try:
        return expand_hostlist(hostlist)
    except ValueError as e:
        raise UserError(
            f"SLURM node list '{hostlist}' cannot be read ({e}); pass --rdzv-endpoint HOST:PORT."
        ) from None


def _first(env: Mapping[str, str], *names: str) -> str | None:
    return next((env[n] for n in names if env.get(n)), None)


def in_job_step(env: Mapping[str, str]) -> bool:
    """True inside an srun job step (not in the batch shell of an sbatch job, nor outside SLURM)."""
    return bool(env.get("SLURM_JOB_ID")) and bool(_first(env, "SLURM_STEP_ID", "SLURM_STEPID"))


def launch_defaults(env: Mapping[str, str] | None = None, endpoint_given: bool = False) -> dict[str, object]:
    """{dotted `launch.*` key: value} from a SLURM job step's environment; {} outside one.
    `endpoint_given`: the flags or overrides set launch.rdzv_endpoint, so the node list is not read
    (it would be overridden anyway, and a list it cannot read must not refuse the run).

    Raises UserError when srun started several tasks on a node: muonrun starts the workers itself."""
    env = os.environ if env is None else env
    if not in_job_step(env):
        nodes = _first(env, "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
        if env.get("SLURM_JOB_ID") and nodes and int(nodes) > 1:
            log.warning(
                f"this is a {nodes}-node SLURM job but not an srun step: running on this node only. Start one "
                "launcher per node with `srun --ntasks-per-node=1 muonrun pretrain ...`."
            )
        return {}
    nnodes = int(_first(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES") or 1)
    tasks = _first(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    if tasks and int(tasks) != nnodes:
        raise UserError(
            f"srun started {tasks} tasks on {nnodes} node(s), but muonrun starts its workers itself: run ONE "
            "task per node (`srun --ntasks-per-node=1 muonrun pretrain ...`) and set the workers per node with "
            "--nproc-per-node (default: every GPU the node has)."
        )
    values: dict[str, object] = {
        "launch.nnodes": nnodes,
        "launch.node_rank": int(env.get("SLURM_NODEID", "0")),
    }
    nodelist = _first(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    if nodelist and nnodes > 1 and not endpoint_given:  # one node: a free local port, as outside SLURM
        port = env.get(PORT_ENV) or str(DEFAULT_PORT)
        if not (port.isdigit() and 1 <= int(port) <= 65535):
            raise UserError(f"{PORT_ENV}='{port}' is not a port number (1..65535).")
        values["launch.rdzv_endpoint"] = f"{hostnames(nodelist)[0]}:{port}"
    values["launch.rdzv_id"] = env["SLURM_JOB_ID"]
    return values
