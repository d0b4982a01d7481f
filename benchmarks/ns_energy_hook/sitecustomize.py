"""Study hook for benchmarks/bench_ns_energy.sh: with MUONRUN_STUDY_PRODUCTS=triton in the environment,
every Python process that has this folder on PYTHONPATH (the launcher and its torchrun workers) runs
Muon's Newton–Schulz with benchmarks/ns_triton.py's upper-triangle products instead of torch's, through
``Muon._newton_schulz`` (the override point the tests use). Without the variable it does nothing.

It is a study, not a setting: on an H200 those kernels are slower per FLOP than cuBLAS (docs/performance.md,
[w1]); the question it answers is what about a third fewer Newton–Schulz FLOPs do to the whole step
on a GPU that runs at its power cap ([v5])."""

import os
import sys

if os.environ.get("MUONRUN_STUDY_PRODUCTS") == "triton":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
    from ns_triton import TritonProducts

    from muonrun.optim import muon
    from muonrun.optim.newton_schulz import ns_iterations

    _products = TritonProducts()

    def _triton_newton_schulz(self, X, per_step, **kw):
        return ns_iterations(X, per_step, gram=self.gram, products=[_products] * len(per_step), **kw)

    muon.Muon._newton_schulz = _triton_newton_schulz
    print(
        "ns_energy_hook: Muon's symmetric products run on benchmarks/ns_triton.py",
        file=sys.stderr,
        flush=True,
    )
