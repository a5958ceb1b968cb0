"""GPU timing for benchmarks: CUDA-graph replays timed with one CUDA event pair each."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch

__all__ = ["graph_calls_us", "replay_times"]


def replay_times(graph: torch.cuda.CUDAGraph, iters: int) -> list[float]:
    """Milliseconds of each of `iters` replays of `graph`."""
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def graph_calls_us(fns: Sequence[Callable[[], object]], iters: int = 15) -> float:
    """Median microseconds per call of `fns` run back to back in one CUDA graph (each run once
    eagerly first, so nothing compiles or allocates for the first time inside the capture)."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    ms = statistics.median(replay_times(graph, iters))
    del graph
    return ms * 1e3 / len(fns)
