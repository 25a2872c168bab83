"""`InputBatch`: the host side of the persistent batch (vLLM V1's class of the same name).

The host keeps the bookkeeping a scheduler talks to (`req_ids`, `req_id_to_index`, free rows,
each request's output tokens) and turns every composition change into one call of a jitted,
donating update of the device-side `BatchState`:

  add_request      -> `write_row` (every per-row field overwritten: no stale state is inherited)
  remove_request   -> host only (the row becomes a hole; its stale values are never read)
  condense         -> `move_rows` (highest live rows into the lowest holes; order not preserved)
  swap_states      -> `move_rows`

`SamplingMetadata` is rebuilt by one jitted call the first time it is needed after such a change;
a step without one reuses the same object. Every check of user input happens here, on the host,
before any device work, so a rejected call leaves the batch exactly as it was.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.metadata import SamplingMetadata, refresh_metadata
from jaxengine.params import SamplingParams, is_int, validate_logprobs_mode
from jaxengine.sampler import LogprobsTensors, SamplerOutput, sample
from jaxengine.state import MOVE_CHUNK, BatchState, move_rows, write_row


class InputBatch:
  """A fixed-capacity batch of running requests with per-request sampling parameters.

  Args:
    max_num_reqs: rows (requests that can run at once).
    max_model_len: maximum prompt plus output tokens of a request.
    vocab_size: width of the logits.
    max_num_logprobs: largest `logprobs` / `prompt_logprobs` a request may ask for (vLLM's
      `max_logprobs`, default 20); `-1` allows the whole vocabulary. Sets the static number of top
      entries computed per step in which some request wants logprobs; `-1` makes that a full
      sort of every row, so keep it for small vocabularies or analysis.
    logprobs_mode: what logprobs report: "raw_logprobs" (log-softmax of the model's logits, the
      default), "raw_logits", "processed_logprobs" or "processed_logits" (after every processor,
      temperature and filter: the distribution the token was drawn from; masked tokens -inf).
    eos_token_ids: EOS ids added to every request's min_tokens stop set (as vLLM's engine does,
      even with `ignore_eos`).
    max_num_stop_token_ids: capacity of a request's stop set (its stop_token_ids plus EOS).
    max_num_logit_bias: capacity of a request's logit_bias entries.
    max_num_bad_words: capacity of a request's bad_words_token_ids sequences.
    max_bad_word_len: longest banned sequence, in tokens.
    num_topk_candidates: per-row top-k budget of the sorting-free top-k / top-p path; deeper
      cuts use exact but slower methods (see `jaxengine.sampler`).
    seed: seed of the batch key from which unseeded requests' keys are derived.

  The batch samples; it does not decide when a request ends. `SamplingParams` fields that act at
  the engine level (`n`, `max_tokens`, `stop`, `bad_words` strings, `ignore_eos`,
  `include_stop_str_in_output`, `skip_special_tokens`, `prompt_logprobs` values) are accepted and
  ignored here; `LLMEngine` applies them. A request keeps sampling until it is removed or reaches
  `max_model_len`.

  Raises:
    ValueError: for non-positive capacities, `max_num_logprobs < -1`, EOS ids outside the
      vocabulary, or an unknown logprobs_mode.
  """

  def __init__(
    self,
    max_num_reqs: int,
    max_model_len: int,
    vocab_size: int,
    max_num_logprobs: int = 20,
    logprobs_mode: str = "raw_logprobs",
    *,
    eos_token_ids: Sequence[int] | int | None = (),
    max_num_stop_token_ids: int = 32,
    max_num_logit_bias: int = 128,
    max_num_bad_words: int = 32,
    max_bad_word_len: int = 16,
    num_topk_candidates: int = 64,
    seed: int = 0,
  ):
    for name, value in dict(
      max_num_reqs=max_num_reqs,
      max_model_len=max_model_len,
      vocab_size=vocab_size,
      max_num_stop_token_ids=max_num_stop_token_ids,
      max_num_logit_bias=max_num_logit_bias,
      max_num_bad_words=max_num_bad_words,
      max_bad_word_len=max_bad_word_len,
      num_topk_candidates=num_topk_candidates,
    ).items():
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not (max_num_logprobs == -1 or max_num_logprobs >= 0):
      raise ValueError(
        f"max_num_logprobs must be >= 0 or -1 (whole vocabulary), got {max_num_logprobs}"
      )
    validate_logprobs_mode(logprobs_mode)
    if eos_token_ids is None:
      eos_token_ids = ()
    elif isinstance(eos_token_ids, (int, np.integer)):
      eos_token_ids = (int(eos_token_ids),)
    self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
    for token in self.eos_token_ids:
      if not 0 <= token < vocab_size:
        raise ValueError(f"eos_token_ids must lie in [0, {vocab_size}), got {token}")

    self.max_num_reqs = int(max_num_reqs)
    self.max_model_len = int(max_model_len)
    self.vocab_size = int(vocab_size)
    self.max_num_logprobs = int(max_num_logprobs)
    self.logprobs_mode = logprobs_mode
    self.max_num_stop_token_ids = int(max_num_stop_token_ids)
    self.max_num_logit_bias = int(max_num_logit_bias)
    self.max_num_bad_words = int(max_num_bad_words)
    self.max_bad_word_len = int(max_bad_word_len)
    self._state = BatchState.create(
      max_num_reqs=self.max_num_reqs,
      max_model_len=self.max_model_len,
      vocab_size=self.vocab_size,
      max_num_stop_token_ids=self.max_num_stop_token_ids,
      max_num_logit_bias=self.max_num_logit_bias,
      max_num_bad_words=self.max_num_bad_words,
      max_bad_word_len=self.max_bad_word_len,
      logprobs_mode=logprobs_mode,
      max_num_logprobs=self.vocab_size
      if max_num_logprobs == -1
      else min(self.max_num_logprobs, self.vocab_size),
      num_topk_candidates=min(int(num_topk_candidates), self.vocab_size),
    )
    self._batch_key_data = jax.random.key_data(jax.random.key(seed))
    self._serials = itertools.count()
    # Row-indexed host bookkeeping; None marks a hole (a removed request not yet condensed).
    self._req_ids: list[str | None] = []
    self._req_output_token_ids: list[list[int] | None] = []
    self.req_id_to_index: dict[str, int] = {}
    # Request-keyed bookkeeping (follows the request through moves without re-keying).
    self._num_prompt_tokens: dict[str, int] = {}
    self._num_logprobs: dict[str, int] = {}
    self._cache_slots: dict[str, int] = {}
    self._free_cache_slots = list(range(self.max_num_reqs))
    self._metadata: SamplingMetadata | None = None

  # --- views ------------------------------------------------------------------------------------

  @property
  def num_reqs(self) -> int:
    """Number of requests in the batch."""
    return len(self.req_id_to_index)

  @property
  def req_ids(self) -> list[str]:
    """Request ids by row. After `condense` its length is `num_reqs`; before, holes are None."""
    return list(self._req_ids)

  @property
  def req_output_token_ids(self) -> list[list[int] | None]:
    """Each row's output tokens so far (the live lists the batch appends to)."""
    return list(self._req_output_token_ids)

  @property
  def state(self) -> BatchState:
    """The device-side state (read it, do not keep it: the next update donates its buffers)."""
    return self._state

  @property
  def sampling_metadata(self) -> SamplingMetadata:
    """Metadata for the current composition; the same object until the composition changes."""
    if self._metadata is None:
      self._metadata = refresh_metadata(self._state, jnp.asarray(self._is_live()))
    return self._metadata

  def cache_slot(self, req_id: str) -> int:
    """The KV-cache slot held by `req_id` (stable for the request's lifetime in the batch).

    Raises:
      KeyError: for an id not in the batch (as do `num_tokens` and `output_token_ids`).
    """
    return self._cache_slots[req_id]

  def num_tokens(self, req_id: str) -> int:
    """Prompt plus output tokens of `req_id` so far."""
    return self._num_prompt_tokens[req_id] + len(self.output_token_ids(req_id))

  def output_token_ids(self, req_id: str) -> list[int]:
    """The output tokens of `req_id` so far (the live list)."""
    return self._req_output_token_ids[self.req_id_to_index[req_id]]

  def _is_live(self) -> np.ndarray:
    live = np.zeros((self.max_num_reqs,), bool)
    live[list(self.req_id_to_index.values())] = True
    return live

  def _composition_changed(self) -> None:
    self._metadata = None

  # --- composition changes ------------------------------------------------------------------------

  def add_request(
    self,
    req_id: str,
    prompt_token_ids: Sequence[int],
    sampling_params: SamplingParams,
    output_token_ids: Sequence[int] = (),
  ) -> int:
    """Adds a request in the lowest free row and returns that row.

    Args:
      req_id: unique id of the request.
      prompt_token_ids: the prompt, at least one id, ids in `[0, vocab_size)` (an empty prompt
        is refused, as `LLMEngine` refuses it: the first token would have nothing to follow).
      sampling_params: the request's `SamplingParams`.
      output_token_ids: tokens already generated (a resumed request); they count for penalties,
        bad words and min_tokens, and the request's key continues from their number.

    Returns:
      The row the request occupies.

    Raises:
      ValueError: (the batch is left unchanged) for a `req_id` that is not a str or is already
        present, a full batch, an empty prompt, token ids that are not ints in `[0, vocab_size)` in
        any field, more than `max_model_len` tokens, lists longer than the batch's capacities, logprobs above
        `max_num_logprobs`, or constraints that ban every token whatever the output (an allowlist
        covered by single-token bad words, or by them plus the stop set under min_tokens).
    """
    if not isinstance(req_id, str):
      raise ValueError(f"req_id must be a str, got {req_id!r}")
    if req_id in self.req_id_to_index:
      raise ValueError(f"req_id {req_id!r} is already in the batch")
    if self.num_reqs >= self.max_num_reqs:
      raise ValueError(
        f"the batch is full (max_num_reqs={self.max_num_reqs}); cannot add {req_id!r}"
      )
    prompt, outputs, update = self._prepare_row(prompt_token_ids, sampling_params, output_token_ids)

    # Validated: from here on nothing can fail on bad input.
    row = next((i for i, rid in enumerate(self._req_ids) if rid is None), len(self._req_ids))
    cache_slot = self._free_cache_slots.pop(0)
    update.update(cache_slot=np.int32(cache_slot), serial=np.uint32(next(self._serials) % 2**32))
    self._state = write_row(self._state, jnp.int32(row), update, self._batch_key_data)
    if row == len(self._req_ids):
      self._req_ids.append(req_id)
      self._req_output_token_ids.append(list(outputs.tolist()))
    else:
      self._req_ids[row] = req_id
      self._req_output_token_ids[row] = list(outputs.tolist())
    self.req_id_to_index[req_id] = row
    self._num_prompt_tokens[req_id] = len(prompt)
    self._cache_slots[req_id] = cache_slot
    if sampling_params.logprobs is not None:
      self._num_logprobs[req_id] = self._resolve_num_logprobs(sampling_params.logprobs)
    self._composition_changed()
    return row

  def validate_request(
    self,
    prompt_token_ids: Sequence[int],
    sampling_params: SamplingParams,
    output_token_ids: Sequence[int] = (),
  ) -> None:
    """Runs every check of `add_request` that does not depend on the batch's occupancy.

    Raises:
      ValueError: as `add_request` would (token ids, lengths, capacities, logprobs).
    """
    self._prepare_row(prompt_token_ids, sampling_params, output_token_ids)

  def remove_request(self, req_id: str) -> int | None:
    """Removes a request, leaving a hole; returns its row, or None for an unknown id.

    Call `condense` before sampling (`sample` does it if you do not).
    """
    row = self.req_id_to_index.pop(req_id, None)
    if row is None:
      return None
    self._req_ids[row] = None
    self._req_output_token_ids[row] = None
    del self._num_prompt_tokens[req_id]
    self._num_logprobs.pop(req_id, None)
    self._free_cache_slots.append(self._cache_slots.pop(req_id))
    self._free_cache_slots.sort()
    self._composition_changed()
    return row

  def condense(self) -> list[tuple[int, int]]:
    """Moves the highest live rows into the lowest holes until rows `[0, num_reqs)` are dense.

    Order is not preserved (vLLM's rule): `[A, B, C, D, E]` minus B and D becomes `[A, E, C]`.

    Returns:
      The `(from_row, to_row)` moves made.
    """
    moves = []
    holes = [i for i, rid in enumerate(self._req_ids) if rid is None]
    live_rows = [i for i, rid in enumerate(self._req_ids) if rid is not None]
    while holes and live_rows and holes[0] < live_rows[-1]:
      src, dst = live_rows.pop(), holes.pop(0)
      moves.append((src, dst))
      req_id = self._req_ids[src]
      self._req_ids[dst], self._req_ids[src] = req_id, None
      self._req_output_token_ids[dst] = self._req_output_token_ids[src]
      self._req_output_token_ids[src] = None
      self.req_id_to_index[req_id] = dst
    del self._req_ids[self.num_reqs :]
    del self._req_output_token_ids[self.num_reqs :]
    if moves:
      self._move_device_rows(moves)
      self._composition_changed()
    return moves

  def swap_states(self, i1: int, i2: int) -> None:
    """Exchanges the requests in rows `i1` and `i2` (every per-row field).

    Raises:
      ValueError: naming the argument, if `i1` or `i2` is not an int (bools are refused) in
        `[0, len(req_ids))`. Nothing is changed then.
    """
    for name, row in (("i1", i1), ("i2", i2)):
      if not is_int(row) or not 0 <= row < len(self._req_ids):
        raise ValueError(
          f"swap_states {name} must be an int row in [0, {len(self._req_ids)}), got {row!r}"
        )
    i1, i2 = int(i1), int(i2)
    if i1 == i2:
      return
    for rows in (self._req_ids, self._req_output_token_ids):
      rows[i1], rows[i2] = rows[i2], rows[i1]
    for row in (i1, i2):
      if self._req_ids[row] is not None:
        self.req_id_to_index[self._req_ids[row]] = row
    self._move_device_rows([(i1, i2), (i2, i1)])
    self._composition_changed()

  def _move_device_rows(self, moves: list[tuple[int, int]]) -> None:
    size = -(-self.max_num_reqs // MOVE_CHUNK) * MOVE_CHUNK  # one shape: one compile
    src = np.zeros((size,), np.int32)
    dst = np.full((size,), self.max_num_reqs, np.int32)  # padding: dropped
    for i, (a, b) in enumerate(moves):
      src[i], dst[i] = a, b
    self._state = move_rows(self._state, src, dst)

  # --- sampling ------------------------------------------------------------------------------

  def sample(self, logits) -> SamplerOutput:
    """Samples one token per request and appends it to the request's outputs.

    Condenses first if removals left holes; logits rows follow the condensed `req_ids`, so call
    `condense()` yourself before computing logits after a removal.

    Args:
      logits: `[max_num_reqs, vocab_size]` (rows `>= num_reqs` ignored; never recompiles) or
        `[num_reqs, vocab_size]` (padded on device; compiles once per distinct `num_reqs`), any
        float dtype, rows in `req_ids` order.

    Returns:
      `SamplerOutput` of NumPy arrays: `sampled_token_ids [num_reqs] int32` and `logprobs`
      (None unless a request asked; else `[num_reqs, k + 1]` with k the largest requested count).

    Raises:
      ValueError: for logits of another shape, or a request already at `max_model_len` tokens
        (its token would have nowhere to go). Nothing is changed then.
    """
    shape = tuple(getattr(logits, "shape", ()))
    num_reqs = self.num_reqs
    if (
      len(shape) != 2
      or shape[1] != self.vocab_size
      or shape[0] not in (self.max_num_reqs, num_reqs)
    ):
      raise ValueError(
        f"logits must have shape [max_num_reqs={self.max_num_reqs} or "
        f"num_reqs={num_reqs}, vocab_size={self.vocab_size}], got {shape}"
      )
    if not jnp.issubdtype(logits.dtype, jnp.floating):
      raise ValueError(f"logits must have a float dtype, got {logits.dtype}")
    if shape[0] != self.max_num_reqs:
      logits = _pad_rows(logits, self.max_num_reqs)  # NumPy goes straight in: one compile
    output, _ = self.run(_sample_logits, logits)
    return output

  def run(self, step_fn, *args):
    """Runs a jitted step that samples from the batch, then does the host bookkeeping.

    This is how an engine fuses its model's forward pass with sampling into one executable:
    `step_fn(state, metadata, *args) -> (state, SamplerOutput, extra)` must be jitted, donate
    `state`, and sample with `jaxengine.sampler.sample` inside.

    Condenses first if removals left holes.

    Args:
      step_fn: the jitted step, called as `step_fn(state, metadata, *args)`.
      *args: its other arguments (model weights, KV cache, ...).

    Returns:
      `(SamplerOutput of NumPy arrays over the live rows, extra)`.

    Raises:
      ValueError: if a request already holds `max_model_len` tokens. Nothing is changed then.
    """
    full = [rid for rid in self.req_id_to_index if self.num_tokens(rid) >= self.max_model_len]
    if full:
      raise ValueError(
        f"requests {full} already hold max_model_len={self.max_model_len} tokens; "
        "remove them before sampling"
      )
    if any(rid is None for rid in self._req_ids):
      self.condense()
    metadata = self.sampling_metadata
    self._state, output, extra = step_fn(self._state, metadata, *args)
    return self._to_host(output), extra

  def _to_host(self, output: SamplerOutput) -> SamplerOutput:
    """Device output over all rows -> NumPy over live rows; appends the tokens on the host."""
    n = self.num_reqs
    wants_logprobs = bool(self._num_logprobs)
    output = jax.device_get(output if wants_logprobs else output.sampled_token_ids)
    tokens = np.asarray(output.sampled_token_ids if wants_logprobs else output)[:n]
    for row, token in enumerate(tokens.tolist()):
      self._req_output_token_ids[row].append(token)
    logprobs = None
    if wants_logprobs:
      k = max(self._num_logprobs.values())
      logprobs = LogprobsTensors(
        token_ids=output.logprobs.token_ids[:n, : k + 1],
        logprobs=output.logprobs.logprobs[:n, : k + 1],
        ranks=output.logprobs.ranks[:n],
      )
    return SamplerOutput(sampled_token_ids=tokens, logprobs=logprobs)

  # --- validation and row preparation --------------------------------------------------------

  def _token_array(self, field: str, token_ids: Sequence[int]) -> np.ndarray:
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Iterable):
      raise ValueError(f"{field} must be a sequence of ints, got {token_ids!r}")
    token_ids = list(token_ids)
    not_ints = [t for t in token_ids if not is_int(t)]
    if not_ints:
      raise ValueError(f"{field} must hold only int token ids, got {not_ints[:5]!r}")
    array = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    bad = array[(array < 0) | (array >= self.vocab_size)]
    if bad.size:
      raise ValueError(f"{field} holds token ids outside [0, {self.vocab_size}): {bad.tolist()}")
    return array.astype(np.int32)

  def _resolve_num_logprobs(self, requested: int) -> int:
    return self.vocab_size if requested == -1 else requested

  def _check_num_logprobs(self, field: str, requested: int | None) -> None:
    if requested is None or self.max_num_logprobs == -1:
      return
    if requested == -1 or requested > self.max_num_logprobs:
      raise ValueError(
        f"{field}={requested} exceeds max_num_logprobs={self.max_num_logprobs} of this batch"
      )

  def _prepare_row(self, prompt_token_ids, sampling_params, output_token_ids):
    """Validates a request against the batch; returns (prompt, outputs, row for `write_row`)."""
    if not isinstance(sampling_params, SamplingParams):
      raise ValueError(f"sampling_params must be a SamplingParams, got {type(sampling_params)}")
    prompt = self._token_array("prompt_token_ids", prompt_token_ids)
    if not len(prompt):
      raise ValueError("prompt_token_ids must hold at least one token, got an empty prompt")
    outputs = self._token_array("output_token_ids", output_token_ids)
    num_tokens = len(prompt) + len(outputs)
    if num_tokens > self.max_model_len:
      raise ValueError(
        f"prompt_token_ids plus output_token_ids hold {num_tokens} tokens, more "
        f"than max_model_len={self.max_model_len}"
      )
    return prompt, outputs, self._row_update(sampling_params, prompt, outputs)

  @staticmethod
  def _check_satisfiable(params: SamplingParams, allowed: set[int], stop_ids: list[int]) -> None:
    """Rejects a request whose constraints ban every token it may sample, whatever it generates.

    `allowed` is the allowlist, or the whole vocabulary. Constraints that conflict only after
    some outputs (multi-token bad words) are left to the sampler, whose defined result is then the
    best allowed token by raw logit (see `jaxengine.sampler`).
    """
    always_banned = {word[0] for word in params.bad_words_token_ids or () if len(word) == 1}
    if allowed <= always_banned:
      raise ValueError(
        "bad_words_token_ids ban every token allowed_token_ids (or the vocabulary) "
        f"permits ({len(allowed)} tokens): no token could ever be sampled"
      )
    if params.min_tokens > 0 and allowed <= always_banned | set(stop_ids):
      raise ValueError(
        f"allowed_token_ids permit only banned or stop tokens, but "
        f"min_tokens={params.min_tokens} forbids stopping first"
      )

  def _row_update(
    self, params: SamplingParams, prompt: np.ndarray, outputs: np.ndarray
  ) -> dict[str, np.ndarray]:
    """Validates `params` against the batch and builds the row's values (host NumPy only)."""
    V = self.vocab_size
    self._check_num_logprobs("logprobs", params.logprobs)
    self._check_num_logprobs("prompt_logprobs", params.prompt_logprobs)

    stop_ids = list(
      dict.fromkeys(
        self._token_array("stop_token_ids", params.stop_token_ids or ()).tolist()
        + list(self.eos_token_ids)
      )
    )
    if len(stop_ids) > self.max_num_stop_token_ids:
      raise ValueError(
        f"stop_token_ids plus EOS ids hold {len(stop_ids)} ids, more than "
        f"max_num_stop_token_ids={self.max_num_stop_token_ids}"
      )
    bias = params.logit_bias or {}
    bias_ids = self._token_array("logit_bias", list(bias.keys()))
    if len(bias) > self.max_num_logit_bias:
      raise ValueError(
        f"logit_bias has {len(bias)} entries, more than "
        f"max_num_logit_bias={self.max_num_logit_bias}"
      )
    allowed_mask = np.ones((V,), bool)
    if params.allowed_token_ids is not None:
      allowed = self._token_array("allowed_token_ids", params.allowed_token_ids)
      allowed_mask[:] = False
      allowed_mask[allowed] = True
    bad_words = params.bad_words_token_ids or ()
    if len(bad_words) > self.max_num_bad_words:
      raise ValueError(
        f"bad_words_token_ids has {len(bad_words)} sequences, more than "
        f"max_num_bad_words={self.max_num_bad_words}"
      )
    prefix_len = self.max_bad_word_len - 1
    bad_prefix = np.full((self.max_num_bad_words, prefix_len), -1, np.int32)
    bad_last = np.full((self.max_num_bad_words,), V, np.int32)
    for i, word in enumerate(bad_words):
      word = self._token_array("bad_words_token_ids", word)
      if len(word) > self.max_bad_word_len:
        raise ValueError(
          f"bad_words_token_ids sequence {word.tolist()} is longer than "
          f"max_bad_word_len={self.max_bad_word_len}"
        )
      if len(word) > 1:
        bad_prefix[i, prefix_len - (len(word) - 1) :] = word[:-1]
      bad_last[i] = word[-1]
    allowed = params.allowed_token_ids
    self._check_satisfiable(params, set(range(V) if allowed is None else allowed), stop_ids)

    token_ids = np.zeros((self.max_model_len,), np.int32)
    token_ids[: len(prompt)] = prompt
    token_ids[len(prompt) : len(prompt) + len(outputs)] = outputs
    seed = 0 if params.seed is None else params.seed % 2**64
    f32 = np.float32
    return dict(
      token_ids=token_ids,
      num_tokens=np.int32(len(prompt) + len(outputs)),
      num_prompt_tokens=np.int32(len(prompt)),
      cache_slot=np.int32(0),
      temperature=f32(params.temperature),
      top_k=np.int32(params.top_k if 0 < params.top_k < V else V),
      top_p=f32(params.top_p),
      min_p=f32(params.min_p),
      presence_penalty=f32(params.presence_penalty),
      frequency_penalty=f32(params.frequency_penalty),
      repetition_penalty=f32(params.repetition_penalty),
      num_logprobs=np.int32(
        -1 if params.logprobs is None else self._resolve_num_logprobs(params.logprobs)
      ),
      min_tokens=np.int32(params.min_tokens),
      stop_token_ids=_padded(stop_ids, self.max_num_stop_token_ids, V, np.int32),
      logit_bias_token_ids=_padded(bias_ids.tolist(), self.max_num_logit_bias, V, np.int32),
      logit_bias=_padded(list(bias.values()), self.max_num_logit_bias, 0.0, np.float32),
      has_allowed_token_ids=np.bool_(params.allowed_token_ids is not None),
      allowed_token_mask=allowed_mask,
      bad_words_prefix=bad_prefix,
      bad_words_last=bad_last,
      seed_words=np.array([seed & 0xFFFFFFFF, seed >> 32 & 0xFFFFFFFF], np.uint32),
      is_seeded=np.bool_(params.seed is not None),
      serial=np.uint32(0),
    )


def _padded(values: list, size: int, fill, dtype) -> np.ndarray:
  out = np.full((size,), fill, dtype)
  out[: len(values)] = values
  return out


@functools.partial(jax.jit, donate_argnames=("state",))
def _sample_logits(state: BatchState, metadata: SamplingMetadata, logits: jax.Array):
  state, output = sample(state, metadata, logits)
  return state, output, None


@functools.partial(jax.jit, static_argnums=1)
def _pad_rows(logits: jax.Array, max_num_reqs: int) -> jax.Array:
  """`[num_reqs, V]` -> `[max_num_reqs, V]` with zero rows (ignored by the sampler)."""
  return jnp.pad(logits, ((0, max_num_reqs - logits.shape[0]), (0, 0)))
