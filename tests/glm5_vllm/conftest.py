"""Real vLLM 0.33 configuration objects for tiny GLM-5.3-Flash configs (they construct on CPU
with DeviceConfig(device="cpu"), reading a local config.json offline)."""

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A folder holding the tiny geometry's config.json, as a checkpoint's (with "mhc")."""
    from glm5_runtime.reference import geometry

    config = geometry("tiny").to_hf().to_dict()
    config["architectures"] = ["Glm5NextForCausalLM"]
    config["mhc"] = True  # real checkpoints set it; transformers' config does not declare it
    folder = tmp_path_factory.mktemp("glm5-tiny")
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.fixture
def vllm_config(model_dir):
    """VllmConfig(**sections) for the tiny model on CPU; sections override the defaults."""
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig

    def build(model_kw=None, **sections):
        model = ModelConfig(
            model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", **(model_kw or {})
        )
        return VllmConfig(model_config=model, device_config=DeviceConfig(device="cpu"), **sections)

    return build
