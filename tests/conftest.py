"""Marker gates shared by every test folder: gpu / multi_gpu tests skip cleanly without them."""

import pytest


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
