"""Shared test set-up: the longest files collected first; GPU tests are skipped without a GPU; every test
runs offline; `one_thread`; process groups made in this process are freed before it exits."""

import gc
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# The files that launch the most workers, longest first. With `-n 2 --dist loadfile
# --no-loadscope-reorder` pytest-xdist hands out files in collection order as its workers free up, so the
# long ones start early and the two workers finish together (by default it orders files by their number
# of tests, and a file of three long launches came last, one worker idle for minutes).
LONGEST_FIRST = (
    "test_checkpoint.py",
    "test_expert_parallel.py",
    "test_tensor_parallel.py",
    "test_layouts.py",
    "test_checkpoint_integrity.py",
    "test_train_state.py",
    "test_cluster.py",
    "test_launch.py",
    "test_ramp.py",
    "test_eval.py",
    "test_failures.py",
    "test_lora.py",
    "test_muon.py",
    "test_moe.py",
)


def pytest_collection_modifyitems(config, items):
    import torch

    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def one_thread():
    """Tiny matrices: intra-op threads only add overhead (and stall on a busy 2-core CI machine)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture
def world_of_one():
    """A gloo process group of one rank in this process and its 1-D mesh (`dp_shard`), as
    `muonrun pretrain --nproc-per-node 1` makes on CPU; the group is destroyed after the test, so no
    later test in this process (an xdist worker runs many files) finds one."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    if created:
        dist.destroy_process_group()


def pytest_sessionfinish(session, exitstatus):
    """Tests that ran a process group in this process leave it in torch's DTensor caches: free it before
    interpreter teardown, where gloo's threads can abort pytest after every test passed."""
    import torch.distributed as dist

    from muonrun.distributed import release_process_groups

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    release_process_groups()
    gc.freeze()  # the exit frees everything at once: the final collections skip it (seconds with torch loaded)


@pytest.fixture
def reseal():
    """`reseal(checkpoint, name, text)`: replace one file of a checkpoint (None: remove it) and rewrite the
    manifest to match, as a checkpoint saved that way would be (an older muonrun's without config.yaml,
    which recorded no architecture either; another run's config)."""
    import json

    from muonrun.checkpoint import META
    from muonrun.checkpoint.files import hash_files, read_meta, seal

    def rewrite(checkpoint, name: str, text: str | None) -> None:
        meta = {k: v for k, v in read_meta(checkpoint).items() if k != "manifest_sha256"}
        path = checkpoint / name
        if text is None:
            path.unlink()
            meta["files"].pop(name)
            if name == "config.yaml":
                meta.pop("architecture", None)
        else:
            path.write_text(text)
            meta["files"].update(hash_files([path]))
        (checkpoint / META).write_text(json.dumps(seal(meta), indent=1))

    return rewrite
