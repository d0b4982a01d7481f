"""Loading a configuration: schema defaults < preset YAML (with its `defaults:` bases) < overrides.

    muonrun config show tiny train.max_steps=10 data.sources.0.path=my.jsonl

A preset is a YAML path or the name of a built-in one (muonrun/configs/). Overrides are `key=value`
with dotted keys (list elements by index: `data.sources.0.path` or `data.sources[0].path`);
`+key=value` adds a key to an open section (`model.hf`). Every mistake raises a UserError naming
the key or file.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import sysconfig
import typing
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from muonrun.config.optimizer import RETIRED_MUON_KEYS
from muonrun.config.schema import Config
from muonrun.errors import UserError

PRESET_DIR = Path(__file__).parent.parent / "configs"
DEFAULT_PRESET = "tiny"


def _package_dir(name: str) -> str:
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"package '{name}' is not installed")
    return list(spec.submodule_search_locations)[0]


# Text corpora that exist on any machine with muonrun installed, for offline presets:
# `${stdlib:}` is the Python standard library's source folder, `${pkg:NAME}` an installed package's.
for _name, _fn in (("stdlib", lambda: sysconfig.get_paths()["stdlib"]), ("pkg", _package_dir)):
    if not OmegaConf.has_resolver(_name):
        OmegaConf.register_resolver(_name, _fn, annotation_validation="off")


def preset_names() -> list[str]:
    """The built-in presets (files starting with `_` are shared bases, not presets)."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml") if not p.stem.startswith("_"))


def _builtin(name: str) -> Path | None:
    path = PRESET_DIR / f"{name.removesuffix('.yaml')}.yaml"
    return path if "/" not in name and path.is_file() else None


def resolve_preset(path_or_name: str | os.PathLike) -> Path:
    """A preset is a YAML path, or the name of a file in the built-in presets (`tiny`, `qwen2-muon-fsdp2`)."""
    path = Path(path_or_name)
    if path.is_file():
        return path
    builtin = _builtin(str(path_or_name)) if path.parent == Path(".") else None
    if builtin:
        return builtin
    what = "is a folder, not a YAML file" if path.is_dir() else "does not exist"
    raise UserError(
        f"Config file '{path}' {what}. Pass a YAML path or a built-in preset: {', '.join(preset_names())}."
    )


def _load_yaml(path: Path, seen: tuple[Path, ...] = ()) -> DictConfig:
    """Load one YAML file, merging the files its `defaults:` list names underneath it: a path relative
    to the file, or a built-in preset's name."""
    path = path.resolve()
    if path in seen:
        raise UserError(f"Config file '{path}' includes itself through `defaults:`.")
    try:
        node = OmegaConf.load(path)  # yaml.SafeLoader underneath: no Python objects from YAML tags
    except Exception as e:  # yaml.YAMLError and friends: report the file, not the parser internals
        raise UserError(f"Config file '{path}' is not valid YAML: {e}") from None
    if not isinstance(node, DictConfig):
        kind = "a list" if isinstance(node, ListConfig) else f"a {type(node).__name__}"
        raise UserError(f"Config file '{path}' must hold a mapping of keys, not {kind}.")
    if not node and not path.read_text().strip():
        raise UserError(
            f"Config file '{path}' is empty; start it with `defaults: [tiny]` or a preset's keys."
        )
    bases = node.pop("defaults", [])
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, (list, ListConfig)):
        raise UserError(
            f"Config file '{path}' has `defaults: {bases}`; give a preset name or a list of them "
            "(defaults: [tiny])."
        )
    layers = []
    for base in bases:
        relative = path.parent / (base if str(base).endswith(".yaml") else f"{base}.yaml")
        base_path = relative if relative.is_file() else _builtin(str(base))
        if base_path is None:
            raise UserError(
                f"Config file '{path}' lists '{base}' under `defaults:`, but neither '{relative}' exists nor "
                f"is it a built-in preset ({', '.join(preset_names())})."
            )
        layers.append(_load_yaml(base_path, (*seen, path)))
    stack = [*layers, node]  # each base under the next, this file's own keys last
    merged = stack[0]
    for layer in stack[1:]:
        merged = _merge(merged, layer, f"'{path}'")
    return merged


_INDEX = re.compile(r"\[(\d+)\]")


