"""glm5-policy: which fused kernel each stage of the GLM-5.3-Flash specialized decode runs
at each token count. No torch: the plugin reads it while vLLM parses its configuration."""

from .config import MAX_Q, DecodeConfig
from .stages import FAMILIES, MAX_TOKENS, STAGES
from .table import Policy, PolicyError, default_table, loads, parse_table

__version__ = "0.1.0"

__all__ = [
    "FAMILIES",
    "MAX_Q",
    "MAX_TOKENS",
    "STAGES",
    "DecodeConfig",
    "Policy",
    "PolicyError",
    "default_table",
    "family_of",
    "loads",
    "parse_table",
]


def family_of(capability: tuple[int, int]) -> str | None:
    """The default-table family of a CUDA compute capability, None where none ships."""
    major = capability[0]
    return {9: "sm90", 10: "sm100"}.get(major)
