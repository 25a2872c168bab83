"""Write a Hugging Face directory (config, safetensors, tokenizer) holding a GGUF model's weights.

Other engines (`vllm serve`, transformers) read Hugging Face directories, not the GGUF file the
default model ships as. This script loads the GGUF with jaxengine (every tensor dequantized to
float32, the query/key rows put back into Hugging Face's rotary order), takes the parameters in
checkpoint layout with `jaxengine.models.weights.named_weights` (Llama's specs name them as
Hugging Face does) and writes:

* ``config.json`` (transformers' `LlamaConfig`, ``torch_dtype`` float32) and
  ``generation_config.json`` (BOS/EOS);
* ``model.safetensors`` (float32; the tied output projection is not stored, as transformers does);
* the tokenizer rebuilt from the GGUF metadata (``tokenizer.json``, ``tokenizer_config.json``,
  ``chat_template.jinja``).

  python benchmarks/export_hf.py /tmp/smollm2-hf            # the default model
  python benchmarks/export_hf.py /tmp/out --gguf PATH.gguf  # another llama-architecture GGUF

Loading the directory back with ``jaxengine.LLM(directory)`` gives the same greedy tokens as the
GGUF (both are float32 copies of the same dequantized numbers).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def export(directory: Path, gguf_path: str | None = None) -> Path:
  """Writes the HF directory for `gguf_path` (default: the default model) and returns it."""
  import safetensors.numpy
  import transformers

  from jaxengine.models.gguf_loader import default_model_path, load_gguf
  from jaxengine.models.weights import named_weights
  from jaxengine.tokenizer import Tokenizer

  path = gguf_path or default_model_path()
  model, cfg = load_gguf(path)
  if cfg.rope_scaling is not None or cfg.attention_bias or cfg.qk_norm:
    raise ValueError("export_hf writes plain Llama configs only (no rope scaling, biases, qk_norm)")
  config = transformers.LlamaConfig(
    vocab_size=cfg.vocab_size,
    hidden_size=cfg.hidden_size,
    intermediate_size=cfg.intermediate_size,
    num_hidden_layers=cfg.num_hidden_layers,
    num_attention_heads=cfg.num_attention_heads,
    num_key_value_heads=cfg.num_key_value_heads,
    head_dim=cfg.head_dim,
    rope_theta=cfg.rope_theta,
    rms_norm_eps=cfg.rms_norm_eps,
    max_position_embeddings=cfg.max_position_embeddings,
    tie_word_embeddings=cfg.tie_word_embeddings,
    bos_token_id=cfg.bos_token_id,
    eos_token_id=cfg.eos_token_id,
    torch_dtype="float32",
  )
  config.architectures = ["LlamaForCausalLM"]
  directory.mkdir(parents=True, exist_ok=True)
  config.save_pretrained(directory)
  generation = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id}
  (directory / "generation_config.json").write_text(json.dumps(generation, indent=1))
  tensors = {name: np.ascontiguousarray(array, np.float32) for name, array in named_weights(model)}
  safetensors.numpy.save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
  Tokenizer.from_gguf(path).hf_tokenizer.save_pretrained(directory)
  return directory


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("directory", type=Path, help="where to write (created if missing)")
  parser.add_argument("--gguf", default=None, help="a llama GGUF file (default: SmolLM2-135M)")
  args = parser.parse_args()
  out = export(args.directory, args.gguf)
  print(f"wrote {', '.join(sorted(p.name for p in out.iterdir()))} to {out}")


if __name__ == "__main__":
  main()
