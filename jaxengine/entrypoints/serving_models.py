"""`OpenAIServingModels`: the models the server serves (vLLM's name): the base model under its
served name and the LoRA adapters added at start or at run time, each a `model` a request may
name (`/v1/models`, `/v1/load_lora_adapter`, `/v1/unload_lora_adapter`)."""

from __future__ import annotations

import itertools
import time

from jaxengine.entrypoints.async_llm import AsyncLLM
from jaxengine.entrypoints.protocol import RequestError
from jaxengine.lora import LoRARequest, load_peft_adapter


class OpenAIServingModels:
  """The served base model and LoRA adapters.

  Args:
    engine: the `AsyncLLM` (its LoRA manager checks an adapter before it is served).
    model_name: the base model's served name.
  """

  def __init__(self, engine: AsyncLLM, model_name: str) -> None:
    self.engine = engine
    self.model_name = model_name
    self.created = int(time.time())
    #: The served LoRA adapters by name (`add_lora`).
    self.lora_modules: dict[str, LoRARequest] = {}
    self._lora_ids = itertools.count(1)

  def check_model(self, model: str | None) -> LoRARequest | None:
    """The adapter a request's `model` names (None: the base model); 404 for another name."""
    if model is None or model == self.model_name:
      return None
    lora = self.lora_modules.get(model)
    if lora is None:
      raise RequestError(f"The model `{model}` does not exist.", "model", 404)
    return lora

  def add_lora(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
    """Serves the PEFT adapter at `path` as model `name` (checked here, on the host; read
    into the engine's cache by its first request). 400 (`RequestError`) when refused."""
    manager = self.engine.engine.runner.lora
    if manager is None:
      raise RequestError("LoRA adapters need an engine with enable_lora=True", "lora_name")
    if name == self.model_name or name in self.lora_modules:
      raise RequestError(f"The lora adapter '{name}' has already been loaded.", "lora_name")
    lora = LoRARequest(name, next(self._lora_ids), path, base_model_name)
    try:
      load_peft_adapter(
        path,
        lora.lora_int_id,
        max_lora_rank=manager.max_lora_rank,
        num_layers=manager.num_layers,
        target_shapes=manager.target_shapes,
      )
    except ValueError as error:
      raise RequestError(str(error), "lora_path") from None
    self.lora_modules[name] = lora
    return lora

  def remove_lora(self, name: str) -> None:
    """Stops serving adapter `name` (running requests finish with it); 404 if unknown."""
    if self.lora_modules.pop(name, None) is None:
      raise RequestError(f"The lora adapter '{name}' cannot be found.", "lora_name", 404)

  def model_cards(self) -> list[dict]:
    """`/v1/models`' data: the base model's card, then each adapter's (its `parent` the base
    model it names, else the served model)."""
    served_model_name = self.model_name
    card = {"id": served_model_name, "object": "model", "created": self.created,
            "owned_by": "jaxengine", "root": served_model_name,
            "max_model_len": self.engine.max_model_len}  # fmt: skip
    adapters = [
      {
        **card,
        "id": name,
        "root": str(lora.lora_path),
        "parent": lora.base_model_name or served_model_name,
      }
      for name, lora in self.lora_modules.items()
    ]
    return [card, *adapters]
