"""`muonrun export CHECKPOINT_OR_RUN OUT`: a checkpoint as a folder `from_pretrained` loads, with the
run's features applied (a LoRA run's adapters merged, or written alone with `--adapter-only`).

    muonrun export runs/tiny hf/          # the latest checkpoint of runs/tiny as a Hugging Face model
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import torch

from muonrun.checkpoint import (
    CONFIG,
    check_run_folder,
    load_model_tensors,
    read_meta,
    resolve_checkpoint,
    verify,
)
from muonrun.config import Config
from muonrun.errors import UserError
from muonrun.features import ExportJob, enabled
from muonrun.paths import out_of_room, out_of_room_message, room_left_in, unwritable


def read_run_config(checkpoint: Path) -> Config:
    """The config a checkpoint was saved with: its own config.yaml (covered by its manifest, so a hand-edited
    or overwritten run config cannot change it); for a checkpoint written before checkpoints carried one,
    its run folder's config.yaml, two levels up (the export then checks the model fits its tensors)."""
    from muonrun.config import from_yaml

    path = checkpoint / CONFIG
    if not path.is_file():
        path = checkpoint.resolve().parent.parent / CONFIG
    if not path.is_file():
        raise UserError(
            f"Checkpoint '{checkpoint}' holds no {CONFIG} and its run folder has none either ('{path}' is "
            "missing): the model cannot be rebuilt without the config the checkpoint was trained with."
        )
    return from_yaml(path.read_text(), source=f"file '{path}'")


def check_export_folder(out: Path) -> None:
    """The export goes into a new folder (or an empty one), not into a run's checkpoints."""
    check_run_folder(out, "Export folder")
    problem = unwritable(out, "folder")
    if problem:
        raise UserError(f"Export folder '{out}' cannot be written: {problem}. Give the path of a new folder.")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"Export folder '{out}' is not empty; choose a new folder.")


