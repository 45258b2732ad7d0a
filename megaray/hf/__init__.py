"""Hugging Face interop: a small adapter at the edge that nothing in the core imports.

``megaray.hf.read`` turns a model directory (config.json and safetensors) into a model config
and master weights; ``megaray.hf.export`` writes a checkpoint back as a model directory that
transformers loads. Supported architectures: LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM, Qwen3ForCausalLM, Olmo2ForCausalLM, Phi3ForCausalLM (Phi-3, Phi-4) and
Gemma3ForCausalLM (Gemma 3's text model),
and the mixtures of experts Qwen3MoeForCausalLM,
MixtralForCausalLM and OlmoeForCausalLM, whose parameter names are megaray's own
(``megaray.layout`` uses Hugging Face's names, each expert's matrices and Phi-3's fused
q/k/v and gate/up matrices as the Hub stores them), so both directions copy tensor by tensor.
"""
from __future__ import annotations

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Olmo2ForCausalLM": "olmo2",
    "Phi3ForCausalLM": "phi3",
    "Gemma3ForCausalLM": "gemma3_text",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "OlmoeForCausalLM": "olmoe",
}
MOE = ("qwen3_moe", "mixtral", "olmoe")
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
              "generation_config.json", "chat_template.jinja")
