"""Hugging Face weights in and out: `model.init=pretrained` reads a model's safetensors straight into
the FSDP2 shards; `muonrun export` turns a checkpoint into a folder `from_pretrained` loads.

    muonrun export runs/tiny hf/          # the latest checkpoint of runs/tiny as a Hugging Face model
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from muonrun.checkpoint import CONFIG, load_model_tensors, read_meta, resolve_checkpoint, verify
from muonrun.config import Config
from muonrun.distributed import Dist
from muonrun.errors import UserError


def _log(msg: str) -> None:
    print(f"muonrun: {msg}", flush=True)


def read_run_config(checkpoint: Path) -> Config:
    """The config a checkpoint was saved with: its own config.yaml (covered by its manifest, so a hand-edited
    or overwritten run config cannot change it); for a checkpoint written before checkpoints carried one,
    its run folder's config.yaml, two levels up."""
    from omegaconf.errors import OmegaConfBaseException

    from muonrun.config import from_yaml, to_object

    path = checkpoint / CONFIG
    if not path.is_file():
        path = checkpoint.resolve().parent.parent / CONFIG
    if not path.is_file():
        raise UserError(
            f"Checkpoint '{checkpoint}' holds no {CONFIG} and its run folder has none either ('{path}' is "
            "missing): the model cannot be rebuilt without the config the checkpoint was trained with."
        )
    try:
        return to_object(from_yaml(path.read_text(), source=f"file '{path}'"))
    except OmegaConfBaseException as e:
        raise UserError(f"Config file '{path}' cannot be read as a muonrun config: {e.msg}.") from None


