"""Wall time per stage of the reference backbone (`glm5-decode demo`'s breakdown): each
rank's stage methods (`STAGES`, which `bench.StageMarks` marks too) wrapped in place, CUDA
synchronized around each call so stages don't overlap."""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from .reference import ReferenceModel
from .results import STAGES


class StageTimer:
    """Wall time per stage (synchronizing CUDA around each call, so stages don't overlap)."""

    def __init__(self, model: ReferenceModel):
        self.totals: dict[str, float] = defaultdict(float)
        self.cuda = model.device.type == "cuda"
        self.ranks = model.ranks
        for rank in model.ranks:
            for name in STAGES:
                setattr(rank, name, self._wrap(name, getattr(rank, name)))

    def restore(self) -> None:
        """Unwrap the stages (a CUDA-graph capture must not synchronize)."""
        for rank in self.ranks:
            for name in STAGES:
                delattr(rank, name)

    def _wrap(self, name, fn):
        def timed(*args, **kwargs):
            if self.cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            if self.cuda:
                torch.cuda.synchronize()
            self.totals[name] += time.perf_counter() - start
            return out

        return timed
