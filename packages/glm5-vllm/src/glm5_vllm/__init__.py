"""glm5-vllm: the vLLM 0.33 plugin that runs the GLM-5.3-Flash latency-specialized decode
(`--additional-config '{"decode_backend":"latency_specialized"}'`).

vLLM loads `register` through the `vllm.general_plugins` entry point (in every process, maybe
more than once); it points GLM-5.3-Flash's architectures at this package's subclasses of
vLLM's own model classes, which behave exactly as stock unless the deployment asks for the
specialized decode. Importing this module imports nothing from vLLM."""

__version__ = "0.1.0"

# vLLM architecture -> our subclass in glm5_vllm.models (lazy "module:Class" strings, so
# registering never initializes CUDA).
OVERRIDES = {
    "Glm5NextForCausalLM": "Glm5NextForCausalLM",
    "Glm5NextForConditionalGeneration": "Glm5NextForConditionalGeneration",
    "Glm5NextMTPModel": "Glm5NextMTP",
}


def register() -> None:
    """Point vLLM's GLM-5.3-Flash architectures at glm5-vllm's classes (re-entrant)."""
    from vllm import ModelRegistry

    for arch, cls in OVERRIDES.items():
        ModelRegistry.register_model(arch, f"glm5_vllm.models:{cls}")
