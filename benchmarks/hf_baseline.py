"""Hugging Face `generate` (PyTorch, CPU, float32) on the same SmolLM2 weights, as a baseline.

The weights come from the jaxengine model loaded from the GGUF file (so both systems run exactly
the same numbers), converted to transformers' `LlamaForCausalLM` layout. Needs the `bench` extra
(`pip install torch==2.13.0` on this CPU VM: a plain `torch` would fetch a CUDA build).

Run as a script (`bench_generate.py --hf-python PYTHON` does), it serves jobs over stdin from a
Hugging Face directory (benchmarks/export_hf.py) under another interpreter, one holding torch and
transformers (vLLM's CPU venv does), with the protocol of benchmarks/vllm_baseline.py: a JSON line
``{"prompts": [[ids], ...], "max_tokens": N}`` in, ``{"seconds": ..., "token_ids": [[ids], ...]}``
out (greedy `generate` of every prompt at once, exactly N tokens each), after a first line
``{"ready": true, "torch": version, "transformers": version}``. It imports nothing from jaxengine.

  echo '{"prompts": [[504, 3575, 282]], "max_tokens": 8}' | \\
    VENV/bin/python benchmarks/hf_baseline.py --model /tmp/jaxengine-bench-hf
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def hf_model(llm):
  """A transformers `LlamaForCausalLM` holding the weights of `llm`'s (Llama) model."""
  import torch
  import transformers

  from jaxengine.models.weights import named_weights

  model = llm.llm_engine.runner.model
  cfg = model.config
  hf_config = transformers.LlamaConfig(
    vocab_size=cfg.vocab_size,
    hidden_size=cfg.hidden_size,
    intermediate_size=cfg.intermediate_size,
    num_hidden_layers=cfg.num_hidden_layers,
    num_attention_heads=cfg.num_attention_heads,
    num_key_value_heads=cfg.num_key_value_heads,
    head_dim=cfg.head_dim,
    rope_theta=cfg.rope_theta,
    rms_norm_eps=cfg.rms_norm_eps,
    tie_word_embeddings=cfg.tie_word_embeddings,
    max_position_embeddings=cfg.max_position_embeddings,
    bos_token_id=cfg.bos_token_id,
    eos_token_id=cfg.eos_token_id,
  )
  state = {
    name: torch.from_numpy(np.array(array, np.float32)) for name, array in named_weights(model)
  }
  hf = transformers.LlamaForCausalLM(hf_config).eval()
  missing, unexpected = hf.load_state_dict(state, strict=False)
  assert not unexpected and all("lm_head" in m or "rotary" in m for m in missing), missing
  if cfg.tie_word_embeddings:
    hf.tie_weights()
  return hf


def hf_generate_seconds(hf, prompts: list[list[int]], max_tokens: int) -> float:
  """Wall seconds of one greedy `generate` of `max_tokens` tokens for every prompt at once."""
  return hf_generate(hf, prompts, max_tokens)[0]


def hf_generate(hf, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
  """(wall seconds, generated token ids per prompt) of one greedy `generate` of every prompt."""
  import torch

  ids = torch.tensor(prompts, dtype=torch.long)  # equal lengths: no padding needed
  with torch.inference_mode():
    start = time.perf_counter()
    out = hf.generate(
      ids,
      attention_mask=torch.ones_like(ids),
      max_new_tokens=max_tokens,
      min_new_tokens=max_tokens,
      do_sample=False,
      pad_token_id=0,
    )
    seconds = time.perf_counter() - start
  assert out.shape == (len(prompts), len(prompts[0]) + max_tokens)
  return seconds, out[:, len(prompts[0]) :].tolist()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", required=True, help="Hugging Face model directory")
  args = parser.parse_args()
  import torch
  import transformers

  hf = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
  ready = {"ready": True, "torch": torch.__version__, "transformers": transformers.__version__}
  print(json.dumps(ready), flush=True)
  for line in sys.stdin:
    if line.strip():
      job = json.loads(line)
      seconds, token_ids = hf_generate(hf, job["prompts"], job["max_tokens"])
      print(json.dumps({"seconds": seconds, "token_ids": token_ids}), flush=True)


if __name__ == "__main__":
  main()
