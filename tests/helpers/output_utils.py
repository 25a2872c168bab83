"""Comparing generations: tokens equal, logprob ranks equal, logprob values within a tolerance.

Imported by the subprocess scripts of the mesh tests (which put this folder on `sys.path`) as well
as by in-process tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

#: One completion: its token ids, its sample logprobs, its request's prompt logprobs.
Generation = tuple[list[int], Any, Any]


def step_to_end(engine) -> list:
  """Steps an `LLMEngine` until no request is unfinished; the outputs `step` returned finished
  (each request once: the engine forgets a request it has returned finished), in that order."""
  finished = []
  while engine.has_unfinished_requests():
    finished += [output for output in engine.step() if output.finished]
  return finished


def generations(llm, prompts: Sequence, params) -> list[Generation]:
  """Runs `llm.generate` and returns every completion of every request, in order."""
  outs = llm.generate(list(prompts), params, use_tqdm=False)
  return [(list(c.token_ids), c.logprobs, o.prompt_logprobs) for o in outs for c in o.outputs]


def _ranks(entries) -> list:
  return [[(t, v.rank) for t, v in d.items()] if d else d for d in entries]


def _values(entries) -> list[float]:
  return [v.logprob for d in entries if d for v in d.values()]


def assert_same_generations(
  got: Sequence[Generation], want: Sequence[Generation], atol: float = 1e-4
) -> None:
  """Same tokens and same logprob ranks (sample and prompt); logprob values within `atol`."""
  assert len(got) == len(want), (len(got), len(want))
  for (tokens, logprobs, prompt), (want_tokens, want_logprobs, want_prompt) in zip(got, want):
    assert tokens == want_tokens, (tokens, want_tokens)
    for entries, want_entries in ((logprobs, want_logprobs), (prompt, want_prompt)):
      assert (entries is None) == (want_entries is None)
      if want_entries is None:
        continue
      assert _ranks(entries) == _ranks(want_entries), (_ranks(entries), _ranks(want_entries))
      np.testing.assert_allclose(_values(entries), _values(want_entries), atol=atol)
