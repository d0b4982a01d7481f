"""LoRA under FSDP2 with distributed Muon, checked in one gloo launch by tests/test_lora.py.

usage: lora_worker.py FOLDER     (FOLDER holds base/, a saved tiny pretrained model, and text.txt)

Builds muonrun's own Trainer for a LoRA run (rank-1 adapters, so on 3 ranks every A matrix has empty
shards on ranks 1 and 2; the tied embedding and the final norm also train; activation checkpointing
and reshard_after_forward on), then checks: the pretrained base is in the shards and never changes;
Muon holds exactly the adapters' A and B and AdamW the rest that trains, frozen parameters nowhere;
three steps match an unsharded copy stepped with torch.optim.Muon and torch.optim.AdamW; the
checkpoint holds only what trains and the base's identity, and resuming from it repeats the steps
bitwise; a checkpoint of another base is refused. It leaves FOLDER/run (config.yaml, checkpoints
step-3 and step-5) and FOLDER/logits.pt (the trained model's logits) for the export checks.
Frozen base weights in bf16 (param_dtype=bfloat16) are checked on a second, plain FSDP2 model.
Global rank 0 prints ``LORA_WORKER_OK`` at the end.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from muonrun.config import load_config, to_yaml
from muonrun.distributed import destroy, release_process_groups
from muonrun.errors import UserError
from muonrun.features.lora import is_adapter
from muonrun.optim import Muon
from muonrun.optim.groups import split_params

RTOL = 0.05  # torch.optim.Muon runs Newton–Schulz in bf16: an update differs by about 1% from ours, up to 3%
# for tall matrices (lora_B) on CPUs whose bf16 products round torch's transposed operands apart (AVX2)


def overrides(folder: Path) -> list[str]:
    return [
        "model.init=pretrained",
        f"model.name_or_path={folder / 'base'}",
        "model.lora.enabled=true",
        "model.lora.rank=1",
        "model.lora.alpha=2",
        "model.lora.train=[model.embed_tokens.weight, model.norm.weight]",
        "optimizer.name=muon",
        "optimizer.lr=0.01",
        "optimizer.muon.lr=0.05",
        "optimizer.muon.weight_decay=0.1",
        "schedule.name=constant",
        "schedule.warmup_steps=0",
        "train.grad_clip=0",
        "train.eval_interval=0",
        "train.loss_chunk_tokens=0",
        f"data.sources.0.path={folder / 'text.txt'}",
        "data.seq_len=16",
        "parallel.activation_checkpointing=full",
        "parallel.reshard_after_forward=true",
        "checkpoint.interval=0",
        "logging.console=plain",
        f"output_dir={folder / 'run'}",
        "launch.nproc_per_node=3",
    ]


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()


def local(p: torch.Tensor) -> torch.Tensor:
    return (p.to_local() if isinstance(p, DTensor) else p).detach().clone()


BATCHES = [torch.randint(0, 257, (6, 17), generator=torch.Generator().manual_seed(s)) for s in range(5)]


def step(trainer, i: int) -> float:
    """One optimizer step on this rank's 2 of the 6 rows of batch i; returns the global mean loss."""
    rows = BATCHES[i][2 * dist.get_rank() : 2 * dist.get_rank() + 2]
    trainer.set_lr(trainer.cfg.train.grad_accum_steps)
    loss = trainer.model(rows[:, :-1], rows[:, 1:])
    loss.backward()
    for opt in trainer.optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)
    trainer.state.step += 1
    dist.all_reduce(loss := loss.detach(), op=dist.ReduceOp.AVG)
    return loss.item()


def reference(cfg, trainer):
    """The same LoRA model unsharded (peft on the transformers model), starting from the sharded one's
    weights, with torch's own Muon and AdamW."""
    from transformers import AutoModelForCausalLM

    from muonrun.features.lora import apply_lora
    from muonrun.model.causal_lm import CausalLMWithLoss

    lm = AutoModelForCausalLM.from_pretrained(cfg.model.name_or_path, dtype=torch.float32)
    apply_lora(lm, cfg.model.lora)
    ref = CausalLMWithLoss(lm, 0)
    sharded = dict(trainer.model.named_parameters())
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(full(sharded[name]))
    o, m = cfg.optimizer, cfg.optimizer.muon
    adapters = [p for n, p in ref.named_parameters() if is_adapter(n)]
    others = [p for n, p in ref.named_parameters() if p.requires_grad and not is_adapter(n)]
    muon = torch.optim.Muon(
        adapters, lr=m.lr, weight_decay=m.weight_decay, momentum=m.momentum, nesterov=m.nesterov,
        adjust_lr_fn=m.adjust_lr_fn,
    )  # fmt: skip
    decay = [p for p in others if p.ndim == 2]
    groups = [{"params": decay, "weight_decay": o.weight_decay}]
    groups.append({"params": [p for p in others if p.ndim < 2], "weight_decay": 0.0})
    adamw = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    return ref, [muon, adamw]


