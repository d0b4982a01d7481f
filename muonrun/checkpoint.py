"""Distributed checkpoints in OUTPUT_DIR/checkpoints/step-N/: complete or absent. See docs/checkpoints.md.

    muonrun pretrain tiny checkpoint.interval=50          # saves step-50, step-100, ...; rerun to resume
    muonrun export runs/tiny/checkpoints/step-150 hf/     # a Hugging Face folder

A checkpoint is one DCP save (model, optimizer states, step and tokens seen; sharded, so it loads at
any world size) plus one small file per rank (data-loader position and RNG states). Every rank writes
into `step-N.tmp/`; after a barrier rank 0 checks that every rank's file is there (the folder must be
on a filesystem all nodes share), writes `muonrun.json` and renames the folder to `step-N/`. The
rename is atomic, so a crash at any point leaves at most a `.tmp` folder, which loading ignores and
the next run deletes. Old checkpoints are pruned (renamed away, then deleted) only after a new one
is published.

Start-up, in order of precedence: resume (checkpoint.resume_from, else the latest complete checkpoint
of output_dir) > checkpoint.init_from (weights only) > model.init=pretrained (HF safetensors, each rank
reading only its own shard) > random init.

Preemption: SIGTERM or SIGUSR1 only sets a flag; ranks agree on it (all-reduce MAX) after every step,
save at that step and exit 0. `muonrun.launch` forwards the signals from the launcher to the workers.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from muonrun import faults
from muonrun.config import Config
from muonrun.distributed import Dist
from muonrun.errors import UserError

if TYPE_CHECKING:
    from muonrun.trainer import Trainer

STEP_DIR = re.compile(r"^step-(\d+)$")
META = "muonrun.json"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# Threads writing each rank's share of a checkpoint (DCP's FileSystemWriter: one file per thread). DCP's
# default of 1 left a fast disk idle: on 2 x H200 synchronous saves went 8.2-9.7 -> 5.8 s (0.5B, 5.5 GiB)
# and 19.1 -> 13.3 s (1.5B, 17.3 GiB, the disk's own fsynced write speed); 8 threads were no faster
# (docs/benchmarks.md, run 19).
WRITER_THREADS = 4


def storage_writer(path: Path) -> dcp.FileSystemWriter:
    return dcp.FileSystemWriter(path, thread_count=WRITER_THREADS)


# ---------------------------------------------------------------- finding checkpoints (no process group)


def is_complete(path: Path) -> bool:
    """Published by rank 0: a `step-N` name, DCP's `.metadata` and our `muonrun.json`."""
    return bool(STEP_DIR.match(path.name)) and (path / ".metadata").is_file() and (path / META).is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under OUTPUT_DIR/checkpoints, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(STEP_DIR.match(p.name).group(1)), p) for p in root.iterdir() if is_complete(p)]
    return [p for _, p in sorted(found)]


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A complete step-N folder, or a run folder / its checkpoints folder (-> the latest complete one)."""
    path = Path(path)
    if is_complete(path):
        return path
    for root in (path / "checkpoints", path):
        found = complete_checkpoints(root)
        if found:
            return found[-1]
    if path.name.endswith(".tmp") or (path.is_dir() and STEP_DIR.match(path.name)):
        raise UserError(
            f"Checkpoint '{path}' is incomplete (its save was interrupted); use an earlier step-N folder."
        )
    raise UserError(
        f"'{path}' is not a muonrun checkpoint: give a complete OUTPUT_DIR/checkpoints/step-N folder "
        "(with .metadata and muonrun.json inside), or a run folder that holds one."
    )


def read_run_config(checkpoint: Path) -> Config:
    """The config of the run that wrote a checkpoint: OUTPUT_DIR/config.yaml, two levels up."""
    from muonrun.config import from_yaml, to_object

    path = checkpoint.resolve().parent.parent / "config.yaml"
    if not path.is_file():
        raise UserError(
            f"'{path}' is missing: the run folder of checkpoint '{checkpoint}' must hold its config.yaml."
        )
    return to_object(from_yaml(path.read_text()))


def rank_state_file(checkpoint: Path, rank: int, world_size: int) -> Path:
    """The data-loader/RNG file a rank resumes from. Same world size: its own. Otherwise rank 0's: a
    map-style loader's position is a global cursor, identical on every rank, so it serves any new rank;
    a streaming loader's position is per rank and its load_state_dict refuses the mismatch with a
    UserError (resume streaming data on the same number of ranks)."""
    saved_by = json.loads((checkpoint / META).read_text())["world_size"]
    return checkpoint / f"rank{rank if saved_by == world_size else 0}.pt"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, write) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _log(msg: str, loud: bool = False) -> None:
    print(f"muonrun: {'WARNING: ' if loud else ''}{msg}", file=sys.stderr if loud else sys.stdout, flush=True)


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """{alias: canonical name} of parameters registered twice (a tied LM head -> the input embedding)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def drop_aliases(model: torch.nn.Module, sd: dict) -> dict:
    """Save a tied tensor once (Qwen2-0.5B's tied head would otherwise add 0.5 GB of fp32 per checkpoint)."""
    aliases = tied_aliases(model)
    return {k: v for k, v in sd.items() if k not in aliases}