def meta_model(hf_config, cfg: Config) -> torch.nn.Module:
    """The model the checkpoint's config describes, on the meta device, with transformers' default
    attention: an export needs its weights' names, shapes and file layout, not its kernels (which the
    exporting machine may not have)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config, trust_remote_code=cfg.model.trust_remote_code)


def check_tensors_fit(model, hf_config, tensors: dict[str, torch.Tensor], checkpoint: Path) -> None:
    """The tensors to export must be, name for name and shape for shape, the weights of ``model`` (the
    ``meta_model`` of the checkpoint's config): otherwise the folder written would not load. A config
    that is not the one the checkpoint was trained with (a run folder's, edited or rewritten) is
    caught here."""
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    problem = None
    for name, tensor in tensors.items():
        if name not in shapes:
            problem = (
                f"the checkpoint holds '{name}' {tuple(tensor.shape)}, which that model has no weight for"
            )
        elif tuple(tensor.shape) != shapes[name]:
            problem = f"'{name}' is {tuple(tensor.shape)} in the checkpoint but {shapes[name]} in that model"
        if problem:
            break
    missing = [name for name, _ in model.named_parameters() if name not in tensors]  # a tied head: once
    if problem is None and missing:
        problem = f"the checkpoint has no '{missing[0]}', which that model needs"
    if problem:
        raise UserError(
            f"Checkpoint '{checkpoint}' does not fit the {hf_config.model_type} model its config describes: "
            f"{problem}. The config is not the one the checkpoint was trained with (a run folder's "
            f"{CONFIG}, edited or rewritten by a later run); export a checkpoint that carries its own {CONFIG}, "
            "or restore the run's config. Nothing was written."
        )


BYTE_TOKENIZER_NOTE = (
    "Tokenizer: muonrun's built-in byte-level tokenizer, so this folder has no tokenizer files. Token ids "
    "0-255 are the UTF-8 bytes of the text, 256 is end-of-document (EOS): encode with "
    "`list(text.encode('utf-8'))`, decode with `bytes(i for i in ids if i < 256).decode('utf-8', 'replace')`."
)


def hub_layout(tensors: dict[str, torch.Tensor], model, hf_config) -> dict[str, torch.Tensor]:
    """The tensors as the Hub checkpoints of ``model`` (its ``meta_model``) name them. transformers keeps
    some weights in another layout in memory than in its files (a mixture of experts' stacked
    `experts.gate_up_proj` [E, 2I, H] is `experts.N.gate_proj.weight` and `up_proj` per expert on the
    Hub) and converts on load; this undoes it, as `save_pretrained` does, so that other tools read the
    export too. A model without such conversions is returned as it is."""
    from transformers.core_model_loading import revert_weight_conversion

    from muonrun.model.moe import is_moe

    if not is_moe(hf_config):
        return tensors
    return revert_weight_conversion(model, dict(tensors))


def export_hf(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    dtype: str = "float32",
    adapter_only: bool = False,
    *,
    shown_as: Path | None = None,
) -> Path:
    """Write a Hugging Face folder (config.json, safetensors, tokenizer files or a README note) that
    `AutoModelForCausalLM.from_pretrained(out)` loads, with the run's features applied (a LoRA run's
    adapters merged into its base). `adapter_only`: a LoRA run's adapter folder for
    `peft.PeftModel.from_pretrained(base, out)`, written by the LoRA feature. Runs on one process;
    needs CPU memory for one full copy of the model in `dtype` (LoRA: in float32 as well). `shown_as`:
    the path the folder's README names, where it is written elsewhere first."""
    checkpoint = resolve_checkpoint(checkpoint)
    try:
        verdict = verify(checkpoint)
    except FileNotFoundError:  # its folder went while it was read
        verdict = None
    if verdict is None or not verdict.ok:
        if not checkpoint.is_dir():
            raise pruned(checkpoint)
        raise verdict.error()
    out = Path(out)
    if out.is_symlink():  # written where the link points, which it keeps naming
        out = out.resolve()
    check_export_folder(out)
    # Written beside `out` and renamed into place once complete: a failed export leaves nothing behind.
    staging = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        try:
            _export(checkpoint, staging, dtype, adapter_only, shown_as or out)
        except Exception as e:
            if not checkpoint.is_dir():
                raise pruned(checkpoint) from None
            number = out_of_room([e]) or room_left_in(staging)
            if number is None:
                raise
            needed = model_bytes(checkpoint, dtype)
            if number == errno.EFBIG:  # the largest file: the whole model up to a shard's size
                needed = min(needed, 5 * 10**9)
            raise UserError(
                out_of_room_message(number, "Exporting", out, needed)
                + " Nothing was written (the partial export was removed)."
            ) from None
        with_user_modes(staging)
        if out.exists():
            out.rmdir()  # empty (checked above)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def current_umask() -> int:
    """This process's umask (set and restored: the only way Python reads it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def with_user_modes(folder: Path) -> None:
    """Every file and folder under ``folder`` gets the mode the user's umask gives a new one (0644 and
    0755 under umask 022), as everything else muonrun writes: safetensors writes its files through a
    private temporary file (0600), which teammates on a shared cluster could not read."""
    mask = current_umask()
    for root, _dirs, files in os.walk(folder):
        os.chmod(root, 0o777 & ~mask)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~mask)


def model_bytes(checkpoint: Path, dtype: str) -> int:
    """The bytes of a checkpoint's model weights in `dtype` (what an export writes), from its metadata."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from muonrun.checkpoint.safe import SafeReader

    meta = SafeReader(str(checkpoint)).read_metadata().state_dict_metadata
    size = getattr(torch, dtype).itemsize
    return sum(
        m.size.numel() * size
        for key, m in meta.items()
        if key.startswith("model.lm.") and isinstance(m, TensorStorageMetadata)
    )


def pruned(checkpoint: Path) -> UserError:
    """A checkpoint that went while export read it: a training in its run folder pruned it."""
    return UserError(
        f"Checkpoint '{checkpoint}' was deleted while export read it: a training running in its run folder "
        "pruned it (it keeps the newest checkpoint.keep_last). Export again: a run folder exports its newest "
        "checkpoint. Nothing was written."
    )


def as_trained(hf_config, checkpoint: Path):
    """`hf_config` (built from the run's settings today) with the architecture the checkpoint recorded
    (`model.build.architecture_of`) on top, and the keys that differed: an export describes the model
    the weights were trained as, even if `model.name_or_path`'s config.json or transformers' defaults
    changed since. Checkpoints saved before the architecture was recorded keep today's."""
    from muonrun.model.build import architecture_of

    saved = read_meta(checkpoint).get("architecture") or {}
    now = architecture_of(hf_config)
    rebuilt = sorted(k for k in saved.keys() & now.keys() if saved[k] != now[k])
    if not rebuilt:
        return hf_config, []
    return type(hf_config).from_dict({**hf_config.to_dict(), **{k: saved[k] for k in rebuilt}}), rebuilt


