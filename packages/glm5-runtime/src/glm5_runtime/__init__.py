"""glm5-runtime: the planned decode loop over a GLM-5.3-Flash backbone (the backbone
protocol, plan / is_decode, SpecializedDecode, SpecializedDraft), the pure-torch reference
backbone and the `glm5-decode` CLI. No vLLM."""

__version__ = "0.1.0"
