"""Validating one request against a batch's configuration and encoding it as a `RowUpdate`.

Everything here runs on the host with NumPy: every check of user input happens before any device
work, so a refused request leaves the batch exactly as it was.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from jaxengine.batch.logits_processors import encode_processor_rows
from jaxengine.config import BatchConfig
from jaxengine.params import SamplingParams, is_int
from jaxengine.sample.row_params import encode_row_params
from jaxengine.sample.state import RowUpdate


@dataclasses.dataclass(frozen=True)
class EncodedRequest:
  """A validated request, its `SamplingParams` encoded as a row once (`encode_request`; an
  engine encodes at the door, `engine/input_processor.py`, and hands the result to the batch at
  admission). Small while it waits: the `[S]` token row is laid out only when the batch writes it
  (`row_update`), and a mask without an allowlist is one broadcast `True`.

  Attributes:
    prompt_token_ids: `[num_prompt_tokens] int32`.
    output_token_ids: `[num_output_tokens] int32` tokens already generated (a resumed request).
    row: the row values for `write_rows` without the token row (`token_ids` is `[0] int32`;
      `cache_slot` and `serial` still 0): `row_update` completes them.
  """

  prompt_token_ids: np.ndarray
  output_token_ids: np.ndarray
  row: RowUpdate

  def row_update(self, max_model_len: int, cache_slot: int, serial: int) -> RowUpdate:
    """The whole row to write: `row` with its `[S] int32` token row (prompt then outputs,
    zero-padded to `max_model_len`), its cache slot and its serial."""
    return dataclasses.replace(
      self.row,
      token_ids=_token_row(max_model_len, self.prompt_token_ids, self.output_token_ids),
      cache_slot=np.int32(cache_slot),
      serial=np.uint32(serial),
    )


def token_array(field: str, token_ids, vocab_size: int) -> np.ndarray:
  """`token_ids` as `int32 [n]`, checked to be int ids in `[0, vocab_size)`.

  Raises:
    ValueError: naming `field`, for a non-sequence, non-int entries (bools included) or ids out
      of range.
  """
  if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Iterable):
    raise ValueError(f"{field} must be a sequence of ints, got {token_ids!r}")
  token_ids = list(token_ids)
  not_ints = [t for t in token_ids if not is_int(t)]
  if not_ints:
    raise ValueError(f"{field} must hold only int token ids, got {not_ints[:5]!r}")
  array = np.asarray(token_ids, dtype=np.int64).reshape(-1)
  bad = array[(array < 0) | (array >= vocab_size)]
  if bad.size:
    raise ValueError(f"{field} holds token ids outside [0, {vocab_size}): {bad.tolist()}")
  return array.astype(np.int32)


def eos_tuple(eos_token_ids, vocab_size: int) -> tuple[int, ...]:
  """EOS ids (None, one int or a sequence of ints) as a tuple of ids in `[0, vocab_size)`."""
  if eos_token_ids is None:
    return ()
  if is_int(eos_token_ids):
    eos_token_ids = (eos_token_ids,)
  if isinstance(eos_token_ids, (str, bytes)) or not isinstance(eos_token_ids, Iterable):
    raise ValueError(f"eos_token_ids must be an int or a sequence of ints, got {eos_token_ids!r}")
  for token in eos_token_ids:
    if not is_int(token) or not 0 <= token < vocab_size:
      raise ValueError(f"eos_token_ids must lie in [0, {vocab_size}), got {token!r}")
  return tuple(int(t) for t in eos_token_ids)


def resolve_num_logprobs(config: BatchConfig, requested: int) -> int:
  """A request's logprobs count with `-1` (whole vocabulary) as `V`."""
  return config.vocab_size if requested == -1 else requested


def _check_num_logprobs(config: BatchConfig, field: str, requested: int | None) -> None:
  if requested is None:
    return
  if requested > config.vocab_size:  # as vLLM, whose max_logprobs=-1 means V
    raise ValueError(f"{field}={requested} exceeds the vocabulary size {config.vocab_size}")
  if config.max_num_logprobs == -1:
    return
  if resolve_num_logprobs(config, requested) > config.max_num_logprobs:  # vLLM's check
    whole = f" (the whole vocabulary, {config.vocab_size})" if requested == -1 else ""
    limit = config.max_num_logprobs
    raise ValueError(f"{field}={requested}{whole} exceeds max_num_logprobs={limit} of this batch")


