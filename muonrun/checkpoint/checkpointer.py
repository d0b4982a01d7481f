"""The checkpointer: saves the stateful parts it is handed into OUTPUT_DIR/checkpoints/step-N, complete or
absent, and loads the newest one that verifies. See docs/checkpoints.md.

    muonrun pretrain tiny checkpoint.interval=50     # saves step-50, step-100, ...; rerun to resume

Save: every rank writes into `step-N.tmp/` (DCP for the sharded states, one `rankR.pt` for its own)
and hashes the files it wrote (with checkpoint.async_save, in the background after the write); after
a barrier rank 0 writes the manifest (`muonrun.json`) and renames the folder to `step-N/`. The rename
is atomic, so a crash at any point leaves at most a `.tmp` folder, which loading ignores and the next
run deletes. Old checkpoints are pruned only once
`keep_last` intact newer ones exist.

Load: `checkpoint.resume_from`, else the newest complete checkpoint of output_dir, else
`checkpoint.init_from` (weights only). Each candidate is verified against its manifest first (the
ranks split the reading); a damaged one is reported and skipped for the next newest, and is set aside
as `step-N.damaged` (never deleted) if the run later saves that step again. A damaged `resume_from`
or `init_from` is an error. Every file is read without unpickling arbitrary objects (safe.py).

Stop requests (SIGTERM/SIGUSR1, Ctrl-C) only set a flag; ranks agree on it after every step, save at
that step and stop.
"""

from __future__ import annotations

import contextlib
import json
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from muonrun import __version__, faults, log
from muonrun.checkpoint.files import (
    CONFIG,
    META,
    STEP_DIR,
    Verdict,
    fsync_dir,
    hash_files,
    prune,
    read_meta,
    seal,
    verify,
    write_synced,
)
from muonrun.checkpoint.resume import (
    changed_settings,
    check_architecture,
    check_identity,
    check_model_state,
    check_settings,
    load_order,
    resume_key,
    set_aside_later_steps,
    started_from,
)
from muonrun.checkpoint.room import save_room
from muonrun.checkpoint.safe import load_rank_state, safe_load
from muonrun.checkpoint.stop import StopFlag
from muonrun.config import CheckpointConfig
from muonrun.distributed import Dist
from muonrun.errors import UserError
from muonrun.paths import remove_own

# Threads writing each rank's share (DCP's FileSystemWriter: one file per thread). DCP's default of one
# leaves a fast disk idle; four reach a local NVMe disk's fsynced write speed, more do not help
# (docs/performance.md, "Checkpoints").
WRITER_THREADS = 4


def storage_writer(path: Path) -> dcp.FileSystemWriter:
    return dcp.FileSystemWriter(path, thread_count=WRITER_THREADS)


def rank_state_file(checkpoint: Path, rank: int, world_size: int) -> Path:
    """The data-loader/RNG file a rank resumes from. Same world size: its own. Otherwise rank 0's: a
    map-style loader's position is a global cursor, identical on every rank, so it serves any new rank;
    a streaming loader's position is per rank and its load_state_dict refuses the mismatch with a
    UserError (resume streaming data on the same number of ranks)."""
    saved_by = read_meta(checkpoint)["world_size"]
    return checkpoint / f"rank{rank if saved_by == world_size else 0}.pt"


@dataclass
class PendingSave:
    """An async save whose files are still being written (and then hashed) behind training."""

    step: int
    tmp: Path
    final: Path
    tokens_seen: int
    hashed: Future
    """This rank's file hashes and the seconds they took, once DCP's write finished."""


