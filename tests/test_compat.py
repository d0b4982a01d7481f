"""muonrun/compat.py holds every private torch name muonrun uses: each test here fails naming the one a
torch release changed or removed, and one test holds the rest of the package to torch's public API."""

from __future__ import annotations

import ast
import inspect
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import muonrun
from muonrun import compat

PACKAGE = Path(muonrun.__file__).parent


def _torch_rooted(node: ast.AST) -> list[str]:
    """The dotted name of an attribute chain, e.g. ['torch', '_foreach_norm'] (empty if not a name chain)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return []


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


# Private names of other libraries muonrun reads (not torch's), by the library they belong to.
FOREIGN_PRIVATE = {"_get_node": "omegaconf", "_exit": "os (documented: os._exit)"}


def _own_private_names() -> set[str]:
    """Every private name muonrun itself defines (functions, attributes, module globals)."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {n for n in names if _private(n)}


def _private_uses(path: Path, own: frozenset[str] = frozenset()) -> list[str]:
    """Private torch names a module touches: imports from private torch modules or of private names,
    attribute chains from `torch` through a private name, a private attribute that muonrun does not
    define itself (on a torch object), and private torch module names in strings (importlib)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Attribute)
            and _private(node.attr)
            and node.attr not in own | FOREIGN_PRIVATE.keys()
        ):
            receiver = node.value.id if isinstance(node.value, ast.Name) else ""
            if receiver not in ("self", "cls", "torch"):
                found.append(f"line {node.lineno}: .{node.attr}")
        text = node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else ""
        if text.startswith("torch.") and any(_private(p) for p in text.split(".")):
            found.append(f"line {node.lineno}: '{text}'")
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            if any(_private(p) for p in node.module.split(".")):
                found.append(f"line {node.lineno}: from {node.module} import ...")
            found += [
                f"line {node.lineno}: {a.name} from {node.module}" for a in node.names if _private(a.name)
            ]
        elif isinstance(node, ast.Import):
            found += [
                f"line {node.lineno}: import {a.name}"
                for a in node.names
                if a.name.split(".")[0] == "torch" and any(_private(p) for p in a.name.split("."))
            ]
        elif isinstance(node, ast.Attribute):
            chain = _torch_rooted(node)
            if chain[:1] == ["torch"] and any(_private(p) for p in chain[1:]):
                found.append(f"line {node.lineno}: {'.'.join(chain)}")
    return found


OVERRIDES = """
import importlib, inspect, json, pkgutil, muonrun

found = {}
for info in pkgutil.walk_packages(muonrun.__path__, "muonrun."):
    if info.name.endswith((".compat", "__main__")):
        continue
    try:
        module = importlib.import_module(info.name)
    except ImportError:  # an optional extra (peft, torchao) that is not installed
        continue
    for cls_name, cls in inspect.getmembers(module, inspect.isclass):
        if cls.__module__ != module.__name__:
            continue
        for name, value in vars(cls).items():
            # methods written in the class (not what ABC or autograd's metaclass add to it)
            private = name.startswith("_") and not name.endswith("__")
            if not (private and inspect.isfunction(value) and value.__module__ == module.__name__):
                continue
            owners = [b for b in cls.__mro__[1:] if name in vars(b) and b.__module__.startswith("torch")]
            if owners:
                owner = owners[0]
                found.setdefault(info.name, []).append(
                    f"{cls_name}.{name} overrides {owner.__module__}.{owner.__qualname__}.{name}"
                )
print(json.dumps(found))
"""
"""Lists, by module, the methods of muonrun classes that override a private method of a torch class."""


def test_no_module_but_compat_touches_a_private_torch_name():
    """By source (imports, `torch.…._x` chains) and by class (a method that overrides a private method of
    a torch base class); and nothing patches torch's elastic agent or scans /proc for workers."""
    offenders, own = {}, frozenset(_own_private_names())
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "compat.py":
            continue
        uses = _private_uses(path, own)
        text = path.read_text()
        uses += [
            f"mentions {word}"
            for word in ("_monitor_workers", "_restart_workers", "_remaining_restarts", "/proc/")
            if word in text
        ]
        if uses:
            offenders[str(path.relative_to(PACKAGE))] = sorted(set(uses))
    # Importing every module (optional extras too) configures logging and more: in a process of its own.
    found = subprocess.run(
        [sys.executable, "-c", OVERRIDES], capture_output=True, text=True, timeout=300, cwd=PACKAGE.parent
    )
    assert found.returncode == 0, found.stderr[-3000:]
    for module, overrides in json.loads(found.stdout.splitlines()[-1]).items():
        offenders.setdefault(module, []).extend(overrides)
    assert not offenders, offenders