def _check_satisfiable(params: SamplingParams, vocab_size: int, stop_ids: list[int]) -> None:
  """Refuses a request whose constraints ban every token it may sample, whatever it generates.

  The tokens it may sample are the allowlist, or the whole vocabulary (counted, never built: a
  set of `V` ints costs about a millisecond a request). Constraints that conflict only after some
  outputs (multi-token bad words) are left to the sampler, whose defined result is then the best
  allowed token by raw logit (see `jaxengine.sample.step`).
  """
  allowed = None if params.allowed_token_ids is None else set(params.allowed_token_ids)

  def all_in(banned: set[int]) -> bool:
    if allowed is None:
      return sum(0 <= token < vocab_size for token in banned) == vocab_size
    return allowed <= banned

  always_banned = {word[0] for word in params.bad_words_token_ids or () if len(word) == 1}
  if all_in(always_banned):
    num_allowed = vocab_size if allowed is None else len(allowed)
    raise ValueError(
      "bad_words_token_ids ban every token allowed_token_ids (or the vocabulary) "
      f"permits ({num_allowed} tokens): no token could ever be sampled"
    )
  if params.min_tokens > 0 and all_in(always_banned | set(stop_ids)):
    raise ValueError(
      f"allowed_token_ids permit only banned or stop tokens, but "
      f"min_tokens={params.min_tokens} forbids stopping first"
    )


def _padded(values: list, size: int, fill, dtype) -> np.ndarray:
  out = np.full((size,), fill, dtype)
  out[: len(values)] = values
  return out


def _stop_set(config: BatchConfig, params: SamplingParams, eos_token_ids) -> list[int]:
  """The min_tokens stop set: the request's stop ids, then the batch's EOS ids, once each."""
  requested = token_array("stop_token_ids", params.stop_token_ids or (), config.vocab_size)
  stop_ids = list(dict.fromkeys(requested.tolist() + list(eos_token_ids)))
  if len(stop_ids) > config.max_num_stop_token_ids:
    raise ValueError(
      f"stop_token_ids plus EOS ids hold {len(stop_ids)} ids, more than "
      f"max_num_stop_token_ids={config.max_num_stop_token_ids}"
    )
  return stop_ids


