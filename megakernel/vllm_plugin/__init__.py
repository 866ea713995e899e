"""vLLM plugin: uniform decode batches run on the megakernel's program, the rest on vLLM's model.

Registered under the `vllm.general_plugins` entry point (name `megakernel`, pyproject.toml);
vLLM calls `register()` in every process. A model opts in through its architecture name:

    LLM(model=path, hf_overrides={"architectures": ["MegakernelLlamaForCausalLM"]},
        dtype="bfloat16", enforce_eager=True)

Nothing here imports vLLM until vLLM loads one of the model classes (models.py).
"""

from __future__ import annotations

ARCHITECTURES = {  # ours -> vLLM's stock model class (vllm.model_executor.models)
    "MegakernelLlamaForCausalLM": "LlamaForCausalLM",
    "MegakernelQwen3ForCausalLM": "Qwen3ForCausalLM",
    "MegakernelQwen2ForCausalLM": "Qwen2ForCausalLM",
    "MegakernelNemotronHForCausalLM": "NemotronHForCausalLM",
}


def register() -> None:
    """The entry point: make vLLM's model registry know our architectures (lazily)."""
    from vllm import ModelRegistry

    for arch in ARCHITECTURES:
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, f"megakernel.vllm_plugin.models:{arch}")