def _parse_overrides(overrides: list[str]) -> list[tuple[str, str, bool]]:
    """(dotted key, value text, add?) per override; `a[0].b` is written `a.0.b`."""
    parsed = []
    for item in overrides:
        key, sep, value = item.partition("=")
        add = key.startswith("+")
        key = _INDEX.sub(r".\1", key.removeprefix("+").strip())
        if not sep or not key or any(c.isspace() for c in key) or ".." in key or key.endswith("."):
            raise UserError(
                f"Override '{item}' is malformed: write KEY=VALUE with a dotted key, e.g. train.max_steps=100 "
                "or data.sources.0.path=my.jsonl (+model.hf.KEY=VALUE adds a key to an open section)."
            )
        parsed.append((key, value, add))
    return parsed


def overridden_keys(overrides: list[str]) -> set[str]:
    """The dotted keys a list of KEY=VALUE overrides sets (as `load_config` reads them)."""
    return {key for key, _, _ in _parse_overrides(overrides)}


# How to write a value YAML would read otherwise: a glob's leading `*` is an alias to YAML, `&` an anchor
QUOTING = (
    'Quote values that hold ":", "{" or "#", and those that start with "*", "&" or "!" (YAML reads them as '
    "an alias, an anchor or a tag), e.g. optimizer.muon.muon_patterns='[\"*embed*\"]' or "
    "data.sources='[{path: \"${stdlib:}/*.py\"}]'"
)
# the last step logging.profile records (muonrun/observe/profiling.py: 4 skipped, 1 warm-up, 3 recorded)
PROFILED_THROUGH = 8
_ABSENT = object()  # OmegaConf.select's default: tells a missing key from one set to None


def _did_you_mean(cfg: DictConfig, full_key: str) -> str:
    """The keys a mistyped one may have meant: the first part of its path that does not exist is matched
    against the keys beside it (`trian.max_steps` finds 'train.max_steps')."""
    parts, node = full_key.split("."), cfg
    for i, part in enumerate(parts):
        if isinstance(node, ListConfig) and part.isdigit() and int(part) < len(node):
            node = node._get_node(int(part))
            continue
        if not isinstance(node, DictConfig):
            return ""
        keys = [str(k) for k in node]
        if part not in keys:
            close = difflib.get_close_matches(part, keys, n=3)
            whole = [".".join([*parts[:i], c, *parts[i + 1 :]]) for c in close]
            exist = [k for k in whole if OmegaConf.select(cfg, k, default=_ABSENT) is not _ABSENT]
            found = exist or [".".join([*parts[:i], c]) for c in close]
            return f" Did you mean {' or '.join(map(repr, found))}?" if found else ""
        node = node._get_node(part)
    return ""


def _refuse_retired(key: str, source: str) -> None:
    """A setting that has left the config: refused naming what took its place."""
    section, _, name = key.rpartition(".")
    if section == "optimizer.muon" and name in RETIRED_MUON_KEYS:
        raise UserError(
            f"Config key '{key}' in {source} is no longer a setting: {RETIRED_MUON_KEYS[name]}. Remove it."
        )


def _without_retired(saved: DictConfig) -> DictConfig:
    """A saved config (a checkpoint's) without the settings that have left the config since it was saved."""
    muon = OmegaConf.select(saved, "optimizer.muon")
    if isinstance(muon, DictConfig):
        for name in RETIRED_MUON_KEYS:
            muon.pop(name, None)
    return saved


def _first_line(e: Exception) -> str:
    """An OmegaConf error's own sentence, without the lines of context it appends."""
    text = getattr(e, "msg", None) or str(e)
    return text.strip().splitlines()[0] if text.strip() else type(e).__name__


def _merge(base: DictConfig, layer: Any, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, layer)
    except TypeError as e:  # a mapping where a list belongs, or the reverse (OmegaConf's own TypeError)
        raise UserError(
            f"Config {source} gives a section the wrong shape ({_first_line(e)}): a section such as model.hf "
            "or train is a mapping of keys, a list such as data.sources is a list; `muonrun config show` "
            "prints the expected shape."
        ) from None
    except ConfigKeyError as e:
        key = e.full_key or str(e.key)
        _refuse_retired(key, source)
        raise UserError(f"Unknown config key '{key}' in {source}.{_did_you_mean(base, key)}") from None
    except ValidationError as e:
        allowed = choices().get(e.full_key)
        if allowed:
            value = OmegaConf.select(OmegaConf.create(layer), e.full_key)
            raise UserError(
                f"Config key '{e.full_key}' is '{value}'; choose one of: {', '.join(allowed)} (set in {source})."
            ) from None
        if not e.full_key:  # a whole section given a number or a list
            raise UserError(
                f"Config {source} has the wrong type: {_first_line(e)} (a section takes a mapping of its keys)."
            ) from None
        raise UserError(
            f"Config key '{e.full_key}' in {source} has the wrong type: {_first_line(e)}."
        ) from None
    except OmegaConfBaseException as e:
        raise UserError(
            f"Config {source} could not be merged at '{getattr(e, 'full_key', '?')}': {_first_line(e)}."
        ) from None


