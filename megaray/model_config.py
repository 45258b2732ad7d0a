"""The model section of a run's configuration: a Llama-family decoder in Hugging Face
``config.json`` terms (its shape, attention and RoPE variants, and the parameter count), apart
from the run's other sections (``megaray.config``), which only say how to train it."""
from __future__ import annotations

from dataclasses import dataclass

from megaray.errors import ConfigError
from megaray.shapes import SHAPES


@dataclass(kw_only=True)
class ModelConfig:
    """A Llama-family decoder, in Hugging Face config.json terms.

    In YAML, ``shape`` names a registered shape (``megaray.shapes``) whose values are the
    defaults; any key given beside it overrides that value (``ModelConfig.from_shape`` in code).
    """

    shape: str | None = None
    """Registered shape name (debug, demo, llama1b, llama3b, llama8b) or null."""
    from_path: str | None = None
    """YAML key ``from``: a Hugging Face model directory (config.json + safetensors). Its
    config.json sets every shape key, and training starts from its weights (upcast to fp32)."""
    vocab_size: int = 0
    """Vocabulary size."""
    hidden_size: int = 0
    """Model width."""
    intermediate_size: int = 0
    """SwiGLU MLP width."""
    num_hidden_layers: int = 0
    """Number of decoder blocks."""
    num_attention_heads: int = 0
    """Query heads."""
    num_key_value_heads: int | None = None
    """Key/value heads (grouped-query attention); null means as many as query heads."""
    head_dim: int | None = None
    """Per-head width; null means hidden_size / num_attention_heads."""
    rms_norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    rope_scaling: dict | None = None
    """Rotary scaling, HF style; only rope_type 'llama3' (or null) is supported."""
    max_position_embeddings: int = 2048
    """Longest position the rotary tables are built for."""
    tie_word_embeddings: bool = False
    """Output head shares the input embedding matrix."""
    attention_bias: bool = False
    """Biases on q/k/v projections (Qwen2)."""
    qk_norm: bool = False
    """RMSNorm on queries and keys per head before rotary (Qwen3)."""
    initializer_range: float = 0.02
    """Standard deviation of the normal initialization of matrices."""
    sliding_window: int | None = None
    """Mistral's attention window; megaray computes full causal attention, so sequences may
    not be longer than this."""
    architecture: str | None = None
    """Hugging Face architecture name (set from model.from; used by megaray export)."""

    def __post_init__(self):
        if self.shape is not None and self.shape not in SHAPES:
            raise ConfigError("model.shape", f"unknown shape {self.shape!r}; known: {sorted(SHAPES)}")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"model.{key}", f"must be a positive integer (got {getattr(self, key)})")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.num_key_value_heads <= 0 or self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                "model.num_key_value_heads",
                f"{self.num_key_value_heads} must divide num_attention_heads={self.num_attention_heads}",
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError("model.num_attention_heads", "must divide hidden_size when head_dim is not set")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.head_dim % 2:
            raise ConfigError("model.head_dim", f"must be even for rotary embeddings (got {self.head_dim})")
        if self.rms_norm_eps <= 0:
            raise ConfigError("model.rms_norm_eps", "must be > 0")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind != "llama3":
                raise ConfigError("model.rope_scaling", f"rope_type {kind!r} is not supported (only 'llama3')")
            for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                if k not in self.rope_scaling:
                    raise ConfigError(f"model.rope_scaling.{k}", "is required for rope_type 'llama3'")

    @classmethod
    def from_shape(cls, shape: str, **overrides) -> ModelConfig:
        """A registered shape with some keys overridden."""
        if shape not in SHAPES:
            raise ConfigError("model.shape", f"unknown shape {shape!r}; known: {sorted(SHAPES)}")
        return cls(**{**SHAPES[shape], "shape": shape, **overrides})

    def num_params(self) -> int:
        h, i, L = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        block = 2 * h + h * q + 2 * h * kv + q * h + 3 * h * i
        if self.attention_bias:
            block += q + 2 * kv
        if self.qk_norm:
            block += 2 * self.head_dim
        head = h + (0 if self.tie_word_embeddings else self.vocab_size * h)
        return self.vocab_size * h + L * block + head
