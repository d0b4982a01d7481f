"""The shape of the code base, checked so it stays: no import cycles among muonrun's modules (imports
inside functions count), no module over 500 lines, no history in code, presets or the README, and
the README's layout section names files and folders that exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "muonrun"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    """{module: muonrun modules it imports}, every import statement; those in TYPE_CHECKING blocks (for
    annotations only) where ``type_checking``."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        tree = ast.parse(path.read_text())
        skipped = {
            id(n)
            for node in ast.walk(tree)
            if not type_checking and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)
        }
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            else:
                continue
            for name in names:
                # importing a.b.c runs a.b.c and its packages; a package that `mod` lives in is already running
                parts = name.split(".")
                for i in range(1, len(parts) + 1):
                    target = ".".join(parts[:i])
                    if target in modules and target != mod and not mod.startswith(target + "."):
                        graph[mod].add(target)
    return graph


def test_no_import_cycles():
    """Not even through imports made for annotations only: a circle there is a circle in the design."""
    graph = import_graph(type_checking=True)
    assert "muonrun.optim.muon" in graph and graph["muonrun.train.trainer"], "the scan found the package"
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt) :] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert not cycles, cycles


def test_no_module_imports_from_a_floor_above_it():
    """The trainer and the parts it wires (train/, model/, checkpoint/, data/, optim/, observe/) never
    import the command-line tools (tools/) or the CLI, which sit above them."""
    graph = import_graph(type_checking=True)
    lower = (
        "muonrun.train",
        "muonrun.model",
        "muonrun.checkpoint",
        "muonrun.data",
        "muonrun.optim",
        "muonrun.observe",
    )
    climbs = {
        (m, t)
        for m, targets in graph.items()
        if m.startswith(lower)
        for t in targets
        if t.startswith("muonrun.tools") or t == "muonrun.cli"
    }
    assert graph["muonrun.train.trainer"] and not climbs, climbs


def test_the_optimizers_stand_alone():
    """`from muonrun.optim import Muon` pulls in neither the config nor the trainer."""
    graph = import_graph()
    seen, todo = set(), ["muonrun.optim.muon", "muonrun.optim.newton_schulz"]
    while todo:
        mod = todo.pop()
        if mod not in seen:
            seen.add(mod)
            todo.extend(graph[mod])
    assert not any(m.startswith(("muonrun.config", "muonrun.train")) for m in seen), sorted(seen)


def test_no_module_is_over_500_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 500
    }
    assert not long, long


def test_code_presets_and_readme_carry_no_history():
    pattern = re.compile(r"\brun ?[0-9]+|session", re.IGNORECASE)
    files = [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.yaml"), ROOT / "README.md"]
    hits = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in files
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, hits


def test_readme_layout_names_what_exists():
    text = (ROOT / "README.md").read_text()
    layout = text.split("## Layout", 1)[1].split("```")[1]
    named = re.findall(r"(?:muonrun|scripts|docs|tests|configs)/[\w./-]*|\b[a-z_]+\.py\b", layout)
    assert len(named) > 20, named
    for name in named:
        candidates = [
            ROOT / name,
            PACKAGE / name,
            *(PACKAGE / d.name / name for d in PACKAGE.iterdir() if d.is_dir()),
            ROOT / "scripts" / name,
        ]
        assert any(c.exists() for c in candidates), name


def test_the_top_level_holds_few_modules_and_the_packages_show_the_flow():
    top = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert len(top) <= 8, top
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert {"config", "launch", "train", "model", "features", "optim", "data", "checkpoint"} <= packages


def test_no_core_module_imports_a_feature():
    """Optional features plug in through muonrun/features/protocol.py: outside muonrun/features/ only
    the registry (`muonrun.features`) and the protocol's types are imported, never a feature module."""
    graph = import_graph()
    features = {m for m in graph if m.startswith("muonrun.features.") and m != "muonrun.features.protocol"}
    assert {"muonrun.features.lora", "muonrun.features.qkclip", "muonrun.features.float8"} <= features
    leaks = {
        (m, f)
        for m, targets in graph.items()
        if not m.startswith("muonrun.features")
        for f in targets & features
    }
    assert not leaks, leaks


# Private names a module may read off objects it does not own, each for a reason: os._exit is the
# documented way to leave a forked child; OmegaConf's node lookup and transformers' experts
# implementation have no public accessor.
FOREIGN_PRIVATE_OK = {"_exit", "_get_node", "_experts_implementation"}


def test_no_module_touches_another_modules_private_members():
    """`x._name` only where `_name` is the module's own (defined or assigned in it) or listed above;
    torch's private names live in muonrun/compat.py alone (its own test names each). So Muon's step
    hands its parts their state as arguments (``optim.step.MuonStep``) instead of each reaching into
    the optimizer."""
    hits = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "compat.py":
            continue
        tree = ast.parse(path.read_text())
        own = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        own |= {
            t.id
            for n in ast.walk(tree)
            if isinstance(n, ast.Assign)
            for t in n.targets
            if isinstance(t, ast.Name)
        }
        own |= {
            n.target.id
            for n in ast.walk(tree)
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
        }
        own |= {
            n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
        }
        for n in ast.walk(tree):
            if not (isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")):
                continue
            if isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                continue
            if n.attr in own or n.attr in FOREIGN_PRIVATE_OK:
                continue
            hits.append(f"{path.relative_to(ROOT)}:{n.lineno}: {ast.unparse(n)}")
    assert not hits, hits
