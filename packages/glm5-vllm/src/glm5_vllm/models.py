"""vLLM's GLM-5.3-Flash model classes as registered by the plugin: subclasses that read the
deployment's specialized-decode settings when they are built and otherwise behave exactly
as vLLM's own (same modules, weights and forward)."""

from __future__ import annotations

import logging

from vllm.models.glm5next import Glm5NextForCausalLM as _CausalLM
from vllm.models.glm5next import Glm5NextForConditionalGeneration as _ConditionalGeneration
from vllm.models.glm5next import Glm5NextMTP as _MTP

from .config import specialized_decode_config

__all__ = ["Glm5NextForCausalLM", "Glm5NextForConditionalGeneration", "Glm5NextMTP"]

logger = logging.getLogger("glm5_vllm")


class _Configured:
    def _configure(self, vllm_config) -> None:
        # Before the modules are built: a requested but unsupported deployment fails here,
        # with every reason, instead of after loading weights.
        self.glm5_decode = specialized_decode_config(vllm_config)
        if self.glm5_decode is not None:
            logger.warning(
                "GLM-5.3-Flash specialized decode requested; glm5-vllm %s does not yet bind "
                "it to vLLM's modules, so every step runs vLLM's stock forward",
                __import__("glm5_vllm").__version__,
            )


class Glm5NextForCausalLM(_Configured, _CausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        self._configure(vllm_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)


class Glm5NextForConditionalGeneration(_Configured, _ConditionalGeneration):
    def __init__(self, *, vllm_config, prefix: str = ""):
        self._configure(vllm_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)


class Glm5NextMTP(_Configured, _MTP):
    def __init__(self, *, vllm_config, prefix: str = ""):
        self._configure(vllm_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
