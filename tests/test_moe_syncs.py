"""A mixture-of-experts training step never makes the host wait for the device: no `.item()`, no
data-dependent shape, no tensor made from host values inside the step, on logged and unlogged steps
(found on CPU with a dispatch-mode recorder); router logits recorded without transformers' hooks, which
break the compiled graph of every MoE layer; the mask-free attention for Qwen2-MoE.
"""

from __future__ import annotations

import inspect
import traceback
from pathlib import Path

import torch
import torch.optim
import transformers
from helpers import TINY_MOE
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

import muonrun
from muonrun.config import ModelConfig, load_config
from muonrun.features.router_bias import attach
from muonrun.model.attention import ATTENTION_NAME
from muonrun.model.build import build_hf_config, build_model, init_weights
from muonrun.model.causal_lm import CausalLMWithLoss
from muonrun.model.moe import RouterLogits

aten = torch.ops.aten
HF = dict(TINY_MOE, num_hidden_layers=3)

# Ops that wait for the device (a value read on the host, or an output shape that depends on values) and
# tensors made from host values (on a GPU, a copy from host memory). On the CPU nothing waits, so the
# recorder flags the ops themselves.
WAITS = {
    aten._local_scalar_dense.default,
    aten.item.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.bincount.default,
    aten.scalar_tensor.default,
    aten.lift_fresh.default,
    aten.lift_fresh_copy.default,
}
# The code whose frames the recorder keeps, by the folders its packages were imported from (never by
# a name in the path: a checkout is often itself a folder named muonrun, and holds this file).
MUONRUN = Path(muonrun.__file__).resolve().parent
TORCH_OPTIM = Path(torch.optim.__file__).resolve().parent
WATCHED = (MUONRUN, Path(transformers.__file__).resolve().parent, TORCH_OPTIM)
# Necessarily on the host, and documented:
EXPECTED = (
    # the batch: token ids made on the host, copied to the device from pinned memory without waiting
    MUONRUN / "data",
    # torch's AdamW on the CPU keeps its step count on the host (on a GPU muonrun runs the fused AdamW,
    # whose step count is a device tensor; tests/test_model.py checks the GPU step in sync-debug mode)
    TORCH_OPTIM,
)


def under(filename: str, folders) -> bool:
    return any(Path(filename).resolve().is_relative_to(f) for f in folders)


class HostWaits(TorchDispatchMode):
    """Records each op of WAITS (and boolean-mask indexing, repeat_interleave without output_size) with
    the innermost frames of muonrun's and transformers' code that called it."""

    def __init__(self):
        super().__init__()
        self.found: list[tuple[str, list[str]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        waits = func in WAITS
        if func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default):
            waits = any(i is not None and i.dtype == torch.bool for i in args[1])
        if func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor):
            waits = kwargs.get("output_size") is None
        if waits:
            frames = [f for f in traceback.extract_stack() if under(f.filename, WATCHED)]
            self.found.append((str(func), frames[-4:]))
        return func(*args, **kwargs)


def test_a_tiny_moe_training_step_never_waits_for_the_device_on_unlogged_or_logged_steps(tmp_path):
    """One whole step (data, forward and backward with the balance loss, z-loss and the router bias, clip,
    optimizer, the metrics row and the MoE telemetry), unlogged and logged, in one worker on the CPU."""
    from muonrun.distributed import destroy
    from muonrun.train.trainer import Trainer

    overrides = [
        f"output_dir={tmp_path}",
        "launch.nproc_per_node=1",
        "optimizer.name=adamw",
        "+model.hf.experts_implementation=grouped_mm",  # the presets' experts (the eager loop's nonzero waits)
        "data.seq_len=32",
        "train.micro_batch_size=2",
        "train.grad_accum_steps=2",
        "train.eval_interval=0",
        "train.max_steps=10",
        "train.router_z_loss_coef=0.001",
        "train.router_bias_update_rate=0.001",
        "checkpoint.interval=0",
        "logging.log_interval=2",
        "logging.console=plain",
    ]
    trainer = Trainer(load_config("tiny-moe", overrides))
    found = {}
    try:
        trainer.metrics.start(trainer.state)
        for step in range(1, 5):  # steps 1-2 warm up; 3 unlogged, 4 logged (reading step 2's row)
            log = trainer.logs(step)
            with HostWaits() as recorder:
                loss, grad_norm, wait = trainer.train_step(trainer.accum_steps())
                trainer.state.step += 1
                telemetry = trainer.telemetry() if log else None
                trainer.metrics.record(
                    trainer.state,
                    loss,
                    grad_norm,
                    1.0,
                    wait,
                    trainer.optimizers,
                    log=log,
                    telemetry=telemetry,
                )
            found[step] = [
                (op, frames)
                for op, frames in recorder.found
                if not frames or not under(frames[-1].filename, EXPECTED)
            ]
            assert recorder.found, "the recorder sees the batch being made on the host"
        assert telemetry and "expert_load_max_mean" in telemetry and "routed_load_max_mean" in telemetry
    finally:
        trainer.close()
        destroy()
    assert not found[3] and not found[4], found


def test_the_recorder_keeps_frames_of_the_watched_packages_and_never_of_this_test_file():
    # a clone of the repository is a folder named muonrun: the test's own frames must not pass as muonrun's
    assert not under(__file__, WATCHED)
    assert under(str(MUONRUN / "data" / "loader.py"), EXPECTED)
    assert under(inspect.getfile(torch.optim.AdamW), WATCHED) and under(transformers.__file__, WATCHED)
    assert not under(str(MUONRUN / "train" / "trainer.py"), EXPECTED)


def moe(**extra) -> CausalLMWithLoss:
    m = ModelConfig(architecture="qwen2_moe", hf={**HF, **extra})
    lm = build_model(m, build_hf_config(m))
    model = CausalLMWithLoss(lm, loss_chunk_tokens=0, router_aux_loss_coef=0.01)
    model.to_empty(device="cpu")
    init_weights(model, 0.02, 0, torch.device("cpu"))
    return model


def test_router_logits_recorded_by_our_hook_are_the_tensors_transformers_returns():
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    model = moe()
    attach(model.lm)  # the router bias's hook comes first: ours records what the router returns
    out = model.lm.base_model(input_ids=ids, use_cache=False, output_router_logits=True)
    ours = model._router_logits.take()
    assert len(ours) == len(out.router_logits) == HF["num_hidden_layers"]
    for a, b in zip(ours, out.router_logits, strict=True):
        assert a is b
    assert model._router_logits.take() == ()  # taken once
    model(ids, ids).backward()  # the training forward uses them
    assert model.moe_telemetry()["aux_loss"] > 0


def test_a_router_spec_by_class_name_leaves_the_recording_to_transformers():
    lm = Qwen2MoeForCausalLM(Qwen2MoeConfig(**HF))
    assert RouterLogits.attach(lm) is not None
    type(lm.model)._can_record_outputs, saved = (
        {"router_logits": "mlp.gate"},
        type(lm.model)._can_record_outputs,
    )
    try:
        assert RouterLogits.attach(lm) is None
    finally:
        type(lm.model)._can_record_outputs = saved


def test_qwen2_moe_attends_with_the_mask_free_sdpa_and_a_sliding_window_keeps_the_masks():
    assert moe().lm.config._attn_implementation == ATTENTION_NAME  # sliding_window stored as 0: none
    windowed = moe(use_sliding_window=True, sliding_window=8, max_window_layers=2)
    assert windowed.lm.config._attn_implementation == "sdpa"