def check_training(cfg, trainer) -> None:
    named = dict(trainer.model.named_parameters())
    trainable = {n for n, p in named.items() if p.requires_grad}
    adapters = {n for n in named if is_adapter(n)}
    assert adapters and adapters <= trainable
    assert trainable - adapters == {"lm.model.embed_tokens.weight", "lm.model.norm.weight"}, (
        trainable - adapters
    )
    # the groups: Muon exactly the adapters, AdamW the rest that trains, frozen parameters in none
    muon, adamw = trainer.optimizers
    assert isinstance(muon, Muon)
    ids = {id(p): n for n, p in named.items()}
    in_muon = [ids[id(p)] for g in muon.param_groups for p in g["params"]]
    in_adamw = [ids[id(p)] for g in adamw.param_groups for p in g["params"]]
    assert sorted(in_muon) == sorted(adapters) and sorted(in_adamw) == sorted(trainable - adapters)
    split = split_params(trainer.model)  # raises unless every trainable parameter is in exactly one group
    assert {n for n, _ in split.muon} == {n for n in adapters}
    log("groups: Muon holds the 56 adapter matrices, AdamW the embedding and norm, frozen ones none")
    # A is 1 x in: on 3 ranks its one row is on rank 0, the shards of ranks 1 and 2 are empty
    for name in adapters:
        if ".lora_A." in name:
            assert named[name].to_local().shape[0] == [1, 0, 0][dist.get_rank()], name
    # the pretrained base is in the shards (bitwise), frozen in fp32 on CPU
    from safetensors.torch import load_file

    pretrained = load_file(Path(cfg.model.name_or_path) / "model.safetensors")
    frozen = {n: p for n, p in named.items() if not p.requires_grad}
    for name, p in frozen.items():
        hf_name = name.removeprefix("lm.").replace(".base_layer.", ".")
        assert torch.equal(full(p), pretrained[hf_name]), name
    assert all(p.dtype == torch.float32 for p in frozen.values())
    before = {n: local(p) for n, p in frozen.items()}

    # Each step starts the reference from the sharded model's weights (their optimizer states go on
    # side by side), so a bf16 rounding difference in one step's update does not compound.
    ref, ref_opts = reference(cfg, trainer)
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    for i in range(3):
        start = {n: full(p) for n, p in named.items() if p.requires_grad}
        with torch.no_grad():
            for n, value in start.items():
                ref_params[n].copy_(value)
        loss = step(trainer, i)
        rows = BATCHES[i]
        ref_loss = ref(rows[:, :-1], rows[:, 1:])
        ref_loss.backward()
        for opt in ref_opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert abs(loss - ref_loss.item()) < 1e-5, (i, loss, ref_loss.item())
        for name in sorted(trainable):
            theirs = ref_params[name].detach() - start[name]
            ours = full(named[name]) - start[name]
            moved = theirs.abs().max().item()
            diff = (ours - theirs).abs().max().item()
            assert diff <= RTOL * moved + 1e-7, (i, name, diff, moved)
            if not (i == 0 and ".lora_A." in name):  # step 1: B = 0, so A's gradient is 0 (only decay)
                assert moved > 0, (i, name)
            worst = max(worst, diff / max(moved, 1e-12))
    log(
        f"3 steps: LoRA + distributed Muon == LoRA + torch.optim.Muon unsharded (worst {worst:.1e} of an update)"
    )
    for name, p in frozen.items():
        assert p.grad is None and torch.equal(local(p), before[name]), name
    log("only the adapters, the embedding and the norm changed; the frozen base is bitwise the same")