def _parse_value(key: str, text: str) -> Any:
    """An override's value as YAML would read it (`100` an int, `[a, b]` a list, `null` None)."""
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist([f"v={text}"]))["v"]
    except Exception as e:
        raise UserError(
            f"Override '{key}={text}': the value is not valid YAML ({' '.join(str(e).split())[:200]}). "
            f"{QUOTING}."
        ) from None


def _apply_override(cfg: DictConfig, key: str, text: str, add: bool) -> DictConfig:
    source = f"override '{key}={text}'"
    if "\n" in text and isinstance(folded := _parse_value(key, text), str):
        raise UserError(
            f"Override '{key}' has a line break in its value, which YAML folds into a space ({folded!r}); "
            "give the value on one line."
        )
    parts = key.split(".")
    for i in range(len(parts) - 1):
        node = OmegaConf.select(cfg, ".".join(parts[: i + 1]))
        index = parts[i + 1]
        if isinstance(node, ListConfig) and (not index.isdigit() or int(index) >= len(node)):
            list_key = ".".join(parts[: i + 1])
            raise UserError(
                f"Config key '{list_key}' is a list of {len(node)} entries, so {source} names no entry "
                f"(indices 0..{len(node) - 1}). Replace the whole list instead ({list_key}="
                f"{'[{path: my.jsonl}]' if list_key.endswith('sources') else '[...]'})."
            )
    in_list = any(part.isdigit() for part in parts)  # a list's entries have fixed keys: '+' adds none
    if (not add or in_list) and OmegaConf.select(cfg, key, default=_ABSENT) is _ABSENT:
        _refuse_retired(key, source)
        hint = _did_you_mean(cfg, key) or (
            " Prefix it with '+' to add a transformers config key (+model.hf.KEY=value)."
            if key.startswith("model.hf.")
            else " `muonrun config docs` lists every key."
        )
        raise UserError(f"Unknown config key '{key}' in {source}.{hint}")
    if not in_list:
        try:
            layer = OmegaConf.from_dotlist([f"{key}={text}"])
        except Exception as e:  # yaml's scanner errors: a `:` or `{` inside an unquoted value
            raise UserError(
                f"Override '{key}={text}': the value is not valid YAML ({' '.join(str(e).split())[:200]}). "
                f"{QUOTING}."
            ) from None
        return _merge(cfg, layer, source)
    value = _parse_value(key, text)  # inside a list element: set in place (a merge cannot index lists)
    try:
        OmegaConf.update(cfg, key, value, merge=False, force_add=add)
    except ValidationError as e:
        raise UserError(f"Config key '{key}' in {source} has the wrong type: {_first_line(e)}.") from None
    except OmegaConfBaseException as e:
        raise UserError(f"Config {source} could not be applied: {_first_line(e)}.") from None
    return cfg


def load_config(
    preset: str | os.PathLike | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    environment: dict[str, Any] | None = None,
) -> Config:
    """Schema defaults < `environment` ({dotted key: value}, e.g. from SLURM) < preset (with its
    `defaults:` bases) < `key=value` overrides, validated: the typed config, made here once. A `preset`
    that is itself a `key=value` (and no file) is the first override of the default preset:
    `muonrun pretrain train.max_steps=5`."""
    if preset is not None and "=" in str(preset) and not Path(preset).is_file():
        preset, overrides = None, [str(preset), *overrides]
    path = resolve_preset(preset or DEFAULT_PRESET)
    cfg = OmegaConf.structured(Config)
    for key, value in (environment or {}).items():
        OmegaConf.update(cfg, key, value)
    cfg = _merge(cfg, _load_yaml(path), f"'{path}'")
    parsed = _parse_overrides(list(overrides))
    for key, value, add in parsed:
        try:
            cfg = _apply_override(cfg, key, value, add)
        except OmegaConfBaseException as e:  # a key OmegaConf cannot even look up (data.sources[a].path)
            raise UserError(f"Override '{key}={value}' names no config key: {_first_line(e)}.") from None
    config = validate(cfg)
    muon = [key for key, _, _ in parsed if key.split(".")[:2] == ["optimizer", "muon"]]
    if muon and config.optimizer.name != "muon":  # a warning, not an error: `bench` variants share overrides
        from muonrun import log

        log.warning(
            f"{', '.join(muon)} set by an override, but optimizer.name is '{config.optimizer.name}': Muon's "
            "settings are ignored and the run trains with AdamW. Add optimizer.name=muon to train with Muon."
        )
    return config


