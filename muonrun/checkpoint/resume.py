"""Which checkpoint a run resumes, and whether it may: the settings a resume must keep, the base model
it must share (`identity`), and the line of checkpoints a `checkpoint.resume_from` starts (each records
where it started, so rerunning the same command continues it; the checkpoints it went back from are set
aside). Used by the checkpointer at load (docs/checkpoints.md, "Resume rules"), and by the launcher to
refuse a `resume_from` or `init_from` that names no checkpoint before any worker starts (`load_order`)."""

from __future__ import annotations

from pathlib import Path

from muonrun import log
from muonrun.checkpoint.files import (
    CONFIG,
    DamagedCheckpoint,
    fsync_dir,
    published_checkpoints,
    read_meta,
    resolve_checkpoint,
    step_of,
)
from muonrun.config import differences
from muonrun.errors import UserError

# The settings that decide which tensors a checkpoint holds, and their shapes.
STATE_SHAPING = (
    "model",
    "optimizer.name",
    "optimizer.muon.variant",
    "optimizer.muon.muon_patterns",
    "optimizer.muon.adamw_patterns",
)
# Of those, the ones a resume may change: how the same model is computed or first built. Every other
# change is refused before loading, because a load cannot catch them all: one with fewer layers reads a
# subset of the checkpoint's tensors, and another split of the same weights into heads reads them all.
RESUME_MAY_CHANGE = (
    "model.attn_implementation",
    "model.init",
    "model.name_or_path",
    "model.trust_remote_code",
)


def resume_key(setting: str) -> str:
    """How a checkpoint records the checkpoint.resume_from its run started from: the absolute path."""
    return str(Path(setting).expanduser().resolve())


def started_from(checkpoint: Path) -> str | None:
    """The checkpoint.resume_from (`resume_key`) the run that saved it started from, if any."""
    try:
        return read_meta(checkpoint).get("started_from")
    except DamagedCheckpoint:  # found and named when it is verified
        return None


def load_order(resume_from: str | None, init_from: str | None, root: Path) -> list[tuple[str, str, bool]]:
    """What a run with these settings loads, in the order to try: ``[(kind, path, explicit)]``, kind
    "resume" or "init" (`checkpoint.init_from`: weights only), explicit when the path is the setting's own.
    With `resume_from`: the checkpoints this run saved since it started from there (`root` holds them;
    newest first), then that checkpoint; else the newest of `root`'s first; else `init_from`'s; else none.
    A setting that names no checkpoint when it is needed raises a UserError naming its key (the launcher
    calls this before any worker starts, rank 0 again at load)."""
    found = published_checkpoints(root)
    key = "checkpoint.resume_from" if resume_from else "checkpoint.init_from"
    try:
        if resume_from:
            line = [p for p in found if started_from(p) == resume_key(resume_from)]
            order = [("resume", str(p), False) for p in reversed(line)]
            try:
                order.append(("resume", str(resolve_checkpoint(resume_from)), True))
            except UserError:
                if not line:  # a rerun continues its own line though the first checkpoint is gone
                    raise
            return order
        if found:
            return [("resume", str(p), False) for p in reversed(found)]
        return [("init", str(resolve_checkpoint(init_from)), True)] if init_from else []
    except UserError as e:
        raise UserError(f"{key}: {e}") from None


def set_aside_later_steps(root: Path, start: Path, step: int) -> None:
    """A run started from an earlier checkpoint than this folder's newest: the later ones continue
    the line it went back from. Renamed `step-N.abandoned` (kept, never resumed from or pruned), so
    a rerun resumes this run's own line, not that one."""
    later = [p for p in published_checkpoints(root) if step_of(p) > step and p != start]
    for path in later:
        aside, n = path.with_name(f"{path.name}.abandoned"), 1
        while aside.exists():  # an earlier going-back set one aside already: keep both
            n += 1
            aside = path.with_name(f"{path.name}.abandoned-{n}")
        path.rename(aside)
        log.warning(
            f"{path} (after step {step}, where this run starts from {start}) was set aside as "
            f"{aside.name}, not deleted: it continues the training this run went back from."
        )
    if later:
        fsync_dir(root)


# Architecture keys (`model.build.architecture_of`) a warm start (`checkpoint.init_from`) may change: how
# far positions reach, dropout and the router's loss; the same tensors, read the same way.
INIT_MAY_CHANGE = (
    "attention_dropout",
    "layer_types",
    "max_position_embeddings",
    "max_window_layers",
    "output_router_logits",
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "router_aux_loss_coef",
    "sliding_window",
    "use_sliding_window",
)