def _logit_bias(config: BatchConfig, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
  """`(ids [max_num_logit_bias] int32 padded with V, biases [max_num_logit_bias] float32)`."""
  bias = params.logit_bias or {}
  bias_ids = token_array("logit_bias", list(bias.keys()), config.vocab_size)
  if len(bias) > config.max_num_logit_bias:
    raise ValueError(
      f"logit_bias has {len(bias)} entries, more than "
      f"max_num_logit_bias={config.max_num_logit_bias}"
    )
  size, vocab = config.max_num_logit_bias, config.vocab_size
  return (
    _padded(bias_ids.tolist(), size, vocab, np.int32),
    _padded(list(bias.values()), size, 0.0, np.float32),
  )


def _allowed_mask(config: BatchConfig, params: SamplingParams) -> np.ndarray:
  """`[V] bool` the allowlist as a mask (without one: all True, a read-only broadcast view that
  holds one value, so a waiting request does not keep `V` bytes)."""
  if params.allowed_token_ids is None:
    return np.broadcast_to(np.True_, (config.vocab_size,))
  allowed = token_array("allowed_token_ids", params.allowed_token_ids, config.vocab_size)
  mask = np.zeros((config.vocab_size,), bool)
  mask[allowed] = True
  return mask


def _bad_words(config: BatchConfig, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
  """`(prefix [max_num_bad_words, max_bad_word_len - 1], last [max_num_bad_words])` int32: each
  banned sequence right-aligned, left-padded with -1; unused sequences end in `V`."""
  bad_words = params.bad_words_token_ids or ()
  if len(bad_words) > config.max_num_bad_words:
    raise ValueError(
      f"bad_words_token_ids has {len(bad_words)} sequences, more than "
      f"max_num_bad_words={config.max_num_bad_words}"
    )
  prefix_len = config.max_bad_word_len - 1
  prefix = np.full((config.max_num_bad_words, prefix_len), -1, np.int32)
  last = np.full((config.max_num_bad_words,), config.vocab_size, np.int32)
  for i, sequence in enumerate(bad_words):
    word = token_array("bad_words_token_ids", sequence, config.vocab_size)
    if len(word) > config.max_bad_word_len:
      raise ValueError(
        f"bad_words_token_ids sequence {word.tolist()} is longer than "
        f"max_bad_word_len={config.max_bad_word_len}"
      )
    if len(word) > 1:
      prefix[i, prefix_len - (len(word) - 1) :] = word[:-1]
    last[i] = word[-1]
  return prefix, last


def _token_row(max_model_len: int, prompt: np.ndarray, outputs: np.ndarray) -> np.ndarray:
  """`[S] int32` prompt then output tokens, zero-padded."""
  token_ids = np.zeros((max_model_len,), np.int32)
  token_ids[: len(prompt)] = prompt
  token_ids[len(prompt) : len(prompt) + len(outputs)] = outputs
  return token_ids


def _key_fields(params: SamplingParams) -> dict[str, Any]:
  """The seed as two uint32 words (taken modulo 2**64) and whether there is one."""
  seed = 0 if params.seed is None else params.seed % 2**64
  return dict(
    seed_words=np.array([seed & 0xFFFFFFFF, seed >> 32 & 0xFFFFFFFF], np.uint32),
    is_seeded=np.bool_(params.seed is not None),
    serial=np.uint32(0),
  )


def encode_request(
  config: BatchConfig,
  eos_token_ids: Sequence[int],
  prompt_token_ids,
  sampling_params: SamplingParams,
  output_token_ids=(),
  processor_states: tuple = (),
) -> EncodedRequest:
  """Validates a request against the batch and encodes it as a row (host NumPy only).

  Raises:
    ValueError: naming the field, for a `sampling_params` that is not a `SamplingParams`, an
      empty prompt, token ids that are not ints in `[0, V)` in any field, more than `S` tokens,
      lists longer than the batch's capacities, logprobs above `max_num_logprobs`, or constraints
      that ban every token whatever the output; or from a logits processor refusing it
      (`processor_states`: the batch's `logits_processor_states`, read for shapes and dtypes).
  """
  if not isinstance(sampling_params, SamplingParams):
    raise ValueError(f"sampling_params must be a SamplingParams, got {type(sampling_params)}")
  params, vocab = sampling_params, config.vocab_size
  prompt = token_array("prompt_token_ids", prompt_token_ids, vocab)
  if not len(prompt):
    raise ValueError("prompt_token_ids must hold at least one token, got an empty prompt")
  outputs = token_array("output_token_ids", output_token_ids, vocab)
  num_tokens = len(prompt) + len(outputs)
  if num_tokens >= config.max_model_len:  # a row must have room for the token it samples next
    raise ValueError(
      f"prompt_token_ids plus output_token_ids hold {num_tokens} tokens; at most "
      f"max_model_len - 1 = {config.max_model_len - 1} leave room for a sampled token"
    )
  _check_num_logprobs(config, "logprobs", params.logprobs)
  _check_num_logprobs(config, "prompt_logprobs", params.prompt_logprobs)
  stop_ids = _stop_set(config, params, eos_token_ids)
  bias_ids, bias = _logit_bias(config, params)
  allowed_mask = _allowed_mask(config, params)
  bad_prefix, bad_last = _bad_words(config, params)
  _check_satisfiable(params, vocab, stop_ids)
  processor_rows, processor_active = encode_processor_rows(
    config.logits_processors, processor_states, params, prompt.tolist()
  )
  row = RowUpdate(
    token_ids=np.zeros((0,), np.int32),  # laid out when written (`row_update`)
    num_tokens=np.int32(num_tokens),
    num_prompt_tokens=np.int32(len(prompt)),
    cache_slot=np.int32(0),
    **encode_row_params(params, config),
    stop_token_ids=_padded(stop_ids, config.max_num_stop_token_ids, vocab, np.int32),
    logit_bias_token_ids=bias_ids,
    logit_bias=bias,
    has_allowed_token_ids=np.bool_(params.allowed_token_ids is not None),
    allowed_token_mask=allowed_mask,
    bad_words_prefix=bad_prefix,
    bad_words_last=bad_last,
    **_key_fields(params),
    logits_processor_states=processor_rows,
    logits_processor_active=processor_active,
    has_grammar=np.bool_(params.structured_outputs is not None),
  )
  return EncodedRequest(prompt_token_ids=prompt, output_token_ids=outputs, row=row)
