"""vLLM's names for the engine options that jaxengine names otherwise, and their resolution.

`LLM(max_num_seqs=8)`, `LLMEngine(..., max_logprobs=5)`, `EngineArgs` and the `jaxengine`
command's `--max-num-seqs` / `--max-logprobs` all come through `resolve_vllm_names`, so a
vLLM script's options reach the same `EngineConfig` field. Imports nothing (the command's
`--help` stays fast).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: vLLM's engine option -> the `EngineConfig` field it sets.
VLLM_NAMES = {"max_num_seqs": "max_num_reqs", "max_logprobs": "max_num_logprobs"}


def resolve_vllm_names(options: Mapping[str, Any]) -> dict[str, Any]:
  """`options` with each vLLM name in `VLLM_NAMES` replaced by its `EngineConfig` field.

  Args:
    options: engine options by name; a vLLM name whose value is None is dropped (unset).

  Returns:
    A new dict; `options` is left as it is.

  Raises:
    ValueError: a vLLM name and its field both given with different values (naming both).
  """
  resolved = {name: value for name, value in options.items() if name not in VLLM_NAMES}
  for vllm_name, field in VLLM_NAMES.items():
    value = options.get(vllm_name)
    if value is None:
      continue
    if field in resolved and resolved[field] != value:
      raise ValueError(
        f"{vllm_name}={value!r} (vLLM's name for {field}) and {field}={resolved[field]!r} "
        "disagree: give one of them"
      )
    resolved[field] = value
  return resolved
