"""A request's record of its output tokens and its tokens in flight: what the batch reads.

A row of the persistent batch needs two per-request counts: the tokens a request holds (prompt,
output read so far, and output sampled on the device but not read yet: what the next step plans
with and what `max_model_len` is checked against) and, to drop the tokens of a request removed
since a step's dispatch, the identity of the record they belong to. The record is the request's
own: an engine adds each completion with its `Completion` (`jaxengine/core/request.py`), which
the engine writes (it appends each token it reads and counts the dispatched ones in
`num_output_placeholders`) and the batch only reads. A request added without one (the batch used
on its own) gets a `BatchLedger`, which the batch writes itself: it counts each dispatched step's
known tokens and appends the tokens when it reads the step.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol


class RequestLedger(Protocol):
  """What the batch reads of a request (`Completion` is one).

  Attributes:
    token_ids: the output tokens read so far.
    num_output_placeholders: output tokens in dispatched steps not read yet (vLLM's name).
  """

  token_ids: list[int]
  num_output_placeholders: int

  @property
  def num_tokens_with_placeholders(self) -> int:
    """Prompt plus output tokens, those not read yet included."""
    ...


@dataclasses.dataclass(eq=False)
class BatchLedger:
  """The record of a request added without its own: the batch appends its tokens and counts
  its tokens in flight.

  Attributes:
    num_prompt_tokens: the prompt's length.
    token_ids: output tokens read so far (a resumed request's first).
    num_output_placeholders: tokens of dispatched steps whose counts were known at dispatch, not
      read yet.
  """

  num_prompt_tokens: int
  token_ids: list[int]
  num_output_placeholders: int = 0

  @property
  def num_tokens_with_placeholders(self) -> int:
    """Prompt plus output tokens, those not read yet included."""
    return self.num_prompt_tokens + len(self.token_ids) + self.num_output_placeholders