def check_export_folder(out: Path) -> None:
    """The export goes into a new folder (or an empty one)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"Export folder '{out}' is a file; give the path of a new folder.")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"Export folder '{out}' is not empty; choose a new folder.")


def check_tensors_fit(hf_config, tensors: dict[str, torch.Tensor], checkpoint: Path, cfg: Config) -> None:
    """The checkpoint's tensors must be, name for name and shape for shape, the weights of the model its
    config describes (built on the meta device): otherwise the folder written would not load. A config
    that is not the one the checkpoint was trained with (a run folder's, edited or rewritten) is caught
    here."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=cfg.model.trust_remote_code)
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


def _hf_weight_files(name_or_path: str, d: Dist | None) -> dict[str, Path]:
    """{tensor name: safetensors file} of a local folder or a Hub repo (downloaded once per node; `d`
    None: a single process)."""
    folder = Path(name_or_path)
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        patterns = ["*.safetensors", "*.safetensors.index.json", "config.json"]
        if d is None or d.local_rank == 0:
            snapshot_download(name_or_path, allow_patterns=patterns)
        if d is not None:
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

    from muonrun.features.lora import base_name, is_adapter

    files = _hf_weight_files(name_or_path, d)
    # Tied weights appear once, under the input embedding's name; LoRA's adapters are not in the files
    # and the layers they adapt hold the pretrained weight as `.base_layer.weight`.
    params = [(base_name(n), p) for n, p in lm.named_parameters() if not is_adapter(n)]
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


def base_identity(name_or_path: str, d: Dist | None = None) -> dict[str, str]:
    """What a LoRA checkpoint records of the base model it adapts: the name, and a fingerprint of its
    weights: SHA-256 over every tensor's name, dtype, shape and first 4 KiB, read from the safetensors
    headers and data (a few MB read at every start). Another model or another fine-tune of the same one
    differs; a copy in another folder, or the weights split into other files, does not."""
    tensors = []  # (name, dtype, shape, file, data offset, bytes)
    for path in set(_hf_weight_files(name_or_path, d).values()):
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        for name, info in header.items():
            if name != "__metadata__":
                begin, end = info["data_offsets"]
                tensors.append((name, info["dtype"], info["shape"], path, 8 + size + begin, end - begin))
    digest = hashlib.sha256()
    for name, dtype, shape, path, offset, length in sorted(tensors):
        with open(path, "rb") as f:
            f.seek(offset)
            digest.update(json.dumps([name, dtype, shape]).encode() + f.read(min(4096, length)))
    return {"name_or_path": name_or_path, "fingerprint": digest.hexdigest()}


BYTE_TOKENIZER_NOTE = (
    "Tokenizer: muonrun's built-in byte-level tokenizer, so this folder has no tokenizer files. Token ids "
    "0-255 are the UTF-8 bytes of the text, 256 is end-of-document (EOS): encode with "
    "`list(text.encode('utf-8'))`, decode with `bytes(i for i in ids if i < 256).decode('utf-8', 'replace')`."
)


def adapted_model(cfg: Config, hf_config, checkpoint: Path, trained: dict[str, torch.Tensor]):
    """A LoRA run's base model (from its `model.name_or_path`, checked against the fingerprint the
    checkpoint recorded) with the checkpoint's adapters and other trained weights, as a peft model.
    Parameters `model.lora.train` trained become peft's `modules_to_save`, so an adapter folder carries
    them too (a tied embedding stays tied to the LM head)."""
    import warnings

    from transformers import AutoModelForCausalLM
    from transformers.utils.logging import disable_progress_bar

    from muonrun.features.lora import ADAPTER, is_adapter, peft_config, require_peft

    require_peft()
    from peft import get_peft_model

    base = cfg.model.name_or_path
    saved = read_meta(checkpoint).get("identity", {}).get("base_model", {})
    found = base_identity(base)
    if saved.get("fingerprint") != found["fingerprint"]:
        raise UserError(
            f"Checkpoint '{checkpoint}' holds LoRA adapters trained on '{saved.get('name_or_path')}' (fingerprint "
            f"{str(saved.get('fingerprint'))[:12]}), but '{base}' (model.name_or_path in its run's config.yaml) "
            f"now holds other weights (fingerprint {found['fingerprint'][:12]}): the export needs the base model "
            "the adapters were trained on."
        )
    disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(
        base, config=hf_config, dtype=torch.float32, trust_remote_code=cfg.model.trust_remote_code
    )
    config = peft_config(model, cfg.model.lora)
    config.modules_to_save = sorted({n.rsplit(".", 1)[0] for n in trained if not is_adapter(n)}) or None
    config.ensure_weight_tying = bool(
        config.modules_to_save and getattr(hf_config, "tie_word_embeddings", False)
    )
    with warnings.catch_warnings():  # peft asks the model for a property transformers renamed
        warnings.simplefilter("ignore", FutureWarning)
        peft_model = get_peft_model(model, config, adapter_name=ADAPTER)
    params = dict(peft_model.named_parameters())
    for name, tensor in trained.items():
        module, _, leaf = name.rpartition(".")
        key = "base_model.model." + (
            name if is_adapter(name) else f"{module}.modules_to_save.{ADAPTER}.{leaf}"
        )
        if key not in params:
            raise UserError(
                f"Checkpoint '{checkpoint}' holds '{name}', which the LoRA model of its run's config.yaml lacks: "
                "its model.lora settings changed after the run."
            )
        with torch.no_grad():
            params[key].copy_(tensor)
    return peft_model


def export_hf(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    dtype: str = "float32",
    adapter_only: bool = False,
    *,
    shown_as: Path | None = None,
) -> Path:
    """Write a Hugging Face folder (config.json, safetensors, tokenizer files or a README note) that
    `AutoModelForCausalLM.from_pretrained(out)` loads; a LoRA run's adapters merged into its base.
    `adapter_only`: a LoRA run's adapter folder (adapter_config.json, adapter_model.safetensors) for
    `peft.PeftModel.from_pretrained(base, out)`. Runs on one process; needs CPU memory for one full
    copy of the model in `dtype` (LoRA: in float32 as well). `shown_as`: the path the folder's README
    names, where it is written elsewhere first."""
    checkpoint = resolve_checkpoint(checkpoint)
    verdict = verify(checkpoint)
    if not verdict.ok:
        raise verdict.error()
    out = Path(out)
    check_export_folder(out)
    # Written beside `out` and renamed into place once complete: a failed export leaves nothing behind.
    staging = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        _export(checkpoint, staging, dtype, adapter_only, shown_as or out)
        if out.exists():
            out.rmdir()  # empty (checked above)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _export(checkpoint: Path, out: Path, dtype: str, adapter_only: bool, shown_as: Path) -> Path:
    """`export_hf`'s work, into `out` (its staging folder); `shown_as`: the path the README names."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    from muonrun.data import build_tokenizer
    from muonrun.model.build import build_hf_config

    if dtype not in ("float32", "bfloat16", "float16"):
        raise UserError(f"Export dtype '{dtype}' is not one of float32, bfloat16, float16.")
    cfg = read_run_config(checkpoint)
    lora = cfg.model.lora.enabled
    if adapter_only and not lora:
        raise UserError(
            f"--adapter-only: checkpoint '{checkpoint}' is of a run that trained every weight (model.lora.enabled "
            "is false in its config.yaml), so there is no adapter; export it without --adapter-only."
        )
    tok = build_tokenizer(cfg.data.tokenizer)
    hf_config = build_hf_config(cfg.model, tok.vocab_size)
    sd = load_model_tensors(checkpoint)
    if lora:
        adapted = adapted_model(cfg, hf_config, checkpoint, sd)
        if adapter_only:
            adapted = adapted.to(getattr(torch, dtype))
            return _write_adapter(adapted, out, shown_as or out, cfg, tok, checkpoint, dtype)
        sd = adapted.merge_and_unload().state_dict()
    else:
        check_tensors_fit(hf_config, sd, checkpoint, cfg)
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
    merged = f" LoRA adapters merged into `{cfg.model.name_or_path}`." if lora else ""
    (out / "README.md").write_text(
        f"# {cfg.name} (muonrun export)\n\n{_exported_from(checkpoint, dtype)}{merged}\n\n{note}\n\n"
        "```python\nfrom transformers import AutoModelForCausalLM\n"
        f'model = AutoModelForCausalLM.from_pretrained("{shown_as or out}")\n```\n'
    )
    return out


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


def _exported_from(checkpoint: Path, dtype: str) -> str:
    meta = read_meta(checkpoint)
    return (
        f"Exported from `{checkpoint}` (step {meta['step']}, {meta['tokens_seen']:,} training tokens), "
        f"weights in {dtype}."
    )


def _write_adapter(
    adapted, out: Path, shown_as: Path, cfg: Config, tok, checkpoint: Path, dtype: str
) -> Path:
    """peft's adapter folder, the tokenizer beside it (unless the byte tokenizer), and a README."""
    adapted.save_pretrained(out)
    note = BYTE_TOKENIZER_NOTE if cfg.data.tokenizer == "byte" else f"Tokenizer: `{cfg.data.tokenizer}`."
    if cfg.data.tokenizer != "byte":
        tok.hf.save_pretrained(out)
    base = cfg.model.name_or_path
    (out / "README.md").write_text(
        f"# {cfg.name} (muonrun export: LoRA adapter)\n\n{_exported_from(checkpoint, dtype)} The adapter of "
        f"`{base}`.\n\n{note}\n\n```python\nfrom peft import PeftModel\nfrom transformers import "
        f'AutoModelForCausalLM\n\nbase = AutoModelForCausalLM.from_pretrained("{base}")\n'
        f'model = PeftModel.from_pretrained(base, "{shown_as}")\n```\n'
    )
    return out