def add_aliases(model: torch.nn.Module, sd: dict) -> dict:
    return {**sd, **{alias: sd[name] for alias, name in tied_aliases(model).items() if name in sd}}


# ---------------------------------------------------------------- preemption flag


class StopFlag:
    """SIGTERM/SIGUSR1 handlers that only set a flag (a handler must not save: it may interrupt a
    collective). Previous handlers come back on `restore()`."""

    def __init__(self):
        self.raised: int | None = None
        self._previous = {}
        for sig in STOP_SIGNALS:
            # ValueError outside the main thread (an embedding application): no preemption support there.
            with contextlib.suppress(ValueError):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.raised = signum

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


# ---------------------------------------------------------------- the checkpointer


class Checkpointer:
    def __init__(self, cfg: Config, d: Dist):
        self.cfg = cfg
        self.dist = d
        self.root = Path(cfg.output_dir) / "checkpoints"
        self.flag = StopFlag()
        self._published: int | None = None
        self._stopping = False
        self._pending = None  # (step, tmp, final, tokens_seen, future) of an async save
        # Async saves run their collectives in a background thread: give them their own gloo group so
        # they never interleave with the training collectives on the default group.
        self._pg = dist.new_group(backend="gloo") if cfg.checkpoint.async_save else None

    # -- asked by the trainer after every step

    def due(self, step: int) -> bool:
        interval = self.cfg.checkpoint.interval
        return bool(interval) and step % interval == 0

    def local_flags(self) -> list[float]:
        """[this rank got SIGTERM/SIGUSR1, this rank's async write is still running]. The trainer
        reduces them (MAX) over all ranks in the one per-step collective it already makes for the
        non-finite check, then hands the agreed values to `agree`."""
        writing = self._pending is not None and not self._pending[-1].done()
        return [float(self.flag.raised is not None), float(writing)]

    def agree(self, stop: float, writing: float) -> None:
        """Act on the flags agreed by every rank: publish a finished async save (at the same step on
        every rank) and remember whether to stop."""
        if self._pending is not None and not writing:
            self._finish_pending()
        self._stopping = stop > 0

    def stop_requested(self) -> bool:
        """Whether any rank got SIGTERM/SIGUSR1 (as agreed in the last step's collective)."""
        return self._stopping

    def has(self, step: int) -> bool:
        pending = self._pending is not None and self._pending[0] == step
        return pending or self._published == step or is_complete(self.root / f"step-{step}")

    # -- save

    def _app_state(self, trainer: Trainer) -> dict:
        model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizers)
        return {
            "model": drop_aliases(trainer.model, model_sd),
            "optim": optim_sd,
            "train": trainer.state.state_dict(),
        }

    def _rank_state(self, trainer: Trainer) -> dict:
        rng = {"cpu": torch.get_rng_state()}
        if self.dist.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.dist.device)
        return {"loader": trainer.loader.state_dict(), "rng": rng, "world_size": self.dist.world_size}

    def save(self, trainer: Trainer) -> Path:
        """Write step-N.tmp on every rank, then publish it as step-N (collective)."""
        self._finish_pending()
        step, cfg = trainer.state.step, self.cfg
        final, tmp = self.root / f"step-{step}", self.root / f"step-{step}.tmp"
        if self.dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        extra = self._rank_state(trainer)
        _write_synced(tmp / f"rank{self.dist.rank}.pt", lambda f: torch.save(extra, f))
        state = self._app_state(trainer)
        last = step >= cfg.train.max_steps or self._stopping  # agreed by all ranks: all save the same way
        if cfg.checkpoint.async_save and not last:
            # Staging copies the state to CPU memory before async_save returns; the write runs behind
            # the next training steps and is published at the next save (or at the end).
            response = dcp.async_save(state, storage_writer=storage_writer(tmp), process_group=self._pg)
            future = getattr(response, "upload_completion", response)
            self._pending = (step, tmp, final, trainer.state.tokens_seen, future)
            faults.during_save(step, self.dist.rank)
            return final
        started = time.perf_counter()
        dcp.save(state, storage_writer=storage_writer(tmp))
        faults.during_save(step, self.dist.rank)
        self._publish(step, tmp, final, trainer.state.tokens_seen, time.perf_counter() - started)
        return final

    def _finish_pending(self) -> None:
        if self._pending is None:
            return
        step, tmp, final, tokens_seen, future = self._pending
        self._pending = None
        started = time.perf_counter()
        future.result()
        self._publish(step, tmp, final, tokens_seen, time.perf_counter() - started)

    def _publish(self, step: int, tmp: Path, final: Path, tokens_seen: int, seconds: float) -> None:
        dist.barrier()  # every rank's files are written and closed
        if self.dist.is_main:
            self._check_shared(tmp)
            meta = {
                "step": step,
                "tokens_seen": tokens_seen,
                "world_size": self.dist.world_size,
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "torch": torch.__version__,
            }
            _write_synced(tmp / META, lambda f: f.write(json.dumps(meta, indent=1).encode()))
            replaced = None
            if final.exists():  # a rerun from an older checkpoint reaches this step again
                replaced = final.with_name(f"{final.name}.replaced")
                shutil.rmtree(replaced, ignore_errors=True)
                final.rename(replaced)
            tmp.rename(final)  # the publish: atomic on POSIX filesystems, Lustre, GPFS and NFS
            _fsync(self.root)
            if replaced is not None:
                shutil.rmtree(replaced, ignore_errors=True)
            self._prune()
            _log(f"checkpoint {final} saved ({seconds:.1f}s)")
        dist.barrier()
        self._published = step

    def _check_shared(self, tmp: Path, wait_s: float = 30.0) -> None:
        """Every rank's file must be visible to rank 0; otherwise output_dir is node-local."""
        deadline = time.monotonic() + wait_s
        while True:
            missing = [r for r in range(self.dist.world_size) if not (tmp / f"rank{r}.pt").is_file()]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise UserError(
                    f"Rank 0 cannot see the checkpoint files of ranks {missing[:8]} in '{tmp}': output_dir must "
                    "be on a filesystem shared by every node (set output_dir to a shared path)."
                )
            time.sleep(0.5)

    def _prune(self) -> None:
        for old in complete_checkpoints(self.root)[: -self.cfg.checkpoint.keep_last]:
            doomed = old.with_name(f"{old.name}.deleting")  # never a half-deleted step-N folder
            old.rename(doomed)
            shutil.rmtree(doomed, ignore_errors=True)

    # -- load

    def _choose(self) -> tuple[str, Path] | None:
        """('resume' | 'init', path), decided by rank 0 and broadcast, so every rank loads the same one."""
        ck = self.cfg.checkpoint
        choice = None
        if self.dist.is_main:
            for junk in self.root.glob("step-*.*") if self.root.is_dir() else []:
                if junk.is_dir() and junk.suffix in (".tmp", ".deleting", ".replaced"):
                    shutil.rmtree(junk, ignore_errors=True)  # leftovers of an interrupted save or prune
            found = complete_checkpoints(self.root)
            try:
                if ck.resume_from:
                    choice = ("resume", str(resolve_checkpoint(ck.resume_from)))
                elif found:
                    choice = ("resume", str(found[-1]))
                elif ck.init_from:
                    choice = ("init", str(resolve_checkpoint(ck.init_from)))
            except UserError as e:  # raised on every rank below, not on rank 0 alone
                choice = ("error", f"checkpoint.{'resume_from' if ck.resume_from else 'init_from'}: {e}")
            if choice and choice[0] == "resume" and ck.init_from:
                _log(
                    f"checkpoint.init_from='{ck.init_from}' is IGNORED: resuming from {choice[1]} instead "
                    "(a run resumes its own checkpoints; use a new output_dir to start from init_from).",
                    loud=True,
                )
        box = [choice]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        if box[0] is not None and box[0][0] == "error":
            raise UserError(box[0][1])
        return None if box[0] is None else (box[0][0], Path(box[0][1]))

    def load(self, trainer: Trainer) -> Path | None:
        """Resume, or initialise the weights from init_from / pretrained weights; None for a fresh start."""
        choice = self._choose()
        if choice is None:
            if self.cfg.model.init == "pretrained":
                load_pretrained(trainer.model.lm, self.cfg.model.name_or_path, self.dist)
            return None
        kind, path = choice
        if kind == "init":
            sd = drop_aliases(trainer.model, get_model_state_dict(trainer.model))
            dcp.load({"model": sd}, checkpoint_id=path)
            set_model_state_dict(trainer.model, add_aliases(trainer.model, sd))
            if self.dist.is_main:
                _log(
                    f"weights initialised from {path} (checkpoint.init_from; optimizer and data start fresh)"
                )
            return path
        self._resume(trainer, path)
        return path

    def _resume(self, trainer: Trainer, path: Path) -> None:
        # Hyperparameters come from the current config, state from the checkpoint: keep the groups'
        # settings (peak_lr, weight_decay, betas, ...) across set_state_dict.
        settings = [
            [{k: v for k, v in g.items() if k != "params"} for g in o.param_groups]
            for o in trainer.optimizers
        ]
        state = self._app_state(trainer)
        try:
            dcp.load(state, checkpoint_id=path)
        except Exception as e:  # a different model or optimizer than the one that wrote it
            raise UserError(
                f"Checkpoint '{path}' does not fit this run's model/optimizer: {str(e).splitlines()[0][:300]} "
                "Resume with the same model and optimizer.name, or start a new output_dir "
                "(checkpoint.init_from loads weights only)."
            ) from None
        set_state_dict(
            trainer.model,
            trainer.optimizers,
            model_state_dict=add_aliases(trainer.model, state["model"]),
            optim_state_dict=state["optim"],
        )
        for opt, groups in zip(trainer.optimizers, settings, strict=True):
            for group, saved in zip(opt.param_groups, groups, strict=True):
                group.update(saved)
        trainer.state.load_state_dict(state["train"])
        extra = torch.load(rank_state_file(path, self.dist.rank, self.dist.world_size), weights_only=False)
        trainer.loader.load_state_dict(extra["loader"])
        torch.set_rng_state(extra["rng"]["cpu"])
        if "cuda" in extra["rng"] and self.dist.device.type == "cuda":
            torch.cuda.set_rng_state(extra["rng"]["cuda"], self.dist.device)
        self._published = trainer.state.step
        if self.dist.is_main:
            saved_by = json.loads((path / META).read_text())["world_size"]
            resharded = f" (saved by {saved_by} ranks, resharded)" if saved_by != self.dist.world_size else ""
            _log(f"resumed from {path} at step {trainer.state.step}{resharded}")

    # -- end

    def finish(self, trainer: Trainer) -> None:
        """After a normal end of training (collective): publish a pending async save, export if asked."""
        self._finish_pending()
        ck = self.cfg.checkpoint
        if (
            ck.export_at_end
            and trainer.state.step >= self.cfg.train.max_steps
            and self.has(trainer.state.step)
        ):
            if self.dist.is_main:
                out = export_hf(self.root / f"step-{trainer.state.step}", Path(self.cfg.output_dir) / "hf")
                _log(f"exported a Hugging Face model to {out}")
            dist.barrier()

    def close(self) -> None:
        """Also runs after an error: an unpublished async save is waited for (best effort) but never
        published, since the other ranks may be gone."""
        if self._pending is not None:
            with contextlib.suppress(Exception):
                self._pending[-1].result(timeout=600)
            self._pending = None
        self.flag.restore()


