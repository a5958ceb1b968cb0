"""Marker gates shared by every test folder: gpu / multi_gpu tests skip cleanly without them."""

import pytest


def pytest_configure(config):
    """One intra-op thread for CPU-only runs. The suite's tensors are small enough that a
    second thread saves nothing (93 s either way on an idle 2-core machine), and where another
    process holds the other core each parallel op waits for a descheduled worker (measured:
    up to 40 ms per index_add_ instead of 5 us; one consistency test 30 s instead of 1.5)."""
    try:
        import torch
    except ImportError:
        return
    if not torch.cuda.is_available():
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        gpus = 0
    for item in items:
        if "gpu" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU"))
        if "multi_gpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs 2+ NVIDIA GPUs of one host"))