@pytest.mark.parametrize("name", compat.FOREACH)
def test_each_foreach_kernel_computes_what_its_name_says(name):
    assert hasattr(torch, f"_foreach_{name}"), f"torch._foreach_{name} is gone from this torch"
    a, b = [torch.tensor([3.0, 4.0]), torch.tensor([1.0])], [torch.tensor([1.0, 1.0]), torch.tensor([2.0])]
    fn = getattr(compat, f"foreach_{name}")
    if name == "norm":
        got, want = fn(a), [torch.tensor(5.0), torch.tensor(1.0)]
    elif name == "sub":
        got, want = fn(a, b), [torch.tensor([2.0, 3.0]), torch.tensor([-1.0])]
    elif name == "mul":
        got, want = fn(a, 2.0), [torch.tensor([6.0, 8.0]), torch.tensor([2.0])]
    elif name == "lerp":
        got, want = fn(a, b, 0.5), [torch.tensor([2.0, 2.5]), torch.tensor([1.5])]
    else:  # in place
        got = [t.clone() for t in a]
        args = {"mul_": (got, 3.0), "add_": (got, b), "lerp_": (got, b, 0.5), "copy_": (got, b)}[name]
        fn(*args)  # in place: `got` holds the result
        want = {
            "mul_": [torch.tensor([9.0, 12.0]), torch.tensor([3.0])],
            "add_": [torch.tensor([4.0, 5.0]), torch.tensor([3.0])],
            "lerp_": [torch.tensor([2.0, 2.5]), torch.tensor([1.5])],
            "copy_": b,
        }[name]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, msg=lambda m: f"torch._foreach_{name}: {m}")


def test_a_dtensor_local_shard_and_its_offset(world_of_one):
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(12.0).reshape(4, 3)
    dt = distribute_tensor(full, world_of_one, [Shard(0)])
    local = compat.local_tensor(dt)
    assert type(local) is torch.Tensor, "DTensor._local_tensor is no longer the local torch.Tensor"
    assert local.data_ptr() == dt.to_local().data_ptr(), (
        "DTensor._local_tensor no longer shares to_local()'s storage"
    )
    assert compat.local_tensor(full) is full
    assert compat.local_shape_and_offset(dt) == ((4, 3), (0, 0)), (
        "torch.distributed.tensor._utils.compute_local_shape_and_global_offset changed"
    )


@pytest.mark.parametrize("entry", compat.MESH_CACHES, ids=lambda e: f"{e[0]}.{e[1]}")
def test_each_dtensor_mesh_cache_can_be_emptied(entry):
    module, path, method = entry
    try:
        clear = compat.mesh_cache_clearer(module, path, method)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"{module}.{path}{'.' + method if method else ''} is gone from this torch ({e})")
    assert callable(clear), f"{module}.{path}{'.' + method if method else ''} is not callable"
    clear()


def test_adamw_hands_its_group_lists_before_stepping():
    expected = [
        "group",
        "params_with_grad",
        "grads",
        "exp_avgs",
        "exp_avg_sqs",
        "max_exp_avg_sqs",
        "state_steps",
    ]
    params = list(inspect.signature(torch.optim.AdamW._init_group).parameters)[1:]
    assert params == expected, f"torch.optim.AdamW._init_group's parameters changed: {params}"
    seen = []

    class Recording(compat.AdamWWithGroupLists):
        def group_lists(self, group, lists):
            seen.append([list(x) for x in lists])
            lists[0][:] = [p * 0 + p for p in lists[0]]  # a list torch steps is one this hook may replace

    w = torch.nn.Parameter(torch.ones(3))
    w.grad = torch.full((3,), 0.5)
    Recording([w], lr=0.1).step()
    assert len(seen) == 1 and len(seen[0]) == 6, "torch.optim.AdamW._init_group no longer fills 6 lists"
    assert seen[0][0][0] is w and seen[0][1][0] is w.grad, (
        "AdamW._init_group's first lists are not params, grads"
    )