# ---------------------------------------------------------------- pretrained HF weights


def _hf_weight_files(name_or_path: str, d: Dist) -> dict[str, Path]:
    """{tensor name: safetensors file} of a local folder or a Hub repo (downloaded once per node)."""
    folder = Path(name_or_path)
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        patterns = ["*.safetensors", "*.safetensors.index.json", "config.json"]
        if d.local_rank == 0:
            snapshot_download(name_or_path, allow_patterns=patterns)
        dist.barrier()
        folder = Path(snapshot_download(name_or_path, allow_patterns=patterns))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        raise UserError(
            f"model.name_or_path '{name_or_path}' has no model.safetensors (or index); model.init=pretrained reads "
            "safetensors only: convert the weights with save_pretrained(..., safe_serialization=True)."
        )
    from safetensors import safe_open

    with safe_open(single, "pt") as f:
        return dict.fromkeys(f.keys(), single)


@torch.no_grad()
def load_pretrained(lm: torch.nn.Module, name_or_path: str, d: Dist) -> None:
    """Copy HF safetensors weights into a sharded model: each rank reads only the rows of its own
    shard (safe_open + get_slice on the memory-mapped file), never a full copy of the model."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    files = _hf_weight_files(name_or_path, d)
    params = list(lm.named_parameters())  # tied weights appear once, under the input embedding's name
    missing = [n for n, _ in params if n not in files]
    if missing:
        raise UserError(
            f"model.name_or_path '{name_or_path}' lacks {len(missing)} weights of the model, e.g. {missing[:3]}; "
            "model.hf overrides must not change the architecture of a pretrained model."
        )
    handles = {}
    for name, param in params:
        path = files[name]
        if path not in handles:
            handles[path] = safe_open(path, "pt", device="cpu")
        sl = handles[path].get_slice(name)
        if tuple(sl.get_shape()) != tuple(param.shape):
            raise UserError(
                f"Pretrained weight '{name}' has shape {tuple(sl.get_shape())}, the model {tuple(param.shape)}; "
                "model.hf overrides must not change the architecture of a pretrained model."
            )
        if isinstance(param, DTensor):
            local = param.to_local()
            shape, offset = compute_local_shape_and_global_offset(
                param.shape, param.device_mesh, param.placements
            )
        else:
            local, shape, offset = param, tuple(param.shape), (0,) * param.ndim
        if local.numel() == 0:
            continue
        index = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
        local.copy_(sl[index].to(device=local.device, dtype=local.dtype))
    if d.is_main:
        _log(f"weights loaded from {name_or_path} (model.init=pretrained)")


# ---------------------------------------------------------------- export


def load_model_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The full model tensors of a checkpoint, on one process without a process group (DCP no_dist),
    named as in the Hugging Face model (the `lm.` of muonrun's loss wrapper removed)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(checkpoint))
    meta = reader.read_metadata().state_dict_metadata
    prefix = "model.lm."
    sd = {
        key[len("model.") :]: torch.empty(m.size, dtype=m.properties.dtype)
        for key, m in meta.items()
        if key.startswith(prefix) and isinstance(m, TensorStorageMetadata)
    }
    assert sd, f"no model tensors in {checkpoint}"
    state = {"model": sd}
    with warnings.catch_warnings():  # "torch.distributed is disabled ... single process": intended
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    return {k[len("lm.") :]: v for k, v in state["model"].items()}


BYTE_TOKENIZER_NOTE = (
    "Tokenizer: muonrun's built-in byte-level tokenizer, so this folder has no tokenizer files. Token ids "
    "0-255 are the UTF-8 bytes of the text, 256 is end-of-document (EOS): encode with "
    "`list(text.encode('utf-8'))`, decode with `bytes(i for i in ids if i < 256).decode('utf-8', 'replace')`."
)


def export_hf(checkpoint: str | os.PathLike, out: str | os.PathLike, dtype: str = "float32") -> Path:
    """Write a Hugging Face folder (config.json, safetensors, tokenizer files or a README note) that
    `AutoModelForCausalLM.from_pretrained(out)` loads. Runs on one process; needs CPU memory for one
    full copy of the model in `dtype`."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    from muonrun.data import build_tokenizer
    from muonrun.model import build_hf_config

    checkpoint = resolve_checkpoint(checkpoint)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"Export folder '{out}' is not empty; choose a new folder.")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise UserError(f"Export dtype '{dtype}' is not one of float32, bfloat16, float16.")
    cfg = read_run_config(checkpoint)
    tok = build_tokenizer(cfg.data.tokenizer)
    hf_config = build_hf_config(cfg.model, tok.vocab_size)
    sd = {k: v.to(getattr(torch, dtype)).contiguous() for k, v in load_model_tensors(checkpoint).items()}
    if getattr(hf_config, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)  # transformers ties it back to the input embedding
    out.mkdir(parents=True, exist_ok=True)
    split = split_torch_state_dict_into_shards(
        sd, filename_pattern="model{suffix}.safetensors", max_shard_size="5GB"
    )
    for filename, names in split.filename_to_tensors.items():
        save_file({n: sd[n] for n in names}, out / filename, metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in sd.values())}}
        index["weight_map"] = split.tensor_to_filename
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    hf_config.dtype = dtype
    if cfg.data.tokenizer == "byte":
        hf_config.eos_token_id = tok.eos_token_id
        hf_config.bos_token_id = None
        hf_config.pad_token_id = None
        note = BYTE_TOKENIZER_NOTE
    else:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(cfg.data.tokenizer).save_pretrained(out)
        note = f"Tokenizer: `{cfg.data.tokenizer}` (files included)."
    hf_config.save_pretrained(out)
    meta = json.loads((checkpoint / META).read_text())
    (out / "README.md").write_text(
        f"# {cfg.name} (muonrun export)\n\nExported from `{checkpoint}` (step {meta['step']}, "
        f"{meta['tokens_seen']:,} training tokens), weights in {dtype}.\n\n{note}\n\n"
        "```python\nfrom transformers import AutoModelForCausalLM\n"
        f'model = AutoModelForCausalLM.from_pretrained("{out}")\n```\n'
    )
    return out
