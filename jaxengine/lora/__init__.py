"""LoRA adapters on one base model: vLLM's `LoRARequest`, PEFT directories, device slots.

- `LoRARequest` names an adapter (vLLM's fields) for `LLM.generate(..., lora_request=...)`.
- `load_peft_adapter` reads and checks a PEFT directory into a host `LoRAAdapter`.
- `LoRAManager` (one per model runner) keeps an LRU of host copies (`max_cpu_loras`) and the
  `max_loras` device slots the steps read (`jaxengine.models.lora.LoRAInputs`).
"""

from jaxengine.lora.manager import LoRAManager
from jaxengine.lora.peft import LoRAAdapter, load_peft_adapter
from jaxengine.lora.request import LoRARequest, check_lora_request

__all__ = ["LoRAAdapter", "LoRAManager", "LoRARequest", "check_lora_request", "load_peft_adapter"]
