"""Tiny configurations and randomly initialised models for fast, hermetic tests and notebooks."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from jaxengine.models.llama import Llama, LlamaConfig


def tiny_llama_config(vocab_size: int = 256, **overrides) -> LlamaConfig:
  """A Llama config small enough to compile and run in well under a second on CPU.

  Defaults: 2 layers, hidden 64, 4 query heads over 2 key/value heads of width 16 (so grouped
  query attention is exercised), MLP width 128, rope_theta 10000, tied input/output embeddings
  (like SmolLM2), BOS 1, EOS 2.

  Args:
    vocab_size: vocabulary size.
    **overrides: any other `LlamaConfig` field.

  Returns:
    The `LlamaConfig`.
  """
  fields = dict(
    vocab_size=vocab_size,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
  )
  unknown = set(overrides) - {f.name for f in dataclasses.fields(LlamaConfig)}
  if unknown:
    raise TypeError(f"unknown LlamaConfig fields: {sorted(unknown)}")
  fields.update(overrides)
  return LlamaConfig(**fields)


def tiny_llama(
  seed: int = 0,
  config: LlamaConfig | None = None,
  *,
  dtype=jnp.float32,
  **config_overrides,
) -> tuple[Llama, LlamaConfig]:
  """A randomly initialised tiny `Llama`.

  Args:
    seed: initialisation seed.
    config: a full config; defaults to `tiny_llama_config(**config_overrides)`.
    dtype: model dtype.
    **config_overrides: passed to `tiny_llama_config` when ``config`` is None.

  Returns:
    ``(model, config)``.
  """
  if config is None:
    config = tiny_llama_config(**config_overrides)
  elif config_overrides:
    raise TypeError("pass either config or config overrides, not both")
  return Llama(config, dtype=dtype, rngs=nnx.Rngs(seed)), config