def overridden_settings(
    preset: str | os.PathLike | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    environment: dict[str, Any] | None = None,
) -> list[tuple[str, str, str]]:
    """(dotted key, its value in the preset, its value after the overrides) for each key the overrides set,
    in their order, as text: what a command line changed in its config file (the dry run names them).
    Takes `load_config`'s arguments; call it after `load_config` has accepted them."""
    if preset is not None and "=" in str(preset) and not Path(preset).is_file():
        preset, overrides = None, [str(preset), *overrides]
    cfg = OmegaConf.structured(Config)
    for key, value in (environment or {}).items():
        OmegaConf.update(cfg, key, value)
    path = resolve_preset(preset or DEFAULT_PRESET)
    before = _merge(cfg, _load_yaml(path), f"'{path}'")
    after = before.copy()
    parsed = _parse_overrides(list(overrides))
    for key, value, add in parsed:
        after = _apply_override(after, key, value, add)

    def shown(node: DictConfig, key: str) -> str:
        value = OmegaConf.select(node, key, default=_ABSENT, throw_on_resolution_failure=False)
        if value is _ABSENT:
            return "(not set)"
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True)
        return "null" if value is None else str(value)

    keys = dict.fromkeys(key for key, _, _ in parsed)
    return [(key, shown(before, key), shown(after, key)) for key in keys]


def _typed(cfg: DictConfig) -> Config:
    """Resolve interpolations and turn the OmegaConf tree into the typed dataclasses (which runs each
    section's own checks)."""
    try:
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise UserError(
            f"Config key '{getattr(e, 'full_key', '?')}' cannot be resolved: {_first_line(e)}."
        ) from None


def from_yaml(text: str, source: str = "from the launcher") -> Config:
    """The typed config from `to_yaml` output: how the launcher hands the config to workers, and how a
    checkpoint's saved config.yaml is read back (`muonrun export`). `source` names it in errors."""
    try:
        saved = OmegaConf.create(text)
    except Exception as e:  # yaml's parser errors
        raise UserError(f"Config {source} is not valid YAML: {' '.join(str(e).split())[:300]}.") from None
    if not isinstance(saved, DictConfig):
        raise UserError(f"Config {source} must hold a mapping of keys, not a {type(saved).__name__}.")
    return _typed(_merge(OmegaConf.structured(Config), _without_retired(saved), source))


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def _flat(node: Any, key: str = "") -> dict[str, Any]:
    if isinstance(node, dict) and node:
        return {
            k: v
            for name, child in node.items()
            for k, v in _flat(child, f"{key}.{name}" if key else name).items()
        }
    return {key: node}


def differences(old_yaml: str, new_yaml: str, keys: tuple[str, ...]) -> list[str]:
    """`key: OLD -> NEW` for every setting under `keys` (dotted keys or whole sections) whose value
    differs between two saved configs (e.g. a checkpoint's config.yaml and this run's)."""
    old, new = (
        _flat(OmegaConf.to_container(OmegaConf.create(t), resolve=True)) for t in (old_yaml, new_yaml)
    )
    under = [k for k in dict.fromkeys([*old, *new]) if any(k == p or k.startswith(f"{p}.") for p in keys)]
    missing = "(not set)"
    return [
        f"{k}: {old.get(k, missing)} -> {new.get(k, missing)}"
        for k in under
        if old.get(k, missing) != new.get(k, missing)
    ]


