"""A Qwen3.5 hybrid against a Qwen3 of the same size, end to end through `LLM.generate`.

  python benchmarks/bench_hybrid.py [--tokens 64] [--batches 1 8 32] [--repeats 2]

Two random models of SmolLM2-135M's size (hidden 576, 30 layers, MLP 1,536, SmolLM2's tokenizer
and vocabulary of 49,152, float32, untied embeddings):

- ``qwen3``: every layer attention (9 query heads over 3 key/value heads of 64, q/k norms);
- ``qwen3_5``: Qwen3.5's pattern of three Gated DeltaNet layers to one gated attention layer
  (the same attention heads, a quarter of each head rotating), the linear layers with 4 key heads
  and 8 value heads of 64 (`jaxengine/models/gated_deltanet.py`: a recurrent state per request).

Each row: ``B`` prompts of 64 tokens, ``--tokens`` greedy tokens each (``ignore_eos``), after
one warm-up `generate` of the same shapes (compiles); tokens/s over generated tokens, the two
models in turns, the best of ``--repeats``. Prefix caching off for both (the hybrid's default).

Measured on the shared 2-core CPU (jax 0.10.2, load about 0.4, --tokens 64, 2 repeats):

  =====  ===========  =============  =====
  batch  qwen3 tok/s  qwen3_5 tok/s  ratio
  =====  ===========  =============  =====
      1         37.1           32.8  0.89x
      8         96.9           71.3  0.74x
     32        173.4          131.1  0.76x
  =====  ===========  =============  =====

The hybrid runs at 0.74-0.89x of Qwen3. Its prefill ran the delta rule one iteration per prompt
token (64 sequential iterations per prompt here) where an attention layer takes one product.

Since the chunked delta rule (`jaxengine/models/delta_rule.py`: a 64-token prompt is 2 chunks of
32 on CPU), --tokens 32, 2 repeats, the machine loaded by other jobs (load 6 falling to 1.5), the
commit before it then the commit with it, one after the other: ratios 1.10 / 0.67 / 0.77x before
and 0.88 / 0.76 / 0.69x after at batch 1 / 8 / 32, within the noise of that machine; on CPU a
token's step of the recurrence is cheap, and the chunks pay off on long prefills (a 512-token
prefill of eight 64 x 64 heads: 17.6 ms by token, 7.9 ms in chunks) and on accelerators, where
each sequential step costs a launch.
"""

from __future__ import annotations

import argparse
import time

from flax import nnx

import jaxengine as je
from jaxengine.models.llama import Llama
from jaxengine.models.llama_config import LlamaConfig
from jaxengine.models.qwen3_5 import Qwen3_5
from jaxengine.models.qwen3_5_checkpoints import FULL, LINEAR, Qwen3_5Config
from jaxengine.tokenizer import Tokenizer

SIZE = dict(
  vocab_size=49152,
  hidden_size=576,
  intermediate_size=1536,
  num_hidden_layers=30,
  num_attention_heads=9,
  num_key_value_heads=3,
  head_dim=64,
  tie_word_embeddings=False,
  max_position_embeddings=2048,
)
PROMPT_TOKENS = 64


def models() -> dict[str, nnx.Module]:
  qwen3 = Llama(LlamaConfig(qk_norm=True, **SIZE), rngs=nnx.Rngs(0))
  layer_types = tuple(FULL if i % 4 == 3 else LINEAR for i in range(SIZE["num_hidden_layers"]))
  hybrid = Qwen3_5Config(
    layer_types=layer_types, linear_key_head_dim=64, linear_value_head_dim=64,
    linear_num_key_heads=4, linear_num_value_heads=8, **SIZE,
  )  # fmt: skip
  return {"qwen3": qwen3, "qwen3_5": Qwen3_5(hybrid, rngs=nnx.Rngs(0))}


def tokens_per_s(llm: je.LLM, batch: int, num_tokens: int) -> float:
  prompts = [{"prompt_token_ids": [(7 * r + j) % 40000 + 100 for j in range(PROMPT_TOKENS)]}
             for r in range(batch)]  # fmt: skip
  params = je.SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
  start = time.perf_counter()
  outputs = llm.generate(prompts, params, use_tqdm=False)
  seconds = time.perf_counter() - start
  return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--tokens", type=int, default=64)
  parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
  parser.add_argument("--repeats", type=int, default=2)
  args = parser.parse_args()
  tokenizer = Tokenizer.from_gguf()
  engines = {
    name: je.LLM(model, tokenizer=tokenizer, max_num_reqs=max(args.batches), max_model_len=512,
                 enable_prefix_caching=False)
    for name, model in models().items()
  }  # fmt: skip
  for batch in args.batches:
    best = dict.fromkeys(engines, 0.0)
    for llm in engines.values():  # warm-up: the shapes compile
      tokens_per_s(llm, batch, args.tokens)
    for _ in range(args.repeats):
      for name, llm in engines.items():
        best[name] = max(best[name], tokens_per_s(llm, batch, args.tokens))
    ratio = best["qwen3_5"] / best["qwen3"]
    print(
      f"  {batch:5d}  {best['qwen3']:11.1f}  {best['qwen3_5']:12.1f}  {ratio:5.2f}x", flush=True
    )


if __name__ == "__main__":
  main()
