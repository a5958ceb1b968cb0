"""vLLM's GLM-5.3-Flash model classes as registered by the plugin: subclasses that read the
deployment's specialized-decode settings when they are built and otherwise behave exactly
as vLLM's own (same modules, weights and forward).

With `decode_backend: latency_specialized` on a supported deployment, Glm5NextForCausalLM
binds glm5-runtime's SpecializedDecode to its own modules once vLLM has loaded and processed
its weights (`VllmBackbone`, each weight's layout identified by `layouts`), compiles the
stage kernels on the first forward outside a capture (vLLM's profile run, before any CUDA
graph), and then every forward asks the plan: a planned step (a FULL-graph capture of a
uniform decode or verify) runs the specialized layer loop, every other step vLLM's forward;
compute_logits takes the skinny LM head where the policy picks it.
Glm5NextForConditionalGeneration runs its language model's hooks with the input
embeddings it computed; Glm5NextMTP binds SpecializedDraft to its MTP layers the same way."""

from __future__ import annotations

import logging

from vllm.models.glm5next import Glm5NextForCausalLM as _CausalLM
from vllm.models.glm5next import Glm5NextForConditionalGeneration as _ConditionalGeneration
from vllm.models.glm5next import Glm5NextMTP as _MTP

from .backbone import VllmBackbone, VllmDraftBackbone, VllmStep
from .config import specialized_decode_config
from .metadata import attention_metadata, slot_mappings, step_context

__all__ = ["Glm5NextForCausalLM", "Glm5NextForConditionalGeneration", "Glm5NextMTP"]

logger = logging.getLogger("glm5_vllm")


class _Configured:
    def _configure(self, vllm_config) -> None:
        # Before the modules are built: a requested but unsupported deployment fails here,
        # with every reason, instead of after loading weights.
        self.glm5_decode = specialized_decode_config(vllm_config)
        self.glm5_specialized = None  # bound once vLLM has processed the loaded weights
        self._glm5_prepared = False


class _Binds(_Configured):
    _draft = False  # binds SpecializedDraft (the MTP drafter) instead of SpecializedDecode

    def process_weights_after_loading(self) -> None:
        """vLLM 0.33's loader calls this model-level hook last (model_loader/utils.py), after
        `load_weights` and after every module's quant method and attention layer rewrote
        its weights for the kernels that run them (UE8M0 re-quantization, DeepGEMM's packed
        scales, FlashInfer's expert shuffles, MLA's W_UK_T / W_UV): the stages read the
        tensors vLLM runs, never ones processing replaces. Called again (a weight reload),
        it binds again."""
        hook = getattr(super(), "process_weights_after_loading", None)
        if hook is not None:
            hook()
        if self.glm5_decode is not None:
            self.glm5_specialized = _bind(self, self.glm5_decode, draft=self._draft)
            self._glm5_prepared = False


class Glm5NextForCausalLM(_Binds, _CausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        self._configure(vllm_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kw):
        def stock(*_):
            return super(Glm5NextForCausalLM, self).forward(
                input_ids, positions, intermediate_tensors, inputs_embeds, **kw
            )

        decode = self.glm5_specialized
        if decode is None or intermediate_tensors is not None:
            return stock()
        if input_ids is None and inputs_embeds is None:
            return stock()
        # positions: [T], or [3, T] with a multimodal model's M-RoPE
        tokens = positions.shape[-1]
        context = step_context(tokens, aux_layers=decode.backbone.aux_layers)
        if not self._glm5_prepared:
            if context.capturing:  # vLLM always runs its profile step first; be safe anyway
                return stock()
            decode.prepare()  # a stage whose kernels fail to compile warns and runs stock
            self._glm5_prepared = True
        placement = VllmStep(positions, context, attention_metadata(), slot_mappings())
        return decode.forward(
            input_ids, placement, stock, capturing=context.capturing, graph=context.graph,
            embeds=inputs_embeds,
        )  # fmt: skip

    def compute_logits(self, hidden_states):
        decode = self.glm5_specialized
        if decode is not None and self._glm5_prepared and decode.serves_logits(hidden_states):
            return decode.compute_logits(hidden_states)
        return super().compute_logits(hidden_states)


def _bind(model, config, draft: bool = False):
    """SpecializedDecode (or, for the MTP drafter, SpecializedDraft) over the model's own
    modules; on any failure one warning and None (vLLM's stock forward runs)."""
    try:
        if draft:
            from glm5_runtime.draft import SpecializedDraft as Specialized

            backbone = VllmDraftBackbone
        else:
            from glm5_runtime.decode import SpecializedDecode as Specialized

            backbone = VllmBackbone
        adapter = backbone(model)
        try:
            return Specialized(adapter, config)
        finally:
            adapter.warn_refused(logger)
    except Exception as e:  # a missing kernel toolchain, an unexpected module layout
        logger.warning(
            "GLM-5.3-Flash specialized %s not bound (%s: %s); vLLM's stock forward runs",
            "draft" if draft else "decode", type(e).__name__, e,
        )  # fmt: skip
        return None


class Glm5NextForConditionalGeneration(_Configured, _ConditionalGeneration):
    """vLLM builds the language model through its registry, so it is the plugin's
    Glm5NextForCausalLM, which binds itself once its weights are processed (this wrapper's
    post-load hook calls its own). vLLM's wrapper calls the language model's inner `model`
    directly; this one calls its forward, so the hooks see the step (with the wrapper's
    input embeddings)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        self._configure(vllm_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)

    def process_weights_after_loading(self) -> None:
        """vLLM calls the model-level hook on the model it loaded (this wrapper) only: the
        language model binds from here, after its weights were processed."""
        hook = getattr(super(), "process_weights_after_loading", None)
        if hook is not None:
            hook()
        hook = getattr(self.language_model, "process_weights_after_loading", None)
        if hook is not None:
            hook()

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kw):
        language = self.language_model
        if getattr(language, "glm5_specialized", None) is None:
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kw)
        if intermediate_tensors is not None:  # as vLLM's wrapper does
            inputs_embeds = None
        return language.forward(input_ids, positions, intermediate_tensors, inputs_embeds)


class Glm5NextMTP(_Binds, _MTP):
    """The MTP drafter: SpecializedDraft over its own layers (`VllmDraftBackbone`), bound
    once its weights are processed; FULL-graph captures of draft decodes (one token per
    request) and uniform draft prefills (q per request) run planned, with every row carried
    on (vLLM's proposer samples rows of its choosing from the [N, D] output)."""

    _draft = True

    def __init__(self, *, vllm_config, prefix: str = ""):
        self._configure(vllm_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)

    def forward(
        self, input_ids, positions, hidden_states, intermediate_tensors=None,
        inputs_embeds=None, spec_step_idx: int = 0,
    ):  # fmt: skip
        def stock():
            return super(Glm5NextMTP, self).forward(
                input_ids, positions, hidden_states, intermediate_tensors, inputs_embeds,
                spec_step_idx,
            )  # fmt: skip

        draft = self.glm5_specialized
        if draft is None or (input_ids is None and inputs_embeds is None):
            return stock()
        context = step_context(positions.shape[-1])
        if not self._glm5_prepared:
            if context.capturing:
                return stock()
            draft.prepare()
            self._glm5_prepared = True
        placement = VllmStep(positions, context, attention_metadata(), slot_mappings())
        decision = draft.plan(placement, context.capturing, context.graph)
        if decision.step is None:
            return stock()
        k = spec_step_idx % len(draft.layers)
        return draft.run(
            decision.step, k, input_ids, hidden_states, placement, embeds=inputs_embeds,
            sampled_only=False,
        )  # fmt: skip