def choices(cls: type = Config, prefix: str = "") -> dict[str, tuple[str, ...]]:
    """{dotted key: allowed values} of every `Literal` field in the schema."""
    out: dict[str, tuple[str, ...]] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if typing.get_origin(hint) is typing.Literal:
            out[f"{prefix}{f.name}"] = typing.get_args(hint)
        elif dataclasses.is_dataclass(hint):
            out.update(choices(hint, f"{prefix}{f.name}."))
    return out


# The largest float32: every number in the config becomes a float32 scalar or tensor somewhere (a
# learning rate in the optimizer's state), which fails on a larger one only once training has started.
FLOAT32_MAX = 3.4028234663852886e38


def _non_finite(node: Any, key: str = "") -> tuple[str, float] | None:
    """The first float in a resolved config tree that is nan, inf or beyond float32's range, with its
    dotted key."""
    if isinstance(node, dict):
        items = node.items()
    elif isinstance(node, list):
        items = enumerate(node)
    else:
        return (key, node) if isinstance(node, float) and not abs(node) <= FLOAT32_MAX else None
    for k, v in items:
        found = _non_finite(v, f"{key}.{k}" if key else str(k))
        if found:
            return found
    return None


def validate(cfg: DictConfig) -> Config:
    """The typed config, after the checks no single section can make (the sections' own run as it is
    typed). Raises UserError; a setting that will run, but not as its user likely means, is warned about."""
    c = _typed(cfg)
    # nan and inf pass every range check (a comparison with nan is False), so they are refused here, once
    found = _non_finite(OmegaConf.to_container(cfg, resolve=True))
    if found:
        raise UserError(
            f"Config key '{found[0]}' is {found[1]}; it must be a finite number within float32's range "
            f"(at most {FLOAT32_MAX:.4g} in magnitude)."
        )
    if not c.data.sources:
        raise UserError("Config key 'data.sources' is empty; list at least one source with a `path`.")
    for group in ("sources", "eval_sources"):
        for i, src in enumerate(getattr(c.data, group)):
            if src.path == "???" or not src.path:
                raise UserError(
                    f"Config key 'data.{group}.{i}.path' is not set; give a file, folder or Hub id."
                )
    if c.train.eval_interval and not (c.data.eval_sources or c.eval.tasks):
        raise UserError(
            f"Config key 'train.eval_interval' is {c.train.eval_interval} but 'data.eval_sources' and 'eval.tasks' "
            "are empty; add an eval source or task, or set train.eval_interval=0."
        )
    if c.eval.tasks and not c.train.eval_interval:
        raise UserError(
            "Config key 'eval.tasks' lists tasks but train.eval_interval is 0, so they would never run; set "
            "train.eval_interval (they run with the eval loss, and at the last step)."
        )
    if c.model.init == "pretrained" and not c.model.name_or_path:
        raise UserError("Config key 'model.init' is 'pretrained' but 'model.name_or_path' is not set.")
    if c.model.lora.enabled and c.model.init != "pretrained":
        raise UserError(
            "Config key 'model.lora.enabled' is true but 'model.init' is 'random': LoRA adapts a pretrained "
            "model. Set model.init=pretrained and model.name_or_path."
        )
    if c.model.lora.enabled and c.parallel.float8 != "none":
        raise UserError(
            "Config key 'parallel.float8' is set with model.lora.enabled: float8 matmuls are not available "
            "for LoRA's frozen layers yet. Set parallel.float8=none."
        )
    if not c.name.strip():
        raise UserError("Config key 'name' is empty; name the run (it names output_dir, runs/${name}).")
    warmup, steps = c.schedule.warmup_steps, c.train.max_steps
    if c.logging.profile and steps < PROFILED_THROUGH:
        from muonrun import log

        log.warning(
            f"logging.profile=true profiles steps {PROFILED_THROUGH - 2}-{PROFILED_THROUGH}, but train.max_steps is "
            f"{steps}: no profile will be written. Raise train.max_steps to {PROFILED_THROUGH} or more."
        )
    if warmup >= steps:
        from muonrun import log  # installs the "muonrun" logger's handler: only when there is a warning

        log.warning(
            f"schedule.warmup_steps ({warmup}) is not shorter than train.max_steps ({steps}): the learning rate "
            f"rises for the whole run, reaching {steps / warmup:.0%} of its peak at the last step, and the "
            f"{c.schedule.name} schedule's decay never starts. Lower schedule.warmup_steps (a few percent of "
            "train.max_steps is usual)."
        )
    return c