def check_checkpoint(cfg, trainer) -> None:
    import json

    from muonrun.checkpoint.safe import SafeReader

    ckpt = trainer.checkpointer.save(3, trainer.state.tokens_seen, last=True)
    keys = set(SafeReader(str(ckpt)).read_metadata().state_dict_metadata)
    weights = {k.removeprefix("model.") for k in keys if k.startswith("model.")}
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert weights == trainable, weights ^ trainable
    identity = json.loads((ckpt / "muonrun.json").read_text())["identity"]["base_model"]
    assert identity["name_or_path"] == cfg.model.name_or_path and len(identity["fingerprint"]) == 64
    log("checkpoint: only what trains (adapters, embedding, norm), optimizer state and the base's identity")

    losses = [step(trainer, i) for i in (3, 4)]
    after = {n: local(p) for n, p in trainer.model.named_parameters()}
    ids = BATCHES[0][:2, :-1]
    with torch.no_grad():
        trainer.model.unshard()  # the root's own weights (embedding, norm): its forward is the loss's
        logits = trainer.model.lm(input_ids=ids, use_cache=False).logits
        trainer.model.reshard()
    if dist.get_rank() == 0:
        torch.save({"ids": ids, "logits": logits}, Path(cfg.output_dir).parent / "logits.pt")
    trainer.checkpointer.save(5, trainer.state.tokens_seen, last=True)

    trainer.checkpointer.cfg.resume_from = str(ckpt)
    assert trainer.checkpointer.load() == ckpt and trainer.state.step == 3
    again = [step(trainer, i) for i in (3, 4)]
    assert again == losses, (again, losses)
    for n, p in trainer.model.named_parameters():
        assert torch.equal(local(p), after[n]), n
    # going back to step 3 set the first step-5 aside; the repeat saves the same weights as step-5 again
    assert (ckpt.parent / "step-5.abandoned").is_dir() and not (ckpt.parent / "step-5").exists()
    trainer.checkpointer.save(5, trainer.state.tokens_seen, last=True)
    log(f"resumed from step 3: steps 4-5 repeat bitwise (losses {losses}); the first step-5 set aside")

    real = trainer.checkpointer.identity
    trainer.checkpointer.identity = {"base_model": {"name_or_path": "another/model", "fingerprint": "0" * 64}}
    try:
        trainer.checkpointer.load()
        raise AssertionError("a checkpoint of another base model was loaded")
    except UserError as e:
        text = str(e)
        assert cfg.model.name_or_path in text and "another/model" in text, text
    trainer.checkpointer.identity = real
    trainer.checkpointer.cfg.resume_from = None
    log("a checkpoint of another base model is refused, naming both")


def check_bf16_frozen(cfg) -> None:
    """param_dtype=bfloat16: frozen weights are stored in bf16 (no fp32 copy), the adapters in fp32,
    and FSDP2 trains the mix."""
    from muonrun.distributed import init_distributed
    from muonrun.features import enabled
    from muonrun.model.causal_lm import CausalLMWithLoss
    from muonrun.model.build import build_hf_config, build_model, init_weights
    from muonrun.optim.build import build_optimizers
    from muonrun.model.parallelize import parallelize

    cfg.parallel.param_dtype = "bfloat16"
    d = init_distributed(cfg)
    features = enabled(cfg)
    model = CausalLMWithLoss(build_model(cfg.model, build_hf_config(cfg.model, 257), features), 0)
    parallelize(model, d.mesh, cfg.parallel, "cpu", features)
    model.to_empty(device="cpu")
    init_weights(model, 0.02, 0, torch.device("cpu"), features)
    named = dict(model.named_parameters())
    assert all(p.dtype == (torch.float32 if p.requires_grad else torch.bfloat16) for p in named.values())
    opts = build_optimizers(model, cfg.optimizer, "cpu")
    b_name = "lm.model.layers.0.mlp.down_proj.lora_B.default.weight"
    b0 = full(named[b_name])
    for i in range(2):
        rows = BATCHES[i][2 * dist.get_rank() : 2 * dist.get_rank() + 2]
        model(rows[:, :-1], rows[:, 1:]).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert not torch.equal(full(named[b_name]), b0)
    log("param_dtype=bfloat16: frozen weights stored in bf16, adapters in fp32, two FSDP2 steps train")


def main() -> None:
    folder = Path(sys.argv[1])
    cfg_yaml = load_config("tiny", overrides(folder))
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    if dist.get_rank() == 0:
        (folder / "run").mkdir(parents=True, exist_ok=True)
        (folder / "run" / "config.yaml").write_text(to_yaml(cfg_yaml))  # what `muonrun export` reads
    dist.barrier()

    from muonrun.train.trainer import Trainer

    cfg = cfg_yaml
    trainer = Trainer(cfg)
    check_training(cfg, trainer)
    check_checkpoint(cfg, trainer)
    trainer.close()
    del trainer
    check_bf16_frozen(cfg_yaml)
    dist.barrier()
    log("LORA_WORKER_OK")
    destroy()
    release_process_groups()  # no gloo thread is left for interpreter teardown


if __name__ == "__main__":
    main()
