"""Hugging Face weights in: `model.init=pretrained` reads a model's safetensors straight into the FSDP2
shards; a base model's fingerprint (what a LoRA checkpoint records). The way out is
muonrun/checkpoint/export.py.

    muonrun pretrain qwen2-adamw-fsdp2 model.init=pretrained model.name_or_path=Qwen/Qwen2.5-0.5B
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from muonrun import log
from muonrun.distributed import Dist
from muonrun.errors import UserError


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
def load_pretrained(
    lm: torch.nn.Module, name_or_path: str, d: Dist, pretrained_name: Callable[[str], str | None] = str
) -> None:
    """Copy HF safetensors weights into a sharded model: each rank reads only the rows of its own
    shard (safe_open + get_slice on the memory-mapped file), never a full copy of the model.
    ``pretrained_name``: a parameter's name in the weight files (None: not in them; the features'
    say, ``features.pretrained_name``)."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    from muonrun.compat import local_shape_and_offset

    files = _hf_weight_files(name_or_path, d)
    # Tied weights appear once, under the input embedding's name; a feature's own parameters (LoRA's
    # adapters) are not in the files, and it may hold a pretrained weight under another name.
    named = ((pretrained_name(n), p) for n, p in lm.named_parameters())
    params = [(n, p) for n, p in named if n is not None]
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
            shape, offset = local_shape_and_offset(param)
        else:
            local, shape, offset = param, tuple(param.shape), (0,) * param.ndim
        if local.numel() == 0:
            continue
        index = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
        local.copy_(sl[index].to(device=local.device, dtype=local.dtype))
    log.info(f"weights loaded from {name_or_path} (model.init=pretrained)")


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
