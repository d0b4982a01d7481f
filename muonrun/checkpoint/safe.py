"""Reading a checkpoint without running code from it.

Checkpoints travel between clusters and teams, so a file in one must never be able to execute code
on the ranks that load it. Everything muonrun reads from a checkpoint goes through one of three
doors, none of which unpickles arbitrary objects:

- DCP's `.metadata` (a pickle written by torch.distributed.checkpoint): `SafeReader` unpickles it
  with an allow-list holding only DCP's metadata classes, `torch.Size`, dtypes and layouts;
- DCP's non-tensor items (step, tokens seen, optimizer hyperparameters), which DCP's default planner
  reads with `torch.load(weights_only=False)`: `SafePlanner` reads them with `weights_only=True`;
  DCP itself reads tensors that way already;
- each rank's `rankR.pt` (data-loader position, RNG states: plain containers, numbers, strings and
  CPU tensors): `torch.load(weights_only=True)`.

What is left to trust is torch's own weights-only unpickler (docs/checkpoints.md, "Trust").
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from muonrun.compat import dcp_metadata_path
from muonrun.errors import UserError

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS = {
    ("torch", "Size"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # a layout from its name, e.g. "torch.strided"
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class UntrustedFile(UserError):
    """A checkpoint file that would need to run code (or unknown objects) to load."""


def _refuse(path: Path | str, what: str) -> UntrustedFile:
    return UntrustedFile(
        f"Checkpoint file '{path}' was refused: {what}. muonrun never loads objects that could run code "
        "from a checkpoint; a file like this was not written by muonrun's save (it was crafted or damaged). "
        "Use a checkpoint from a source you trust, or check it with `muonrun checkpoint verify`."
    )


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == _DCP_METADATA and not name.startswith("__"):
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), torch.dtype | torch.layout | torch.memory_format
        ):
            return getattr(torch, name)
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}")


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader with the metadata unpickled through an allow-list. DCP reports a reader's
    error wrapped in its own collective exception, so the first refusal is also kept in `error`."""

    error: UserError | None = None

    def _fail(self, error: UserError) -> UserError:
        self.error = self.error or error
        return error

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(dcp_metadata_path(self, kwargs.get("rank")))
        if kwargs.get("rank") is not None and not path.exists():
            raise FileNotFoundError(path)  # DCP probes for optional per-rank metadata: not ours to report
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except pickle.UnpicklingError as e:
            raise self._fail(_refuse(path, str(e))) from None
        except Exception as e:  # truncated or garbled bytes
            raise self._fail(
                UserError(
                    f"Checkpoint file '{path}' cannot be read ({type(e).__name__}: {str(e)[:200]}); the checkpoint "
                    "is damaged. Use an earlier checkpoint."
                )
            ) from None
        if not isinstance(metadata, Metadata):
            raise self._fail(_refuse(path, f"it holds a {type(metadata).__name__}, not DCP metadata"))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor items with `torch.load(weights_only=True)`."""

    reader: SafeReader | None = None

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        data = value.read()
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except pickle.UnpicklingError as e:
            where = self.reader.storage_data[read_item.storage_index].relative_path if self.reader else "?"
            path = Path(self.reader.path) / where if self.reader else where
            what = str(e).strip().splitlines()[0][:200]
            error = _refuse(path, f"its item '{read_item.dest_index.fqn}' is not plain data ({what})")
            raise (self.reader._fail(error) if self.reader else error) from None
        # Proven to hold only what the weights-only unpickler admits: DCP's own code may read it now
        # (it places the value into the nested state dict).
        super().load_bytes(read_item, io.BytesIO(data))


def safe_load(state: dict, checkpoint: Path, no_dist: bool = False) -> None:
    """`dcp.load` through the safe reader and planner."""
    reader = SafeReader(str(checkpoint))
    planner = SafePlanner()
    planner.reader = reader
    # Read (and refuse) the metadata here first: refused inside DCP's load, it would print DCP's own
    # tracebacks as DCP falls back to looking for per-rank metadata.
    reader.read_metadata()
    try:
        dcp.load(state, storage_reader=reader, planner=planner, no_dist=no_dist)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if reader.error is not None:
            raise reader.error from None
        if isinstance(e, Exception):
            raise
        inner = [failure[0] for failure in getattr(e, "failures", {}).values()]
        raise RuntimeError(" ".join(str(inner[0] if inner else e).split())) from None


def load_rank_state(path: Path) -> dict:
    """A rank's data-loader/RNG file, read with torch's weights-only unpickler."""
    try:
        state = torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        raise _refuse(path, str(e).strip().splitlines()[0][:300]) from None
    except Exception as e:
        raise UserError(
            f"Checkpoint file '{path}' cannot be read ({type(e).__name__}: {str(e)[:200]}); the checkpoint is "
            "damaged. Use an earlier checkpoint."
        ) from None
    if not isinstance(state, dict):
        raise _refuse(path, f"it holds a {type(state).__name__}, not a rank's state")
    return state


def load_model_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The full model tensors of a checkpoint, on one process without a process group (DCP no_dist),
    named as in the Hugging Face model (the `lm.` of muonrun's loss wrapper removed)."""
    import warnings

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = SafeReader(str(checkpoint)).read_metadata().state_dict_metadata
    prefix = "model.lm."
    sd = {
        key[len("model.") :]: torch.empty(m.size, dtype=m.properties.dtype)
        for key, m in meta.items()
        if key.startswith(prefix) and isinstance(m, TensorStorageMetadata)
    }
    if not sd:
        raise UserError(
            f"Checkpoint '{checkpoint}' holds no model weights (model.lm.*); it is not a muonrun checkpoint."
        )
    state = {"model": sd}
    with warnings.catch_warnings():  # "torch.distributed is disabled ... single process": intended
        warnings.simplefilter("ignore", UserWarning)
        safe_load(state, checkpoint, no_dist=True)
    return {k[len("lm.") :]: v for k, v in state["model"].items()}
