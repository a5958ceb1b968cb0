"""The library stock off the GPU: one clear error, nothing installed on the model."""

import pytest

from glm5_runtime.library import LibraryStock
from glm5_runtime.reference import ReferenceModel, geometry


def test_library_stock_needs_a_cuda_gpu():
    model = ReferenceModel.random(geometry("tiny"), max_requests=1, max_context=16)
    with pytest.raises(RuntimeError, match="block-scaled _scaled_mm on a CUDA GPU"):
        LibraryStock(model)
    assert not any("linear" in vars(rank) for rank in model.ranks)
