"""Muon's local work replayed from a CUDA graph: one launch where there were hundreds.

Muon's step launches many kernels per bucket (momentum, normalisation, every Newton–Schulz product,
NorMuon's rows, the update); where the host cannot keep ahead of the GPU (small models) each launch
costs step time (docs/performance.md). The graph holds, for the matrices a rank steps on its own
(one-rank shard groups, stacked experts), everything after the momentum pass. Three things stay out:

- the momentum pass, which reads the gradients FSDP2 allocates anew every step; it writes into the
  graph's own ``buffers``, where the graph's work begins;
- the step's learning-rate-dependent numbers (``step.UpdateScalars``), copied every step into the
  device tensor the graph reads (``scalars``);
- matrices exchanged between ranks, and steps that collect telemetry: they run eagerly.

The first ``warmup_steps`` steps run eagerly on the capture stream (compiles and lazy set-up happen
there); the next is captured, and every later step replays. Inside the graph independent stacks run
side by side on ``Lanes`` (``STREAMS`` CUDA streams), with the same kernels and inputs as on one
stream, so the same results bit for bit. Cost: the buffers and the graph's temporaries stay
allocated between steps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator

import torch
from torch import Tensor

STREAMS = 3
"""CUDA streams a graph's independent stacks run on (the same results as one, bit for bit)."""


class StepGraph:
    """One step's local work as a CUDA graph: ``buffers`` and ``scalars`` are its inputs, filled by the
    caller before each ``run``."""

    warmup_steps = 2
    """Eager steps on the capture stream before the capture (compiles and lazy set-up happen there)."""

    def __init__(self, key: Hashable, buffers: list[Tensor], n_scalars: int, streams: int = STREAMS) -> None:
        self.key = key
        self.buffers = buffers
        device = buffers[0].device
        self.scalars = torch.zeros(n_scalars, dtype=torch.float32, device=device)
        self.lanes = Lanes(streams, device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.stats: dict[str, int] = {}  # what one replay adds to Muon's counters
        self.warm = 0
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def run(self, body: Callable[[], None], stats: dict[str, int]) -> None:
        """This step's graph part, ``body``: replayed once captured; before that run eagerly on the
        capture stream (``warmup_steps``), then captured and replayed. ``stats``: Muon's counters,
        which a replay advances as the captured call did."""
        if self.graph is not None:
            self.graph.replay()
            for name, n in self.stats.items():
                stats[name] += n
            return
        if self.stream is None:
            body()
            return
        current = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(current)  # the buffers and scalars were written there
        if self.warm < self.warmup_steps:
            with torch.cuda.stream(self.stream):
                body()
            self.warm += 1
        else:
            before = dict(stats)
            graph = torch.cuda.CUDAGraph()
            try:  # thread_local: the data loader's pinning thread may allocate meanwhile
                with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
                    body()
            except RuntimeError as e:
                raise RuntimeError(
                    f"Capturing Muon's step in a CUDA graph failed ({e}). Set optimizer.muon.eager=true "
                    "(Muon(eager=True)) to launch it kernel by kernel, and report this with the model."
                ) from e
            self.stats = {name: stats[name] - before[name] for name in stats}
            self.graph = graph
            graph.replay()  # capturing ran nothing: this step's work
        current.wait_stream(self.stream)


class Lanes:
    """CUDA streams on which a graph's independent work runs side by side (see the module docstring).

    ``open`` starts every lane after the work queued so far on the current stream; ``lane()`` runs a
    block on the next lane in turn; ``after()`` runs a block on the next lane once every block since
    the previous ``after`` is done (a bucket's update after its stacks); ``close`` makes the current
    stream wait for every lane. With fewer than two streams, or off CUDA, every block runs on the
    current stream in order."""

    def __init__(self, count: int, device: torch.device) -> None:
        self.streams = (
            [torch.cuda.Stream(device) for _ in range(count)] if device.type == "cuda" and count > 1 else []
        )
        self._turn = 0
        self._done: list[torch.cuda.Event] = []

    def _current(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.streams[0].device)

    def _next(self) -> torch.cuda.Stream:
        stream = self.streams[self._turn % len(self.streams)]
        self._turn += 1
        return stream

    def open(self) -> None:
        self._turn, self._done = 0, []
        if self.streams:
            current = self._current()
            for stream in self.streams:
                stream.wait_stream(current)

    @contextlib.contextmanager
    def lane(self) -> Iterator[None]:
        if not self.streams:
            yield
            return
        stream = self._next()
        with torch.cuda.stream(stream):
            yield
        self._done.append(stream.record_event())

    @contextlib.contextmanager
    def after(self) -> Iterator[None]:
        if not self.streams:
            yield
            return
        stream = self._next()
        for event in self._done:
            stream.wait_event(event)
        self._done = []
        with torch.cuda.stream(stream):
            yield

    def close(self) -> None:
        if self.streams:
            current = self._current()
            for stream in self.streams:
                current.wait_stream(stream)


NO_LANES = Lanes(1, torch.device("cpu"))  # every block on the current stream, in order
