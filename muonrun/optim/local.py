"""The matrices a rank steps on its own, in units, and their CUDA graph.

A unit is a bucket of a one-rank shard group (every bucket on one GPU) or a chunk of stacked experts
the rank holds (``muonrun.optim.experts``); its step is ``start`` then ``finish``.

On GPUs everything after ``start`` is replayed from a CUDA graph (``StepGraph``): Muon launches many
kernels per bucket, and where the host cannot keep ahead of the GPU (small models) each launch costs
step time (docs/performance.md). Three things stay out of the graph:

- the momentum pass (``start``), which reads the gradients FSDP2 allocates anew every step; it writes
  into the graph's own ``buffers``, where the graph's work begins;
- the step's learning-rate-dependent numbers, copied every step into the device tensor the graph
  reads (``scalars``);
- matrices exchanged between ranks, and steps that collect telemetry: they run eagerly.

The first ``warmup_steps`` steps run eagerly on the capture stream (compiles and lazy set-up happen
there); the next is captured, and every later step replays. Inside the graph independent stacks run
side by side on ``Lanes`` (``STREAMS`` CUDA streams), the same kernels on the same inputs as on one
stream: the same results bit for bit. Cost: buffers and graph temporaries stay allocated between steps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator, Sequence

import torch
from torch import Tensor

from muonrun.distributed import local_tensor
from muonrun.optim.buckets import apply, orthogonalize, prepare
from muonrun.optim.experts import chunk_shape, stacked_momentum, stacked_update
from muonrun.optim.step import MuonStep

STREAMS = 3


class StepGraph:
    """One step's local work as a CUDA graph: ``buffers`` and ``scalars`` are its inputs, filled by the
    caller before each ``run``."""

    warmup_steps = 2  # eager steps on the capture stream before the capture

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
        """Run ``body``, this step's graph part; ``stats``: Muon's counters, which a replay also advances."""
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
    """CUDA streams on which a graph's independent work runs side by side.

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


Unit = tuple  # (partition, bucket) of a one-rank shard group, or (None, expert chunk)


def local_units(step: MuonStep, plan: Sequence, chunks: Sequence) -> list[Unit]:
    """This step's local units: one-rank partitions' buckets in plan order, then chunks with experts here."""
    units: list[Unit] = [(part, b) for part in plan if part.shard.world == 1 for b in part.buckets]
    return units + [(None, c) for c in chunks if chunk_shape(step.groups, c)[0]]


def buffer_for(step: MuonStep, unit: Unit) -> Tensor:
    """A new buffer of what ``start`` writes for ``unit``."""
    part, what = unit
    if part is None:
        device = local_tensor(what[0][1]).device
        return torch.empty(chunk_shape(step.groups, what), dtype=step.ns_dtype, device=device)
    return torch.empty(what.send_numel, dtype=step.ns_dtype, device=part.device)


def start(step: MuonStep, unit: Unit, buf: Tensor | None = None) -> Tensor:
    """``unit``'s momentum pass (it reads the gradients) into ``buf`` (None: a new one), returned."""
    part, what = unit
    buf = buffer_for(step, unit) if buf is None else buf
    if part is None:
        return stacked_momentum(step, what, buf)
    return prepare(step, part, what, buf)


def finish(step: MuonStep, unit: Unit, buf: Tensor, lanes: Lanes = NO_LANES) -> None:
    """The rest of ``unit``'s step (normalisation, Newton–Schulz, NorMuon's rows, decay and update) from
    ``buf`` and ``UpdateScalars``: each stack on a lane of ``lanes``, the update after them."""
    part, what = unit
    if part is None:
        with lanes.lane():
            stacked_update(step, what, buf)
    else:
        orthogonalize(step, part, what, buf, lanes)
        with lanes.after():
            apply(step, part, what, buf)


def step_local(step: MuonStep, units: Sequence[Unit], graph: StepGraph | None) -> None:
    """Every local unit's step, one after another with buffers of its own; or, with ``graph``, the momentum
    passes into its buffers and the rest from it (``StepGraph.run``), side by side on its lanes."""
    if graph is None:
        for unit in units:
            finish(step, unit, start(step, unit))
        return
    for unit, buf in zip(units, graph.buffers, strict=True):
        start(step, unit, buf)

    def body() -> None:
        graph.lanes.open()
        for unit, buf in zip(units, graph.buffers, strict=True):
            finish(step, unit, buf, graph.lanes)
        graph.lanes.close()

    graph.run(body, step.stats)
