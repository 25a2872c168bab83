"""LoRA adapters on one base model: vLLM's `LoRARequest`, PEFT directories, device slots.

- `LoRARequest` names an adapter (vLLM's fields) for `LLM.generate(..., lora_request=...)`;
  `LoRAModulePath` one the server serves from the start (``--lora-modules``).
- `load_peft_adapter` reads and checks a PEFT directory into a host `LoRAAdapter`;
  `lora_adapter_from_arrays` makes one from arrays in memory (a trainer's LoRA parameters).
- `LoRAManager` (one per model runner) keeps an LRU of host copies (`max_cpu_loras`) and the
  `max_loras` device slots the steps read (`jaxengine.models.lora.LoRAInputs`);
  `LoRAManager.set_adapter` replaces an adapter's values in place (`LLM.load_lora_weights`).
"""

from jaxengine.lora.manager import LoRAManager
from jaxengine.lora.peft import LoRAAdapter, load_peft_adapter, lora_adapter_from_arrays
from jaxengine.lora.request import LoRAModulePath, LoRARequest, check_lora_request

__all__ = [
  "LoRAAdapter",
  "LoRAManager",
  "LoRAModulePath",
  "LoRARequest",
  "check_lora_request",
  "load_peft_adapter",
  "lora_adapter_from_arrays",
]