class Checkpointer:
    """Built from the parts it saves: `states` (sharded, through DCP) and `rank_states` (this rank's
    own: data position, RNG). The trainer tells it each step's number and tokens seen; before a step
    that `due` names it first makes sure the step may be saved (all ranks agreed it is finite).
    `identity` ({what: {"name_or_path": ..., "fingerprint": ...}}, e.g. a LoRA run's base model) is what
    the saved states only make sense on top of: written into every checkpoint, and a checkpoint whose
    fingerprints differ is refused at load. `config_yaml` (the run's resolved config) is saved into every
    checkpoint as config.yaml, covered by the manifest: the copy export reads, and what a checkpoint
    that does not fit this run is compared with to name the settings that changed. `architecture`
    (`model.build.architecture_of`, the resolved transformers config) goes into the manifest: resume and
    init_from refuse another one, and export rebuilds the model from it."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        root: Path,
        d: Dist,
        states: dict,
        rank_states: dict,
        identity: dict[str, dict] | None = None,
        config_yaml: str | None = None,
        architecture: dict | None = None,
    ):
        self.cfg, self.root, self.dist = cfg, root, d
        self.config_yaml = config_yaml
        self.architecture = architecture
        self.identity = identity or {}
        self.states, self.rank_states = states, rank_states
        self.flag = StopFlag()
        self._published: int | None = None
        self._stopping = False
        self._pending: PendingSave | None = None
        # An async save's files are hashed on this thread once written, so the training thread only
        # waits for the manifest and the rename.
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="muonrun-hash")
        self._damaged: set[Path] = set()  # found at load; set aside if the run saves their step again
        # The checkpoint.resume_from this run's line of checkpoints started from (written into each):
        # rerunning the same command continues that line instead of going back to its start.
        self._started_from: str | None = None
        self.timings = {"write_s": 0.0, "checksum_s": 0.0}  # of the last published save
        # Async saves run their collectives in a background thread: give them their own gloo group so
        # they never interleave with the training collectives on the default group.
        self._pg = dist.new_group(backend="gloo") if cfg.async_save else None

    @property
    def published_step(self) -> int | None:
        """The step of the newest checkpoint this run published or resumed from (all ranks agree)."""
        return self._published

    # -- asked by the trainer after every step

    def local_flags(self) -> list[float]:
        """[this rank got a stop signal, this rank's async write is still running]. The trainer reduces
        them (MAX) over all ranks in the one per-step collective it makes anyway, then hands the agreed
        values to `agree`."""
        writing = self._pending is not None and not self._pending.hashed.done()
        return [float(self.flag.raised is not None), float(writing)]

    def agree(self, stop: float, writing: float) -> None:
        """Act on the flags agreed by every rank: publish a finished async save (at the same step on
        every rank) and remember whether to stop."""
        if self._pending is not None and not writing:
            self._finish_pending()
        self._stopping = stop > 0

    def due(self, step: int, last: bool) -> bool:
        """Whether `after_step` may save at this step (the interval, a stop request, the last step): the
        trainer settles the step's agreement first, which may stop the run or raise the stop flag."""
        return last or self._stopping or (bool(self.cfg.interval) and step % self.cfg.interval == 0)

    def after_step(self, step: int, tokens_seen: int, last: bool) -> bool:
        """Save when the interval says so, when a stop was requested, or after the last step
        (checkpoint.save_at_end). Returns whether training must stop now."""
        interval = bool(self.cfg.interval) and step % self.cfg.interval == 0
        if (interval or self._stopping or (last and self.cfg.save_at_end)) and not self.has(step):
            self.save(step, tokens_seen, last=last or self._stopping)
        return self._stopping

    def has(self, step: int) -> bool:
        pending = self._pending is not None and self._pending.step == step
        return pending or self._published == step

    # -- save

    def save(self, step: int, tokens_seen: int, last: bool = True) -> Path:
        """Write step-N.tmp on every rank, then publish it as step-N (collective). `last`: write
        synchronously even with checkpoint.async_save (the run ends right after)."""
        self._finish_pending()
        final, tmp = self.root / f"step-{step}", self.root / f"step-{step}.tmp"
        with save_room(step, tmp, self.root, self._published):
            return self._save(step, tokens_seen, last, final, tmp)

    def _save(self, step: int, tokens_seen: int, last: bool, final: Path, tmp: Path) -> Path:
        if self.dist.is_main:
            remove_own(tmp)
            tmp.mkdir(parents=True)
            if self.config_yaml is not None:
                write_synced(tmp / CONFIG, self.config_yaml.encode())
        dist.barrier()
        own = {key: part.state_dict() for key, part in self.rank_states.items()}
        own["world_size"] = self.dist.world_size
        with open(tmp / f"rank{self.dist.rank}.pt", "wb") as f:
            torch.save(own, f)
            f.flush()
        state = {key: part.state_dict() for key, part in self.states.items()}
        if self.cfg.async_save and not last:
            # Staging copies the state to CPU memory before async_save returns; the write runs behind
            # the next training steps and is published at the next save (or at the end).
            response = dcp.async_save(state, storage_writer=storage_writer(tmp), process_group=self._pg)
            written = getattr(response, "upload_completion", response)
            hashed = self._hasher.submit(self._write_then_hash, written, tmp)
            self._pending = PendingSave(step, tmp, final, tokens_seen, hashed)
            faults.during_save(step, self.dist.rank)
            return final
        started = time.perf_counter()
        dcp.save(state, storage_writer=storage_writer(tmp))
        faults.during_save(step, self.dist.rank)
        written = time.perf_counter() - started
        dist.barrier()  # every rank's files are written and closed
        self._publish(step, tmp, final, tokens_seen, written, self._hash_own(tmp))
        return final

    def _write_then_hash(self, written: Future, tmp: Path) -> tuple[dict, float]:
        """Background job of an async save: wait for DCP's write, then hash this rank's files."""
        written.result()
        return self._hash_own(tmp)

    def _hash_own(self, tmp: Path) -> tuple[dict, float]:
        started = time.perf_counter()
        return hash_files(self._own_files(tmp)), time.perf_counter() - started

    def _finish_pending(self) -> None:
        if self._pending is None:
            return
        with save_room(self._pending.step, self._pending.tmp, self.root, self._published):
            self._publish_pending()

    def _publish_pending(self) -> None:
        pending, self._pending = self._pending, None
        started = time.perf_counter()
        own = pending.hashed.result()
        dist.barrier()  # every rank's files are written, closed and hashed
        self._publish(
            pending.step,
            pending.tmp,
            pending.final,
            pending.tokens_seen,
            time.perf_counter() - started,
            own,
            background=True,
        )

    def _own_files(self, tmp: Path) -> list[Path]:
        """The files this rank wrote (DCP names its files `__RANK_THREAD.distcp`); rank 0 also the metadata."""
        r = self.dist.rank
        mine = [tmp / f"rank{r}.pt", *sorted(tmp.glob(f"__{r}_*.distcp"))]
        return [*mine, tmp / ".metadata"] if self.dist.is_main else mine

    def _publish(
        self,
        step: int,
        tmp: Path,
        final: Path,
        tokens_seen: int,
        seconds: float,
        own: tuple[dict, float],
        background: bool = False,
    ) -> None:
        """Publish step-N.tmp as step-N (collective, after a barrier): `seconds` is how long the training
        thread waited for the write, `own` this rank's file hashes and how long they took, `background`
        whether both ran behind training (an async save)."""
        hashes = [None] * self.dist.world_size
        dist.all_gather_object(hashes, own[0])
        hash_seconds = own[1]
        self.timings = {"write_s": seconds, "checksum_s": hash_seconds}
        if self.dist.is_main:
            self._check_shared(tmp)
            files = {name: entry for part in hashes for name, entry in part.items()}
            unhashed = [p for p in tmp.iterdir() if p.name not in files]
            files.update(hash_files(unhashed))
            meta = {
                "step": step,
                "tokens_seen": tokens_seen,
                "world_size": self.dist.world_size,
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "torch": torch.__version__,
                "muonrun": __version__,
                "files": files,
            }
            if self.identity:
                meta["identity"] = self.identity
            if self.architecture:
                meta["architecture"] = self.architecture
            if self._started_from:
                meta["started_from"] = self._started_from
            write_synced(tmp / META, json.dumps(seal(meta), indent=1).encode())
            replaced = None
            if final.exists():  # a rerun from an earlier checkpoint reaches this step again
                if final in self._damaged:
                    aside = final.with_name(f"{final.name}.damaged")
                    remove_own(aside)
                    final.rename(aside)
                    self._damaged.discard(final)
                    log.warning(f"the damaged {final} was set aside as {aside.name} (not deleted)")
                else:
                    replaced = final.with_name(f"{final.name}.replaced")
                    remove_own(replaced)
                    final.rename(replaced)
            tmp.rename(final)  # the publish: atomic on POSIX filesystems, Lustre, GPFS and NFS
            fsync_dir(self.root)
            if replaced is not None:
                remove_own(replaced)
            prune(self.root, self.cfg.keep_last, self._damaged)
            how = "written and hashed in the background" if background else f"written in {seconds:.1f}s"
            log.info(f"checkpoint {final} saved ({how}; checksums {hash_seconds:.1f}s)")
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

    # -- load

    def _candidates(self) -> list:
        """[(kind, path, explicit)] to try in order, decided on rank 0 and broadcast."""
        ck = self.cfg
        result: list = []
        if self.dist.is_main:
            for junk in self.root.glob("step-*.*") if self.root.is_dir() else []:
                if junk.suffix in (".tmp", ".deleting", ".replaced"):
                    remove_own(junk)  # leftovers of an interrupted save or prune (a link: itself only)
            try:
                result = load_order(ck.resume_from, ck.init_from, self.root)
            except UserError as e:  # raised on every rank below, not on rank 0 alone
                result = [("error", str(e), True)]
            if ck.resume_from and result and not result[0][2]:
                log.info(
                    f"checkpoint.resume_from: this run started from '{ck.resume_from}' and has saved "
                    f"since; it continues from its own latest, {Path(result[0][1]).name}."
                )
            if result and result[0][0] == "resume" and ck.init_from:
                log.warning(
                    f"checkpoint.init_from='{ck.init_from}' is IGNORED: resuming from {result[0][1]} instead "
                    "(a run resumes its own checkpoints; use a new output_dir to start from init_from)."
                )
        box = [result]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def _verify(self, path: Path) -> Verdict:
        """Verify on every rank at once, each hashing its share of the files (collective)."""
        verdict = verify(path, share=(self.dist.rank, self.dist.world_size))
        problems = [verdict.problems]
        if dist.is_initialized() and dist.get_world_size() > 1:
            problems = [None] * self.dist.world_size
            dist.all_gather_object(problems, verdict.problems)
        verdict.problems = list(dict.fromkeys(p for part in problems for p in part))
        return verdict

    def _choose(self) -> tuple[str, Path] | None:
        candidates = self._candidates()
        skipped = []
        for kind, path, explicit in candidates:
            if kind == "error":
                raise UserError(path)
            path = Path(path)
            verdict = self._verify(path)
            if verdict.ok:
                if self.dist.is_main and skipped:
                    log.warning(f"resuming from {path}, the newest checkpoint that verifies.")
                return kind, path
            error = verdict.error()
            if explicit:
                raise error
            self._damaged.add(path)
            skipped.append(path)
            if self.dist.is_main:
                log.warning(f"{error} Skipped: trying the next newest checkpoint.")
        if skipped:
            raise UserError(
                f"No checkpoint in '{self.root}' verifies ({', '.join(p.name for p in skipped)} are damaged, see "
                "above), so this run cannot resume. Restore them from a copy, or move them away to start over."
            )
        return None

    def load(self) -> Path | None:
        """Resume everything, or (checkpoint.init_from) the model's weights only; the checkpoint used,
        or None for a fresh start."""
        choice = self._choose()
        if choice is None:
            return None
        kind, path = choice
        check_identity(path, self.identity)
        if kind == "init":
            check_architecture(path, self.architecture, kind)
            self._dcp_load({"model": self.states["model"]}, path)
            if self.dist.is_main:
                log.info(
                    f"weights initialised from {path} (checkpoint.init_from; optimizer and data start fresh)"
                )
            return path
        check_settings(path, self.config_yaml)  # first: it names the settings, where they changed
        check_architecture(path, self.architecture, kind)
        check_model_state(path, set(self.states["model"].state_dict()), self.config_yaml)
        self._dcp_load(dict(self.states), path)
        own = load_rank_state(rank_state_file(path, self.dist.rank, self.dist.world_size))
        for key, part in self.rank_states.items():
            if key in own or not getattr(part, "optional", False):  # optional: absent from older checkpoints
                part.load_state_dict(own[key])
        step = int(self.states["train"].state_dict()["step"])
        self._published = step
        if self.cfg.resume_from:
            self._started_from = resume_key(self.cfg.resume_from)
            if self.dist.is_main and started_from(path) != self._started_from:
                set_aside_later_steps(self.root, path, step)
        else:
            self._started_from = started_from(path)
        if self.dist.is_main:
            saved_by = read_meta(path)["world_size"]
            resharded = f" (saved by {saved_by} ranks, resharded)" if saved_by != self.dist.world_size else ""
            log.info(f"resumed from {path} at step {step}{resharded}")
        return path

    def _dcp_load(self, state: dict, path: Path) -> None:
        try:
            safe_load(state, path)
        except UserError:
            raise
        except Exception as e:  # a different model or optimizer than the one that wrote it
            raise UserError(
                f"Checkpoint '{path}' does not fit this run's model/optimizer: {str(e).splitlines()[0][:300]} "
                f"{changed_settings(path, self.config_yaml)}Resume with the same model and optimizer.name, or start a new "
                "output_dir (checkpoint.init_from loads weights only)."
            ) from None

    # -- end

    def finish(self) -> None:
        """After a normal end of training, or a stop on a non-finite step every rank agreed on
        (collective): publish a pending async save, which is of an earlier, finite step."""
        self._finish_pending()

    def close(self) -> None:
        """Also runs after an error: an unpublished async save is waited for (best effort) but never
        published, since the other ranks may be gone."""
        if self._pending is not None:
            with contextlib.suppress(Exception):
                self._pending.hashed.result(timeout=600)
            self._pending = None
        self._hasher.shutdown(wait=False)
        self.flag.restore()


__all__ = ["STEP_DIR", "WRITER_THREADS", "Checkpointer", "rank_state_file", "storage_writer"]
