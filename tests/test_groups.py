"""Parameter grouping for Muon + AdamW on a tiny transformers Qwen2."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_qwen2
from torch import nn

from muonrun.errors import UserError
from muonrun.optim.groups import ParamSplit, clean_param_name, split_params

transformers = pytest.importorskip("transformers")


HIDDEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def expected_muon(layers: int = 2, prefix: str = "model.layers") -> list[str]:
    mods = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}
    return [f"{prefix}.{i}.{mods.get(h, 'mlp')}.{h}.weight" for i in range(layers) for h in HIDDEN]


def all_ids(split: ParamSplit) -> list[int]:
    return [id(p) for g in ParamSplit.GROUPS for _, p in getattr(split, g)]


@pytest.mark.parametrize("tied", [True, False])
def test_qwen2_split(tied):
    model = tiny_qwen2(tied)
    split = split_params(model)
    names = split.names()
    assert names["muon"] == expected_muon()
    assert names["embedding"] == ["model.embed_tokens.weight"]
    assert split.tied_lm_head is tied
    if tied:
        assert names["lm_head"] == []
        assert split.embedding[0][1] is model.get_output_embeddings().weight
    else:
        assert names["lm_head"] == ["lm_head.weight"]
        assert split.lm_head[0][1] is model.lm_head.weight
    # norms and the q/k/v biases
    assert all(p.ndim == 1 for _, p in split.norm_bias)
    assert "model.norm.weight" in names["norm_bias"]
    assert "model.layers.0.self_attn.q_proj.bias" in names["norm_bias"]
    assert "model.layers.1.post_attention_layernorm.weight" in names["norm_bias"]
    assert names["other"] == []
    # a partition of the trainable parameters, each exactly once
    ids = all_ids(split)
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    assert {id(p) for _, p in split.adamw} | {id(p) for _, p in split.muon} == {
        id(p) for p in model.parameters()
    }
    assert all(p.ndim == 2 for _, p in split.muon)
    assert split.numel()["muon"] + sum(p.numel() for _, p in split.adamw) == sum(
        p.numel() for p in model.parameters()
    )


def test_wrapper_prefixes_are_stripped():
    assert clean_param_name("_orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight") == (
        "model.layers.0.mlp.up_proj.weight"
    )
    assert clean_param_name("_fsdp_wrapped_module.lm_head.weight") == "lm_head.weight"

    class Wrapped(nn.Module):  # what torch.compile / checkpoint_wrapper do to the module tree
        def __init__(self, inner):
            super().__init__()
            self._orig_mod = inner

        def get_output_embeddings(self):
            return self._orig_mod.get_output_embeddings()

    model = tiny_qwen2(tied=False)
    model.model.layers[0] = type("CW", (nn.Module,), {})()
    model.model.layers[0]._checkpoint_wrapped_module = tiny_qwen2(tied=False).model.layers[0]
    split = split_params(Wrapped(model))
    assert split.names()["muon"] == expected_muon()
    assert split.names()["lm_head"] == ["lm_head.weight"]


def test_compiled_model_names():
    model = tiny_qwen2(tied=True)
    compiled = torch.compile(model)  # OptimizedModule: names gain "_orig_mod." (nothing is compiled yet)
    assert any(n.startswith("_orig_mod.") for n, _ in compiled.named_parameters())
    split = split_params(compiled)
    assert split.names()["muon"] == expected_muon()
    assert split.names()["embedding"] == ["model.embed_tokens.weight"]
    assert split.tied_lm_head


def test_patterns_override():
    model = tiny_qwen2(tied=False)
    split = split_params(model, adamw_patterns=["*.mlp.down_proj.weight", "model.layers.1.*"])
    names = split.names()
    assert "model.layers.0.mlp.down_proj.weight" in names["other"]
    assert not any(n.startswith("model.layers.1.") for n in names["muon"])
    assert "model.layers.1.self_attn.q_proj.weight" in names["other"]
    assert "model.layers.1.self_attn.q_proj.bias" in names["norm_bias"]  # stays in its type's group
    assert len(names["muon"]) == 6

    split = split_params(model, muon_patterns=["lm_head.weight"])
    assert "lm_head.weight" in split.names()["muon"] and split.lm_head == []

    with pytest.raises(UserError, match="2-D"):
        split_params(model, muon_patterns=["model.norm.weight"])
    with pytest.raises(UserError, match="both"):
        split_params(model, muon_patterns=["*q_proj.weight"], adamw_patterns=["model.layers.0.*"])
    with pytest.raises(UserError, match=r"adamw_patterns \['\*q_prj\*'\] match no trainable parameter"):
        split_params(model, adamw_patterns=["*q_proj.weight", "*q_prj*"])  # a typo is not ignored


def test_frozen_and_custom_parameters():
    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.proj = nn.Linear(4, 4)
            self.pos = nn.Parameter(torch.zeros(8, 4))  # a 2-D non-Linear parameter -> AdamW
            self.conv = nn.Conv1d(4, 4, 3)
            self.frozen = nn.Linear(4, 4)
            self.frozen.requires_grad_(False)
            self.scale = nn.Parameter(torch.ones(()))

    split = split_params(Custom())
    names = split.names()
    assert names["muon"] == ["proj.weight"]
    assert names["embedding"] == ["embed.weight"]
    assert names["lm_head"] == []
    assert sorted(names["other"]) == ["conv.weight", "pos"]
    assert sorted(names["norm_bias"]) == ["conv.bias", "proj.bias", "scale"]
    assert "frozen.weight" not in sum(names.values(), [])


def test_fsdp_sharded_model_keeps_groups():
    """After fully_shard (1-rank gloo group) the parameters are DTensors; grouping is unchanged."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    if dist.is_initialized():
        pytest.skip("a process group already exists")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = tiny_qwen2(tied=True)
        mesh = init_device_mesh("cpu", (1,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        split = split_params(model)
        assert all(isinstance(p, DTensor) for _, p in split.muon)
        assert split.names()["muon"] == expected_muon()
        assert split.tied_lm_head and split.names()["lm_head"] == []
    finally:
        dist.destroy_process_group()


def test_muon_preset_settings_reach_the_optimizers():
    """optimizer.muon.* from the config (the Muon preset plus overrides) land on the built Muon."""
    from muonrun.config import load_config
    from muonrun.optim.build import build_optimizers

    cfg = load_config("qwen2-muon-fsdp2", ["optimizer.muon.gram_ns=false", "optimizer.muon.momentum=0.9"])
    muon, adamw = build_optimizers(tiny_qwen2(tied=True), cfg.optimizer, "cpu")
    assert type(muon).__name__ == "Muon" and isinstance(adamw, torch.optim.AdamW)
    assert not muon.newton_schulz.gram and muon.defaults["lr"] == cfg.optimizer.muon.lr
    assert muon.defaults["nesterov"] and muon.defaults["momentum"] == 0.9
    assert build_optimizers(tiny_qwen2(tied=True), load_config("qwen2-muon-fsdp2", []).optimizer, "cpu")[
        0
    ].newton_schulz.gram  # the preset's default
    assert not build_optimizers(
        tiny_qwen2(tied=True), load_config("tiny", ["optimizer.name=muon"]).optimizer, "cpu"
    )[0].newton_schulz.gram  # the schema's: torch.optim.Muon's iteration


def test_every_optimizer_name_the_config_allows_has_a_builder():
    """The config's list of optimizer names and the registry agree (the config does not import it)."""
    from muonrun.config import choices
    from muonrun.optim.build import OPTIMIZERS

    assert set(OPTIMIZERS) == set(choices()["optimizer.name"])


def test_public_api_does_not_read_the_config():
    """`from muonrun.optim import Muon, AdamW` works without importing muonrun.config."""
    import subprocess
    import sys

    code = (
        "import sys; from muonrun.optim import AdamW, Muon, split_params, newton_schulz; "
        "assert 'muonrun.config' not in sys.modules, sorted(m for m in sys.modules if m.startswith('muonrun'))"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
