"""The optional-feature protocol (muonrun/features/): a feature added as one class and one registry entry
is called by the core at every hook it overrides, with nothing else changed: the dry run, the model
build, the weights' initialisation, the FLOPs count and a real training step."""

from __future__ import annotations

import torch
from torch import nn

from muonrun import features
from muonrun.config import load_config
from muonrun.features.protocol import Feature


class Marker(Feature):
    """A stand-in fourth feature: it adds a parameter, initialises it, counts FLOPs, plans and acts
    after each optimizer step. It is on when the run's name says so (a feature needs no core change to
    be chosen either)."""

    calls: list[str] = []

    @staticmethod
    def wanted(cfg) -> bool:
        return cfg.name == "marked"

    def adapt(self, model: nn.Module) -> None:
        Marker.calls.append("adapt")
        model.register_parameter("marker", nn.Parameter(torch.empty(3)))

    def init_parameter(self, name, shape, generator, device):
        return torch.full(shape, 7.0, device=device) if name.endswith("marker") else None

    def flops_per_token(self, fpt: float, model: nn.Module) -> float:
        return fpt + 1000.0

    def plan_rows(self, model: nn.Module) -> list[tuple[str, str]]:
        return [("marker", "planned by the marker feature")]

    def start(self, model: nn.Module, device: torch.device) -> None:
        Marker.calls.append("start")

    def after_step(self) -> None:
        Marker.calls.append("after_step")

    def telemetry(self) -> dict[str, torch.Tensor]:
        return {"marker_value": torch.tensor(1.0)}


def test_a_fourth_feature_plugs_in_with_one_registry_entry(monkeypatch, tmp_path, capsys):
    from muonrun.model.build import build_hf_config, build_model, flops_per_token, init_weights
    from muonrun.tools.plan import plan_summary

    monkeypatch.setitem(features.REGISTRY, "marker", Marker)
    Marker.calls.clear()
    cfg = load_config("tiny", ["name=marked", f"output_dir={tmp_path / 'run'}", "train.device=cpu"])
    assert [f.name for f in features.enabled(cfg)] == ["marker"]
    assert features.enabled(load_config("tiny", [])) == []  # off unless the config turns it on

    plan = plan_summary(cfg, 1)
    assert ("marker", "planned by the marker feature") in plan["feature_rows"]
    model = build_model(cfg.model, build_hf_config(cfg.model), features.enabled(cfg))
    plain = flops_per_token(model.config, cfg.data.seq_len)
    assert plan["flops_per_token"] == plain + 1000.0
    model.to_empty(device="cpu")
    init_weights(model, 0.02, 0, torch.device("cpu"), features.enabled(cfg))
    assert torch.equal(model.marker, torch.full((3,), 7.0))

    from muonrun.train.trainer import Trainer

    cfg.train.max_steps, cfg.launch.nproc_per_node = 2, 1
    trainer = Trainer(cfg)
    try:
        trainer.train()
        assert trainer.metrics.flops_per_token == plain + 1000.0
    finally:
        trainer.close()
        from muonrun.distributed import destroy

        destroy(barrier=False)
    assert Marker.calls.count("start") == 1 and Marker.calls.count("after_step") == 2
    rows = [
        line
        for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        if "marker_value" in line
    ]
    assert rows, "the feature's telemetry reaches the metrics rows"
