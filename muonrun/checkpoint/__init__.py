"""Checkpoints: `checkpointer` (save, publish, verify-then-load, prune), `files` (layout on disk and
the checksum manifest), `safe` (reading without unpickling arbitrary objects), `states` (the stateful
parts), `stop` (stop requests). See docs/checkpoints.md.
"""

from muonrun.checkpoint.checkpointer import WRITER_THREADS, Checkpointer, rank_state_file
from muonrun.checkpoint.files import (
    CONFIG,
    META,
    DamagedCheckpoint,
    check_run_folder,
    checkpoints_of,
    is_published,
    published_checkpoints,
    read_meta,
    resolve_checkpoint,
    verify,
    write_run_config,
)
from muonrun.checkpoint.safe import UntrustedFile, load_model_tensors, load_rank_state
from muonrun.checkpoint.states import ModelState, OptimizerState, RNGState
from muonrun.checkpoint.stop import StopFlag

__all__ = [
    "CONFIG",
    "META",
    "WRITER_THREADS",
    "Checkpointer",
    "DamagedCheckpoint",
    "ModelState",
    "OptimizerState",
    "RNGState",
    "StopFlag",
    "UntrustedFile",
    "check_run_folder",
    "checkpoints_of",
    "published_checkpoints",
    "is_published",
    "load_model_tensors",
    "load_rank_state",
    "rank_state_file",
    "read_meta",
    "resolve_checkpoint",
    "verify",
    "write_run_config",
]
