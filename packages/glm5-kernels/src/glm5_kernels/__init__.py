"""glm5-kernels: GPU kernels for GLM-5.3-Flash-style decode (and any model with the same
ops). One folder per op family; each op is a torch reference (the executable spec, runs on
CPU) plus GPU implementations behind one public entry point. Imports no other glm5 package
and no vLLM."""

__version__ = "0.1.0"