def check_architecture(path: Path, architecture: dict | None, kind: str) -> None:
    """Refuse a checkpoint trained on another architecture than the transformers config this run
    resolves (`kind`: "resume", or "init" for `checkpoint.init_from`, which may change `INIT_MAY_CHANGE`).
    It catches what config.yaml cannot: `model.name_or_path`'s config.json or transformers' defaults
    changing under the same settings. Keys only one side has (another transformers version) are not
    compared; checkpoints saved before the architecture was recorded have nothing to compare."""
    saved = read_meta(path).get("architecture")
    if not saved or not architecture:
        return
    changed = [
        f"{k}: {saved[k]!r} -> {architecture[k]!r}"
        for k in sorted(saved.keys() & architecture.keys())
        if saved[k] != architecture[k] and not (kind == "init" and k in INIT_MAY_CHANGE)
    ]
    if not changed:
        return
    what = "loads weights only into the same model" if kind == "init" else "resumes the model it trained"
    raise UserError(
        f"Checkpoint '{path}' was trained on another model than this run builds: its transformers config "
        f"differs (saved -> now): {_listed(changed)}. That comes from model.name_or_path's config.json, "
        f"transformers' defaults or model.hf; a run {'(checkpoint.init_from) ' if kind == 'init' else ''}{what}. "
        "Restore that config.json, set the keys back under model.hf (e.g. model.hf.KEY=SAVED), or start a new "
        "output_dir without the checkpoint."
    )


def check_identity(path: Path, identity: dict[str, dict]) -> None:
    """Refuse a checkpoint saved on top of something else than this run (another base model)."""
    saved = read_meta(path).get("identity", {})
    keys = sorted(saved.keys() | identity.keys())
    if all(saved.get(k, {}).get("fingerprint") == identity.get(k, {}).get("fingerprint") for k in keys):
        return

    def describe(identity: dict, key: str) -> str:
        if key not in identity:
            return f"no {key}"
        entry = identity[key]
        return f"{key} '{entry.get('name_or_path')}' (fingerprint {str(entry.get('fingerprint'))[:12]})"

    theirs = ", ".join(describe(saved, k) for k in keys)
    ours = ", ".join(describe(identity, k) for k in keys)
    raise UserError(
        f"Checkpoint '{path}' was saved on {theirs}, but this run has {ours}. Its weights only make sense "
        "on what they were trained on: set model.name_or_path (and model.lora) as in that run, or start "
        "a new output_dir."
    )


def _changed(path: Path, config_yaml: str | None) -> list[str]:
    """`key: OLD -> NEW` for the STATE_SHAPING settings this run changed since the checkpoint was saved
    (none when the checkpoint carries no config)."""
    saved = path / CONFIG
    if config_yaml is None or not saved.is_file():
        return []
    return differences(saved.read_text(), config_yaml, STATE_SHAPING)


def check_settings(path: Path, config_yaml: str | None) -> None:
    """Refuse to resume a checkpoint saved with another model or optimizer (its config.yaml against
    this run's; model.name_or_path is checked by its fingerprint, `check_identity`)."""
    changed = [
        d
        for d in _changed(path, config_yaml)
        if not any(d.startswith((f"{k}:", f"{k}.")) for k in RESUME_MAY_CHANGE)
    ]
    if changed:
        raise UserError(
            f"Checkpoint '{path}' was saved by another model or optimizer than this run's: these settings "
            f"changed since (saved -> now): {_listed(changed)}. A run resumes the model it trained: set them back, or "
            "start a new output_dir (checkpoint.init_from loads weights only, into the same model)."
        )


def check_model_state(path: Path, keys: set[str], config_yaml: str | None) -> None:
    """The model state a checkpoint holds must be this run's, key for key: a tensor only the checkpoint
    has would be dropped without a word (a feature's state, such as the router biases of
    train.router_bias_update_rate, turned off since), one only this run has cannot be resumed (turned on
    since). Refused naming the tensors and the settings that changed since the save."""
    from muonrun.checkpoint.safe import SafeReader

    meta = SafeReader(str(path)).read_metadata().state_dict_metadata
    saved = {k[len("model.") :] for k in meta if k.startswith("model.")}
    dropped, lacking = sorted(saved - keys), sorted(keys - saved)
    if not dropped and not lacking:
        return
    what = []
    if dropped:
        what.append(f"it holds model state this run does not have and would drop: {_listed(dropped)}")
    if lacking:
        what.append(f"this run has model state it does not hold: {_listed(lacking)}")
    changed = []
    saved_config = path / CONFIG
    if config_yaml is not None and saved_config.is_file():
        changed = differences(saved_config.read_text(), config_yaml, ("model", "train", "parallel"))
        changed = [c for c in changed if not c.startswith(("train.max_steps:", "train.eval_"))]
    since = (
        f"These settings changed since it was saved (saved -> now): {_listed(changed)}; set back the one "
        "that turned that state on or off"
        if changed
        else "Resume with the settings it was saved with"
    )
    raise UserError(
        f"Checkpoint '{path}' does not hold this run's model state: {'; and '.join(what)}. {since}, or start a "
        "new output_dir (checkpoint.init_from loads weights only)."
    )


def changed_settings(path: Path, config_yaml: str | None) -> str:
    """The model/optimizer settings in which this run differs from the config the checkpoint was saved
    with (a sentence, or nothing when the checkpoint carries no config)."""
    try:
        changed = _changed(path, config_yaml)
    except Exception:  # noqa: BLE001 (only ever on the way to an error: say less rather than fail)
        return ""
    return (
        f"Since that checkpoint was saved these settings changed (saved -> now): {_listed(changed)}. "
        if changed
        else ""
    )


def _listed(changed: list[str]) -> str:
    return "; ".join(changed[:5]) + (f"; and {len(changed) - 5} more" if len(changed) > 5 else "")
