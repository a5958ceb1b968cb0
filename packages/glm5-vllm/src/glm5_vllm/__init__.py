"""glm5-vllm: the vLLM 0.33 plugin that runs the GLM-5.3-Flash latency-specialized decode
(`--additional-config '{"decode_backend":"latency_specialized"}'`)."""

__version__ = "0.1.0"
