"""Tiny Hugging Face checkpoints written by the tests, and a float64 NumPy reference forward.

Written from the architectures' published descriptions (and transformers' documented config
fields), not from jaxengine: the reference reads the checkpoint's own tensors by their Hugging
Face names, in PyTorch's ``(out, in)`` layout, so a wrong name mapping, transpose, head reshape,
bias, norm or rotary rule in jaxengine shows up as a mismatch.

- Llama: pre-norm RMSNorm blocks, grouped-query attention with half-split rotary embeddings,
  SwiGLU MLP; ``attention_bias`` adds biases to q, k, v and o. Rope type ``llama3`` rescales the
  rotary frequencies (Meta's rule, written below as a plain loop over frequencies).
- Mistral: the same, each query seeing only the last ``sliding_window`` positions.
- Qwen2: biases on q, k and v (never o).
- Qwen3: an RMSNorm over each query/key head (weights ``[head_dim]``) before the rotation;
  ``head_dim`` need not be ``hidden_size / num_attention_heads``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import safetensors.numpy
import transformers

_CONFIG_CLASSES = {
  "LlamaForCausalLM": transformers.LlamaConfig,
  "MistralForCausalLM": transformers.MistralConfig,
  "Qwen2ForCausalLM": transformers.Qwen2Config,
  "Qwen3ForCausalLM": transformers.Qwen3Config,
}
TINY = dict(
  vocab_size=128,
  hidden_size=64,
  intermediate_size=96,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  max_position_embeddings=64,
  rms_norm_eps=1e-6,
)


def hf_config(architecture: str, **fields) -> transformers.PretrainedConfig:
  """A transformers config object of `architecture` (tiny sizes unless overridden)."""
  config = _CONFIG_CLASSES[architecture](**{**TINY, **fields})
  config.architectures = [architecture]
  return config


def config_dict(config: transformers.PretrainedConfig) -> dict:
  """The config as its ``config.json`` holds it."""
  return json.loads(config.to_json_string())


def _head_dim(c: dict) -> int:
  return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]


def tensor_shapes(c: dict) -> dict[str, tuple[int, ...]]:
  """Every tensor a checkpoint of config `c` holds, by Hugging Face name."""
  e, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
  h, k, d = c["num_attention_heads"], c["num_key_value_heads"], _head_dim(c)
  family = c["model_type"]
  shapes = {"model.embed_tokens.weight": (v, e), "model.norm.weight": (e,)}
  if not c.get("tie_word_embeddings"):
    shapes["lm_head.weight"] = (v, e)
  for i in range(c["num_hidden_layers"]):
    p = f"model.layers.{i}."
    shapes.update(
      {
        p + "input_layernorm.weight": (e,),
        p + "post_attention_layernorm.weight": (e,),
        p + "self_attn.q_proj.weight": (h * d, e),
        p + "self_attn.k_proj.weight": (k * d, e),
        p + "self_attn.v_proj.weight": (k * d, e),
        p + "self_attn.o_proj.weight": (e, h * d),
        p + "mlp.gate_proj.weight": (f, e),
        p + "mlp.up_proj.weight": (f, e),
        p + "mlp.down_proj.weight": (e, f),
      }
    )
    qkv_bias = family == "qwen2" or (family in ("llama", "qwen3") and c.get("attention_bias"))
    if qkv_bias:
      shapes.update(
        {
          p + "self_attn.q_proj.bias": (h * d,),
          p + "self_attn.k_proj.bias": (k * d,),
          p + "self_attn.v_proj.bias": (k * d,),
        }
      )
    if family in ("llama", "qwen3") and c.get("attention_bias"):
      shapes[p + "self_attn.o_proj.bias"] = (e,)
    if family == "qwen3":
      shapes[p + "self_attn.q_norm.weight"] = (d,)
      shapes[p + "self_attn.k_norm.weight"] = (d,)
  return shapes


def random_tensors(c: dict, seed: int = 0) -> dict[str, np.ndarray]:
  """float32 random tensors for config `c`: matrices with std ``fan_in ** -0.5``, norm weights
  near 1, biases of std 0.1 (so every tensor visibly changes the output)."""
  rng = np.random.default_rng(seed)
  tensors = {}
  for name, shape in tensor_shapes(c).items():
    if name.endswith("norm.weight"):
      value = 1.0 + 0.2 * rng.standard_normal(shape)
    elif name.endswith(".bias"):
      value = 0.1 * rng.standard_normal(shape)
    else:  # [out, in] matrices and the [V, E] embedding
      value = rng.standard_normal(shape) * shape[1] ** -0.5
    tensors[name] = value.astype(np.float32)
  return tensors


def write_checkpoint(
  directory: Path,
  config: transformers.PretrainedConfig,
  tensors: dict[str, np.ndarray],
  *,
  num_shards: int = 1,
  generation_eos: list[int] | None = None,
) -> Path:
  """Writes ``config.json`` (transformers' `save_pretrained`) and the safetensors files.

  One shard is ``model.safetensors``; more are ``model-0000i-of-0000n.safetensors`` with a
  ``model.safetensors.index.json`` weight map, as transformers shards.
  """
  directory.mkdir(parents=True, exist_ok=True)
  config.save_pretrained(directory)
  if generation_eos is not None:
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
  names = list(tensors)
  if num_shards == 1:
    safetensors.numpy.save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory
  weight_map = {}
  per_shard = math.ceil(len(names) / num_shards)
  for i in range(num_shards):
    file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
    part = {n: tensors[n] for n in names[i * per_shard : (i + 1) * per_shard]}
    safetensors.numpy.save_file(part, directory / file, metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(part, file))
  index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
  (directory / "model.safetensors.index.json").write_text(json.dumps(index))
  return directory


# --------------------------------------------------------------------------- float64 reference


def reference_inv_freq(head_dim: int, theta: float, rope: dict) -> np.ndarray:
  """Rotary frequencies, with Meta's Llama 3.1 rule applied one frequency at a time."""
  freqs = [theta ** (-(2 * i) / head_dim) for i in range(head_dim // 2)]
  if (rope.get("rope_type") or rope.get("type") or "default") != "llama3":
    return np.array(freqs)
  factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
  old_context = rope["original_max_position_embeddings"]
  scaled = []
  for freq in freqs:
    wavelength = 2 * math.pi / freq
    if wavelength < old_context / high:
      scaled.append(freq)
    elif wavelength > old_context / low:
      scaled.append(freq / factor)
    else:
      smooth = (old_context / wavelength - low) / (high - low)
      scaled.append((1 - smooth) * freq / factor + smooth * freq)
  return np.array(scaled)


def _rms(x, weight, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _rotate(x, positions, inv_freq):
  """Half-split rotation of ``[T, N, D]``: feature i pairs with feature i + D/2."""
  angles = positions[:, None] * inv_freq[None, :]  # [T, D/2]
  cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
  half = x.shape[-1] // 2
  x1, x2 = x[..., :half], x[..., half:]
  return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def reference_logits(c: dict, tensors: dict[str, np.ndarray], token_ids) -> np.ndarray:
  """``[T, V]`` float64 logits of one sequence at positions ``0..T-1`` (no cache)."""
  w = {name: np.asarray(t, np.float64) for name, t in tensors.items()}
  h, k, d = c["num_attention_heads"], c["num_key_value_heads"], _head_dim(c)
  eps = c["rms_norm_eps"]
  rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
  inv_freq = reference_inv_freq(d, rope.get("rope_theta", c.get("rope_theta", 10000.0)), rope)
  ids = np.asarray(token_ids)
  t = len(ids)
  positions = np.arange(t, dtype=np.float64)
  visible = np.arange(t)[None, :] <= np.arange(t)[:, None]  # [query, key]
  window = c.get("sliding_window") if c["model_type"] == "mistral" else None
  if window:
    visible &= np.arange(t)[:, None] - np.arange(t)[None, :] < window

  def linear(x, name):
    y = x @ w[name + ".weight"].T
    return y + w[name + ".bias"] if name + ".bias" in w else y

  x = w["model.embed_tokens.weight"][ids]  # [T, E]
  for i in range(c["num_hidden_layers"]):
    p = f"model.layers.{i}."
    a = _rms(x, w[p + "input_layernorm.weight"], eps)
    q = linear(a, p + "self_attn.q_proj").reshape(t, h, d)
    key = linear(a, p + "self_attn.k_proj").reshape(t, k, d)
    value = linear(a, p + "self_attn.v_proj").reshape(t, k, d)
    if p + "self_attn.q_norm.weight" in w:
      q = _rms(q, w[p + "self_attn.q_norm.weight"], eps)
      key = _rms(key, w[p + "self_attn.k_norm.weight"], eps)
    q, key = _rotate(q, positions, inv_freq), _rotate(key, positions, inv_freq)
    out = np.zeros((t, h, d))
    for head in range(h):
      kv = head // (h // k)  # heads sharing a key/value head are adjacent
      scores = q[:, head] @ key[:, kv].T / math.sqrt(d)  # [T, T]
      scores = np.where(visible, scores, -np.inf)
      probs = np.exp(scores - scores.max(-1, keepdims=True))
      out[:, head] = (probs / probs.sum(-1, keepdims=True)) @ value[:, kv]
    x = x + linear(out.reshape(t, h * d), p + "self_attn.o_proj")
    m = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
    gate = linear(m, p + "mlp.gate_proj")
    x = x + linear(gate / (1 + np.exp(-gate)) * linear(m, p + "mlp.up_proj"), p + "mlp.down_proj")
  x = _rms(x, w["model.norm.weight"], eps)
  head_weight = w.get("lm_head.weight", w["model.embed_tokens.weight"])
  return x @ head_weight.T


def reference_greedy(c: dict, tensors: dict[str, np.ndarray], prompt, num_tokens: int) -> list:
  """Greedy continuation by the reference (full recomputation per token)."""
  ids = list(prompt)
  for _ in range(num_tokens):
    ids.append(int(np.argmax(reference_logits(c, tensors, ids)[-1])))
  return ids[len(prompt) :]