def test_dcp_metadata_path_names_the_metadata_file(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    path = compat.dcp_metadata_path(FileSystemReader(tmp_path))
    assert Path(path) == tmp_path / ".metadata", f"FileSystemReader._get_metadata_path gives {path}"


def test_dcp_writer_threads_are_the_threads_running_write_files_from_queue():
    from torch.distributed.checkpoint import filesystem

    release = threading.Event()
    before = set(threading.enumerate())
    writer = threading.Thread(target=filesystem._write_files_from_queue, args=_blocking_queue(release))
    other = threading.Thread(target=release.wait)
    writer.start(), other.start()
    try:
        assert compat.dcp_writer_threads(before) == [writer], [t.name for t in threading.enumerate()]
    finally:
        release.set()
        writer.join(), other.join()


def _blocking_queue(release: threading.Event) -> tuple:
    """Arguments for `_write_files_from_queue` whose file queue blocks it until `release` is set, then
    hands it nothing (it returns on an empty queue)."""
    import queue

    class Files(queue.Queue):
        def get_nowait(self):
            release.wait()
            raise queue.Empty

    return (None, Files(), queue.Queue(), None, None, 0, False, 1, None)


def test_torch_dynamo_exc_torch_dynamo_exception_is_what_a_failed_compile_raises():
    """torch._dynamo.exc.TorchDynamoException: the base of the error torch.compile raises when its
    backend fails, before the function ran (Muon's fused passes then run eagerly)."""
    base = compat.compile_error()
    assert issubclass(base, Exception)

    def broken_backend(gm, example_inputs):
        raise RuntimeError("backend failure")

    ran = []

    def fn(x):
        ran.append(1)
        return x * 2

    with pytest.raises(base):
        torch.compile(fn, backend=broken_backend, fullgraph=True)(torch.ones(2))
    assert ran == []  # traced, not run: its side effect never happened, so falling back is safe


def test_inductor_loop_ordering_after_fusion_is_an_option_torch_compile_takes():
    """inductor's `loop_ordering_after_fusion` (and `loop_reindexing_after_fusion` where it exists): the
    options Muon's passes over strided expert views turn off, so each must be a name `torch.compile`
    accepts in `options` (an unknown one is refused when the function is compiled)."""
    from torch._inductor import list_options

    options = compat.no_loop_reordering()
    assert "loop_ordering_after_fusion" in options, (
        "torch._inductor.config.loop_ordering_after_fusion is gone"
    )
    assert set(options) <= set(list_options()) and not any(options.values()), options


def test_inductor_emulate_precision_casts_keeps_the_split_low_half():
    """inductor's `emulate_precision_casts`: the split restart compiles `split_bf16` with it, so a value
    cast to bf16 and back keeps its rounding inside the kernel; without it inductor makes the low half
    zero. Compiled on this CPU, the split must equal the eager one bit for bit, with a low half."""
    from torch._inductor import list_options

    from muonrun.optim.ns_products import _split

    options = compat.precise_casts()
    assert set(options) <= set(list_options()) and all(options.values()), options
    T = torch.randn(2, 16, 16)
    eager = _split(T, torch.bfloat16)
    compiled = torch.compile(_split, dynamic=False, options=options)(T, torch.bfloat16)
    assert torch.equal(compiled, eager) and eager[..., 16:].abs().max() > 0


def test_nn_module_parameters_swapped_for_local_shards_and_back(world_of_one):
    """`nn.Module._parameters`: `local_parameters` runs a block on the local shards of a module's DTensor
    parameters, gradients reaching the DTensors, and restores them after."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    lin = torch.nn.Linear(3, 4, bias=False)
    lin.weight = torch.nn.Parameter(
        distribute_tensor(torch.ones(4, 3), init_device_mesh("cpu", (1,)), [Shard(0)])
    )
    original = lin.weight
    with compat.local_parameters(lin):
        assert not isinstance(lin.weight, DTensor) and lin.weight.shape == (4, 3)
        lin(torch.ones(2, 3)).sum().backward()
    assert lin.weight is original and isinstance(original.grad, DTensor)
    assert torch.equal(original.grad.to_local(), torch.full((4, 3), 2.0))
