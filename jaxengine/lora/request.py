"""`LoRARequest`: which adapter a request runs with (vLLM's class and field names);
`LoRAModulePath`: an adapter the server serves from the start (``--lora-modules``)."""

from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple

from jaxengine.params import is_int


@dataclasses.dataclass(frozen=True)
class LoRARequest:
  """A LoRA adapter for a request, as vLLM's `LoRARequest`.

  Attributes:
    lora_name: a name for the adapter (reported, not used to look it up).
    lora_int_id: the adapter's id, an int >= 1, unique per adapter in the engine: adapters are
      cached and placed in device slots by this id, and the prefix cache keys pages by it.
    lora_path: a PEFT adapter directory (``adapter_config.json`` and
      ``adapter_model.safetensors``).
    base_model_name: the model the adapter was made for, as the server reports it (its
      `parent` in ``/v1/models``); None: the served model. Informative only.
  """

  lora_name: str
  lora_int_id: int
  lora_path: str | os.PathLike
  base_model_name: str | None = None


class LoRAModulePath(NamedTuple):
  """A LoRA adapter the server serves from the start (vLLM's ``--lora-modules`` entry).

  Attributes:
    name: the model name requests give to run with it.
    path: its PEFT directory.
    base_model_name: its `parent` in ``/v1/models`` (None: the served model's name).
  """

  name: str
  path: str
  base_model_name: str | None = None


def check_lora_request(request: object) -> LoRARequest:
  """`request` itself if it is a valid `LoRARequest`.

  Raises:
    ValueError: not a `LoRARequest`, or `lora_int_id` not an int >= 1.
  """
  if not isinstance(request, LoRARequest):
    raise ValueError(f"lora_request must be a LoRARequest or None, got {request!r}")
  if not is_int(request.lora_int_id) or request.lora_int_id < 1:
    raise ValueError(f"lora_request.lora_int_id must be an int >= 1, got {request.lora_int_id!r}")
  return request
