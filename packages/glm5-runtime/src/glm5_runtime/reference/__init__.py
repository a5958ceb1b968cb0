"""The reference GLM-5.3-Flash backbone: the stock path written plainly in torch, over
caches in vLLM 0.33's layouts; checked against transformers' Glm5Next."""

from .config import TINY, Geometry, geometry
from .model import ReferenceModel
from .stages import Placement
from .weights import load_rank, model_specs, random_rank, random_state_dict

__all__ = [
    "TINY",
    "Geometry",
    "Placement",
    "ReferenceModel",
    "geometry",
    "load_rank",
    "model_specs",
    "random_rank",
    "random_state_dict",
]
