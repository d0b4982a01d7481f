"""Peak TFLOP/s per device, for MFU: the datasheet table, the lookup by device name, and which of its
columns (bf16, tf32, fp32) a run's matmuls use. How MFU is computed: docs/observability.md#mfu.
"""

from __future__ import annotations

import re

import torch

from muonrun import log

# Dense (no sparsity) peak TFLOP/s per device from the vendors' datasheets: bf16 tensor cores, tf32 (fp32
# matmuls when torch allows TF32) and plain fp32. A row matches when all its tokens are in the device name
# (split on spaces and dashes); the first match wins, so the specific variants come before the generic ones.
PEAK_TFLOPS: list[tuple[tuple[str, ...], dict[str, float]]] = [
    (("GB200",), {"bf16": 2500.0, "tf32": 1250.0, "fp32": 80.0}),
    (("B200",), {"bf16": 2250.0, "tf32": 1125.0, "fp32": 75.0}),
    (("B100",), {"bf16": 1750.0, "tf32": 900.0, "fp32": 60.0}),
    (("GH200",), {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (("H200", "NVL"), {"bf16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (("H200",), {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (("H100", "NVL"), {"bf16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (("H100", "PCIE"), {"bf16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    (("H100",), {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (("H800", "PCIE"), {"bf16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    (("H800",), {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (("H20",), {"bf16": 148.0, "tf32": 74.0, "fp32": 44.0}),
    (("A100",), {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (("A800",), {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (("L40S",), {"bf16": 362.05, "tf32": 183.0, "fp32": 91.6}),
    (("L40",), {"bf16": 181.05, "tf32": 90.5, "fp32": 90.5}),
    (("L4",), {"bf16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (("A10",), {"bf16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (("RTX", "4090"), {"bf16": 165.2, "tf32": 82.6, "fp32": 82.6}),
    (("MI325X",), {"bf16": 1307.4, "tf32": 653.7, "fp32": 163.4}),
    (("MI300X",), {"bf16": 1307.4, "tf32": 653.7, "fp32": 163.4}),
    (("MI250X",), {"bf16": 383.0, "tf32": 95.7, "fp32": 95.7}),
]


def matmul_precision(param_dtype: str, device_type: str) -> str:
    """Which column of PEAK_TFLOPS a run's matmuls use: `bf16`, `tf32` or `fp32` (mirrors parallelize's `auto`)."""
    if param_dtype == "bfloat16" or (param_dtype == "auto" and device_type == "cuda"):
        return "bf16"
    return "tf32" if torch.get_float32_matmul_precision() != "highest" else "fp32"


def lookup_peak_tflops(device_name: str, precision: str) -> float | None:
    """Peak dense TFLOP/s of a device named like torch.cuda.get_device_name(); None, with one warning per
    name, when the table does not know it (an invented number would make every MFU wrong)."""
    tokens = set(re.split(r"[\s\-_]+", device_name.upper()))
    for pattern, peaks in PEAK_TFLOPS:
        if tokens.issuperset(pattern):
            return peaks[precision]
    log.once(
        f"unknown-device-{device_name}",
        f"Unknown device '{device_name}': MFU is not reported. Set logging.peak_tflops (its dense "
        f"{precision} TFLOP/s) to report it.",
        warn=True,
    )
    return None