def _export(checkpoint: Path, out: Path, dtype: str, adapter_only: bool, shown_as: Path) -> None:
    """`export_hf`'s work, into `out` (its staging folder); `shown_as`: the path the README names."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    from muonrun.data import build_tokenizer
    from muonrun.model.build import build_hf_config

    if dtype not in ("float32", "bfloat16", "float16"):
        raise UserError(f"Export dtype '{dtype}' is not one of float32, bfloat16, float16.")
    cfg = read_run_config(checkpoint)
    tok = build_tokenizer(cfg.data.tokenizer)
    hf_config, rebuilt = as_trained(build_hf_config(cfg.model, tok.vocab_size), checkpoint)
    byte = cfg.data.tokenizer == "byte"
    job = ExportJob(
        cfg,
        hf_config,
        checkpoint,
        load_model_tensors(checkpoint),
        out,
        dtype,
        tok,
        shown_as,
        header=exported_from(checkpoint, dtype),
        tokenizer_note=BYTE_TOKENIZER_NOTE if byte else f"Tokenizer: `{cfg.data.tokenizer}`.",
        options={"adapter_only": adapter_only} if adapter_only else {},
    )
    if rebuilt:
        job.notes.append(
            f"Its config is the one it was trained with: `{cfg.model.name_or_path or cfg.model.architecture}` "
            f"now resolves to another ({', '.join(rebuilt)} differ)."
        )
    for feature in enabled(cfg):
        result = feature.export(job)
        if isinstance(result, Path):
            return
        if result is not None:
            job.tensors = result
    if job.options:
        raise UserError(
            f"--{next(iter(job.options)).replace('_', '-')}: checkpoint '{checkpoint}' is of a run none of whose "
            "features exports that way (--adapter-only is for LoRA runs: model.lora.enabled is false in its "
            "config.yaml); export it without the option."
        )
    model = meta_model(hf_config, cfg)
    check_tensors_fit(model, hf_config, job.tensors, checkpoint)
    sd = hub_layout(job.tensors, model, hf_config)
    sd = {k: v.to(getattr(torch, dtype)).contiguous() for k, v in sd.items()}
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
    # The model was trained on documents ending in the tokenizer's EOS: generation must stop there.
    hf_config.eos_token_id = tok.eos_token_id
    if cfg.data.tokenizer == "byte":
        hf_config.bos_token_id = None
        hf_config.pad_token_id = None
        note = BYTE_TOKENIZER_NOTE
    else:
        tok.hf.save_pretrained(out)
        hf_config.bos_token_id = tok.hf.bos_token_id
        hf_config.pad_token_id = tok.hf.pad_token_id
        note = f"Tokenizer: `{cfg.data.tokenizer}` (files included)."
    hf_config.save_pretrained(out)
    notes = "".join(f" {n}" for n in job.notes)
    (out / "README.md").write_text(
        f"# {cfg.name} (muonrun export)\n\n{job.header}{notes}\n\n{note}\n\n"
        "```python\nfrom transformers import AutoModelForCausalLM\n"
        f'model = AutoModelForCausalLM.from_pretrained("{shown_as}")\n```\n'
    )


def export_replacing(checkpoint: Path, out: Path) -> Path:
    """`export_hf` for checkpoint.export_at_end, into the run's own folder, which a rerun (or a resumed
    run that trains further) exports to again: the new export is written beside it and swapped in once
    complete, so `out` never holds half of one."""
    fresh, old = out.with_name(out.name + ".new"), out.with_name(out.name + ".old")
    for leftover in (fresh, old):
        shutil.rmtree(leftover, ignore_errors=True)
    export_hf(checkpoint, fresh, shown_as=out)
    if out.exists():
        out.rename(old)
    fresh.rename(out)
    shutil.rmtree(old, ignore_errors=True)
    return out


def exported_from(checkpoint: Path, dtype: str) -> str:
    meta = read_meta(checkpoint)
    return (
        f"Exported from `{checkpoint}` (step {meta['step']}, {meta['tokens_seen']:,} training tokens), "
        f"weights in {dtype}."
    )
