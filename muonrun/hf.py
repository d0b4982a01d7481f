"""Hugging Face weights in and out: `model.init=pretrained` reads a model's safetensors straight into
the FSDP2 shards; `muonrun export` turns a checkpoint into a folder `from_pretrained` loads.

    muonrun export runs/tiny hf/          # the latest checkpoint of runs/tiny as a Hugging Face model
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from muonrun.checkpoint import load_model_tensors, read_meta, resolve_checkpoint, verify
from muonrun.config import Config
from muonrun.distributed import Dist
from muonrun.errors import UserError


def _log(msg: str) -> None:
    print(f"muonrun: {msg}", flush=True)


def read_run_config(checkpoint: Path) -> Config:
    """The config of the run that wrote a checkpoint: OUTPUT_DIR/config.yaml, two levels up."""
    from muonrun.config import from_yaml, to_object

    path = checkpoint.resolve().parent.parent / "config.yaml"
    if not path.is_file():
        raise UserError(
            f"'{path}' is missing: the run folder of checkpoint '{checkpoint}' must hold its config.yaml."
        )
    return to_object(from_yaml(path.read_text()))


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
    verdict = verify(checkpoint)
    if not verdict.ok:
        raise verdict.error()
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
    meta = read_meta(checkpoint)
    (out / "README.md").write_text(
        f"# {cfg.name} (muonrun export)\n\nExported from `{checkpoint}` (step {meta['step']}, "
        f"{meta['tokens_seen']:,} training tokens), weights in {dtype}.\n\n{note}\n\n"
        "```python\nfrom transformers import AutoModelForCausalLM\n"
        f'model = AutoModelForCausalLM.from_pretrained("{out}")\n```\n'
    )
    return out
