"""The engine: continuous batching of a Llama-family model over the persistent batch.

One `LLMEngine.step()`:

  1. admit waiting sequences into free rows of the `InputBatch` (each gets a KV-cache slot);
  2. prefill the new sequences' prompts except their last token, padded to a length bucket and a
     batch-size bucket (compiles are bounded by the buckets);
  3. decode: one jitted call over all `max_num_reqs` rows runs the model on each row's last token
     (for a new sequence, its last prompt token) read from the batch state on device, and samples
     the next token with the core sampler, in the same executable;
  4. on the host: append tokens, detokenize, check stop conditions (EOS unless ignore_eos,
     stop_token_ids, stop strings, never before min_tokens; max_tokens, max_model_len), remove
     finished sequences (the next step condenses and admits more).

Compiles: one decode step per length bucket reached (attention reads only that many cache
positions), one prefill per (batch bucket, length bucket) used, with or without prompt logprobs,
plus the batch's row write, row move and metadata refresh.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.batch import InputBatch
from jaxengine.kv_cache import KVCache
from jaxengine.models import llama
from jaxengine.outputs import CompletionOutput, Logprob, RequestOutput
from jaxengine.params import SamplingParams, is_int
from jaxengine.sample import gather_logprobs, sample
from jaxengine.tokenizer import IncrementalDetokenizer, Tokenizer

_MIN_PREFILL_BUCKET = 16


def _decode_and_sample(graphdef, state, metadata, weights, kv_cache, attention_len):
  """Model forward on each row's last token, then the sampler: one executable per step.

  `attention_len` (static) is the bucket of cache positions attended to, above every live row's
  length, so a step costs what the longest sequence needs rather than `max_model_len`.
  """
  rows = jnp.arange(state.max_num_reqs)
  last = jnp.maximum(state.num_tokens - 1, 0)
  token_ids = state.token_ids[rows, last]
  # Rows without a request write nothing: positions >= max_model_len are dropped by the cache.
  positions = jnp.where(metadata.is_live, last, state.max_model_len)
  hidden, kv_cache = llama.forward(
    graphdef,
    weights,
    token_ids[:, None],
    positions[:, None],
    kv_cache,
    state.cache_slot,
    attention_len=attention_len,
  )
  logits = llama.compute_logits(graphdef, weights, hidden[:, 0])
  state, output = sample(state, metadata, logits)
  return state, output, kv_cache


def _prefill(graphdef, weights, kv_cache, token_ids, positions, cache_slots):
  _, kv_cache = llama.forward(
    graphdef, weights, token_ids, positions, kv_cache, cache_slots, attention_len=token_ids.shape[1]
  )
  return kv_cache


def _prefill_with_prompt_logprobs(
  graphdef, num_logprobs, weights, kv_cache, token_ids, positions, cache_slots, next_token_ids
):
  """Prefill that also returns raw log-softmax logprobs of each next prompt token ([B, T, k+1])."""
  hidden, kv_cache = llama.forward(
    graphdef, weights, token_ids, positions, kv_cache, cache_slots, attention_len=token_ids.shape[1]
  )
  logits = llama.compute_logits(graphdef, weights, hidden)  # [B, T, V]
  batch, length, vocab = logits.shape
  logprobs = gather_logprobs(
    logits.reshape(batch * length, vocab), next_token_ids.reshape(-1), num_logprobs
  )
  return kv_cache, jax.tree.map(lambda a: a.reshape(batch, length, *a.shape[1:]), logprobs)


def _buckets(limit: int, start: int) -> list[int]:
  sizes = [start]
  while sizes[-1] < limit:
    sizes.append(sizes[-1] * 2)
  sizes[-1] = min(sizes[-1], limit)
  return sizes


def _bucket(n: int, buckets: list[int]) -> int:
  return next(b for b in buckets if b >= n)


@dataclasses.dataclass
class _Sequence:
  """One completion being generated: a row of the batch while running."""

  seq_id: str
  request: _Request
  index: int
  params: SamplingParams
  detokenizer: IncrementalDetokenizer | None
  token_ids: list[int] = dataclasses.field(default_factory=list)
  logprobs: list | None = None
  cumulative_logprob: float | None = None
  text: str = ""
  finish_reason: str | None = None
  stop_reason: int | str | None = None

  def output(self) -> CompletionOutput:
    return CompletionOutput(
      index=self.index,
      text=self.text,
      token_ids=list(self.token_ids),
      cumulative_logprob=self.cumulative_logprob,
      logprobs=None if self.logprobs is None else list(self.logprobs),
      finish_reason=self.finish_reason,
      stop_reason=self.stop_reason,
    )


@dataclasses.dataclass
class _Request:
  request_id: str
  prompt: str | None
  prompt_token_ids: list[int]
  params: SamplingParams
  sequences: list[_Sequence] = dataclasses.field(default_factory=list)
  prompt_logprobs: list | None = None

  def output(self) -> RequestOutput:
    return RequestOutput(
      request_id=self.request_id,
      prompt=self.prompt,
      prompt_token_ids=list(self.prompt_token_ids),
      prompt_logprobs=self.prompt_logprobs,
      outputs=[s.output() for s in self.sequences],
      finished=all(s.finish_reason is not None for s in self.sequences),
    )


class LLMEngine:
  """Continuous batching over a persistent `InputBatch` and a slot-addressed KV cache.

  Args:
    model: a `jaxengine.models.Llama` (weights already loaded).
    tokenizer: its `Tokenizer`, or None (then prompts must be token ids, no text is produced and
      stop strings / bad_words strings are rejected).
    max_num_reqs: rows of the batch (sequences decoded at once).
    max_model_len: longest prompt plus output, in tokens (KV-cache length per slot).
    max_num_logprobs: largest logprobs / prompt_logprobs a request may ask for (`-1`: whole vocab).
    logprobs_mode: see `InputBatch`.
    seed: seed of the engine key (unseeded requests derive their keys from it).
    eos_token_id: overrides the tokenizer's / model config's EOS id.

  Raises:
    ValueError: `max_model_len` above the model's `max_position_embeddings`.
  """

  def __init__(
    self,
    model: llama.Llama,
    tokenizer: Tokenizer | None = None,
    *,
    max_num_reqs: int = 16,
    max_model_len: int = 1024,
    max_num_logprobs: int = 20,
    logprobs_mode: str = "raw_logprobs",
    seed: int = 0,
    eos_token_id: int | None = None,
  ):
    config = model.config
    if max_model_len > config.max_position_embeddings:
      raise ValueError(
        f"max_model_len={max_model_len} exceeds the model's "
        f"max_position_embeddings={config.max_position_embeddings}"
      )
    self.config = config
    self.tokenizer = tokenizer
    if eos_token_id is None:
      eos_token_id = tokenizer.eos_token_id if tokenizer is not None else config.eos_token_id
    self.eos_token_id = eos_token_id
    self.max_num_reqs = max_num_reqs
    self.max_model_len = max_model_len
    self.batch = InputBatch(
      max_num_reqs,
      max_model_len,
      config.vocab_size,
      max_num_logprobs=max_num_logprobs,
      logprobs_mode=logprobs_mode,
      eos_token_ids=() if eos_token_id is None else (eos_token_id,),
      seed=seed,
    )
    self._graphdef, self._weights = nnx.split(model)
    dtype = model.embed[...].dtype
    self._kv_cache = KVCache.create(config, max_num_reqs, max_model_len, dtype)
    self._decode = jax.jit(
      functools.partial(_decode_and_sample, self._graphdef),
      static_argnames=("attention_len",),
      donate_argnames=("state", "kv_cache"),
    )
    self._prefill = jax.jit(
      functools.partial(_prefill, self._graphdef), donate_argnames=("kv_cache",)
    )
    self._prefill_logprobs = jax.jit(
      functools.partial(
        _prefill_with_prompt_logprobs, self._graphdef, self.batch.state.max_num_logprobs
      ),
      donate_argnames=("kv_cache",),
    )
    self._length_buckets = _buckets(max_model_len, min(_MIN_PREFILL_BUCKET, max_model_len))
    self._batch_buckets = _buckets(max_num_reqs, 1)
    self._waiting: collections.deque[_Sequence] = collections.deque()
    self._running: dict[str, _Sequence] = {}
    self._requests: dict[str, _Request] = {}
    self._ids = itertools.count()
    self._decoded_tokens: dict[int, str] = {}

  # --- requests -----------------------------------------------------------------------------

  def add_request(
    self, request_id: str | None, prompt: str | Sequence[int], params: SamplingParams | None = None
  ) -> str:
    """Queues a prompt (text or token ids); returns its request id.

    Raises:
      ValueError: (nothing queued) for a duplicate id, an empty prompt, a prompt of
        `max_model_len` tokens or more, token ids outside the vocabulary, text without a
        tokenizer, or sampling parameters the batch cannot hold.
    """
    return self.add_requests([(request_id, prompt, params)])[0]

  def add_requests(
    self, requests: Sequence[tuple[str | None, str | Sequence[int], SamplingParams | None]]
  ) -> list[str]:
    """Validates every `(request_id, prompt, params)` first, then queues them all.

    Raises:
      ValueError: as `add_request`; if any request is invalid, none is queued.
    """
    made = []
    for index, (request_id, prompt, params) in enumerate(requests):
      request_id = str(next(self._ids)) if request_id is None else str(request_id)
      if request_id in self._requests or any(r.request_id == request_id for r in made):
        raise ValueError(f"request_id {request_id!r} is already in the engine")
      try:
        made.append(self._make_request(request_id, prompt, params or SamplingParams()))
      except ValueError as error:
        where = f"prompt {index}" if len(requests) > 1 else "the prompt"
        raise ValueError(f"{where}: {error}") from None
    for request in made:
      self._requests[request.request_id] = request
      self._waiting.extend(request.sequences)
    return [r.request_id for r in made]

  def _make_request(self, request_id: str, prompt, params: SamplingParams) -> _Request:
    if not isinstance(params, SamplingParams):
      raise ValueError(f"sampling_params must be a SamplingParams, got {params!r}")
    text, prompt_token_ids = self._prompt_text_and_ids(prompt)
    if not prompt_token_ids:
      raise ValueError("the prompt is empty")
    if len(prompt_token_ids) >= self.max_model_len:
      raise ValueError(
        f"the prompt has {len(prompt_token_ids)} tokens; it must be shorter than "
        f"max_model_len={self.max_model_len}"
      )
    if (params.stop or params.bad_words) and self.tokenizer is None:
      raise ValueError("stop strings and bad_words need a tokenizer")
    params = self._with_bad_words(params)
    self.batch.validate_request(prompt_token_ids, params)

    request = _Request(request_id, text, prompt_token_ids, params)
    for j in range(params.n):
      # vLLM's parallel sampling: child j of a seeded request uses seed + j.
      child = params if params.seed is None or j == 0 else params.replace(seed=params.seed + j)
      seq_id = request_id if params.n == 1 else f"{request_id}#{j}"
      detokenizer = (
        None
        if self.tokenizer is None
        else IncrementalDetokenizer(
          self.tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens
        )
      )
      request.sequences.append(
        _Sequence(
          seq_id,
          request,
          j,
          child,
          detokenizer,
          logprobs=None if params.logprobs is None else [],
          cumulative_logprob=None if params.logprobs is None else 0.0,
        )
      )
    return request

  def _prompt_text_and_ids(self, prompt) -> tuple[str | None, list[int]]:
    """A prompt as (text or None, token ids): a string, a token-id sequence, or vLLM's prompt dicts
    `{"prompt": text}` and `{"prompt_token_ids": ids}` (optionally with `"prompt"` for the
    outputs)."""
    if isinstance(prompt, dict):
      unknown = set(prompt) - {"prompt", "prompt_token_ids"}
      if unknown or not prompt:
        raise ValueError(
          f"a prompt dict takes the keys 'prompt' and/or 'prompt_token_ids', got "
          f"{sorted(map(str, prompt))}"
        )
      if "prompt_token_ids" in prompt:
        return prompt.get("prompt"), self._token_ids(prompt["prompt_token_ids"])
      prompt = prompt["prompt"]
    if isinstance(prompt, str):
      if self.tokenizer is None:
        raise ValueError("text prompts need a tokenizer; pass token ids")
      return prompt, self.tokenizer.encode(prompt)
    return None, self._token_ids(prompt)

  @staticmethod
  def _token_ids(token_ids) -> list[int]:
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Iterable):
      raise ValueError(f"a prompt must be a string or a sequence of token ids, got {token_ids!r}")
    token_ids = list(token_ids)
    if not all(is_int(t) for t in token_ids):
      raise ValueError(f"prompt_token_ids must hold only ints, got {token_ids[:8]!r}")
    return [int(t) for t in token_ids]

  def _with_bad_words(self, params: SamplingParams) -> SamplingParams:
    """Turns `bad_words` strings into token-id sequences (vLLM's rule: the word without leading
    space, plus its leading-space variant when that tokenizes to as many tokens differently)."""
    if not params.bad_words:
      return params
    sequences = list(params.bad_words_token_ids or ())
    for word in params.bad_words:
      plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
      spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
      sequences.append(tuple(plain))
      if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
        sequences.append(tuple(spaced))
    return params.replace(bad_words_token_ids=tuple(sequences))

  def has_unfinished_requests(self) -> bool:
    """Whether any request is waiting or running."""
    return bool(self._waiting or self._running)

  def pop_finished(self) -> list[RequestOutput]:
    """Returns and forgets every finished request."""
    done = [
      r for r in self._requests.values() if all(s.finish_reason is not None for s in r.sequences)
    ]
    for request in done:
      del self._requests[request.request_id]
    return [r.output() for r in done]

  # --- the step -------------------------------------------------------------------------------

  def step(self) -> list[RequestOutput]:
    """Admits, prefills, decodes one token for every running sequence, applies stop rules.

    Returns:
      A `RequestOutput` (cumulative so far) for every request that advanced this step.
    """
    new = self._admit()
    if new:
      self._prefill_sequences(new)
    if not self._running:
      return []
    longest = max(self.batch.num_tokens(seq_id) for seq_id in self._running)
    attention_len = _bucket(longest, self._length_buckets)
    output, self._kv_cache = self.batch.run(
      self._decode, self._weights, self._kv_cache, attention_len
    )
    advanced = {}
    for row, seq_id in enumerate(self.batch.req_ids):
      seq = self._running[seq_id]
      self._append(seq, row, output)
      advanced[seq.request.request_id] = seq.request
      if seq.finish_reason is not None:
        self.batch.remove_request(seq_id)
        del self._running[seq_id]
    return [r.output() for r in advanced.values()]

  def _admit(self) -> list[_Sequence]:
    admitted = []
    while self._waiting and self.batch.num_reqs < self.max_num_reqs:
      seq = self._waiting.popleft()
      self.batch.add_request(seq.seq_id, seq.request.prompt_token_ids, seq.params)
      self._running[seq.seq_id] = seq
      admitted.append(seq)
    return admitted

  def _prefill_sequences(self, sequences: list[_Sequence]) -> None:
    """Writes the KV cache of every prompt token but the last (the decode step feeds that one)."""
    by_bucket = collections.defaultdict(list)
    for seq in sequences:
      length = len(seq.request.prompt_token_ids) - 1
      wants_logprobs = seq.index == 0 and seq.params.prompt_logprobs is not None
      if length > 0:
        by_bucket[_bucket(length, self._length_buckets), wants_logprobs].append(seq)
      elif wants_logprobs:
        seq.request.prompt_logprobs = [None]
    for (length, wants_logprobs), group in sorted(by_bucket.items()):
      for start in range(0, len(group), self.max_num_reqs):
        self._prefill_group(group[start : start + self.max_num_reqs], length, wants_logprobs)

  def _prefill_group(self, group: list[_Sequence], length: int, wants_logprobs: bool) -> None:
    size = _bucket(len(group), self._batch_buckets)
    token_ids = np.zeros((size, length), np.int32)
    next_token_ids = np.zeros((size, length), np.int32)
    # Padding rows and padding positions go past the prompt (nothing real reads them); whole
    # padding rows use max_model_len, where the cache drops writes.
    positions = np.full((size, length), self.max_model_len, np.int32)
    slots = np.zeros((size,), np.int32)
    for i, seq in enumerate(group):
      prompt = seq.request.prompt_token_ids
      n = len(prompt) - 1
      token_ids[i, :n] = prompt[:-1]
      next_token_ids[i, :n] = prompt[1:]
      positions[i] = np.arange(length)
      slots[i] = self.batch.cache_slot(seq.seq_id)
    if not wants_logprobs:
      self._kv_cache = self._prefill(self._weights, self._kv_cache, token_ids, positions, slots)
      return
    self._kv_cache, logprobs = self._prefill_logprobs(
      self._weights, self._kv_cache, token_ids, positions, slots, next_token_ids
    )
    logprobs = jax.device_get(logprobs)
    for i, seq in enumerate(group):
      n = len(seq.request.prompt_token_ids) - 1
      k = self._resolve_k(seq.params.prompt_logprobs)
      seq.request.prompt_logprobs = [None] + [
        self._logprob_dict(
          logprobs.token_ids[i, t], logprobs.logprobs[i, t], int(logprobs.ranks[i, t]), k
        )
        for t in range(n)
      ]

  # --- host bookkeeping -------------------------------------------------------------------------

  def _resolve_k(self, k: int) -> int:
    return self.config.vocab_size if k == -1 else k

  def _logprob_dict(self, token_ids, values, rank: int, k: int) -> dict[int, Logprob]:
    """vLLM's per-position dict: the chosen token with its rank, then the top k by position
    (a chosen token inside the top k keeps its top-k entry)."""
    ids = [int(t) for t in token_ids[: k + 1]]
    ranks = [rank] + list(range(1, k + 1))
    out = {}
    for token_id, value, r in zip(ids, values[: k + 1], ranks):
      out[token_id] = Logprob(float(value), r, self._decoded(token_id))
    return out

  def _decoded(self, token_id: int) -> str | None:
    """A token's text for `Logprob.decoded_token` (memoised: top-k entries repeat a lot)."""
    if self.tokenizer is None:
      return None
    text = self._decoded_tokens.get(token_id)
    if text is None:
      text = self._decoded_tokens[token_id] = self.tokenizer.decode(
        [token_id], skip_special_tokens=False
      )
    return text

  def _append(self, seq: _Sequence, row: int, output) -> None:
    token = int(output.sampled_token_ids[row])
    params = seq.params
    seq.token_ids.append(token)
    if seq.logprobs is not None:
      lp = output.logprobs
      k = self._resolve_k(params.logprobs)
      seq.logprobs.append(
        self._logprob_dict(lp.token_ids[row], lp.logprobs[row], int(lp.ranks[row]), k)
      )
      seq.cumulative_logprob += float(lp.logprobs[row, 0])
    num_output = len(seq.token_ids)
    may_stop = num_output >= params.min_tokens
    # vLLM's order: the length limits first, then EOS and stop ids (whose token is kept in
    # token_ids but not detokenized), then stop strings in the new text.
    max_tokens = params.max_tokens or self.max_model_len
    if num_output >= max_tokens or self.batch.num_tokens(seq.seq_id) >= self.max_model_len:
      seq.finish_reason = "length"
    elif may_stop and not params.ignore_eos and token == self.eos_token_id:
      seq.finish_reason = "stop"
      return
    elif may_stop and params.stop_token_ids and token in params.stop_token_ids:
      seq.finish_reason, seq.stop_reason = "stop", token
      return
    if seq.detokenizer is not None:
      delta = seq.detokenizer.add_tokens([token])
      seq.text += delta
      if may_stop and params.stop and delta:
        self._check_stop_strings(seq, len(delta))

  def _check_stop_strings(self, seq: _Sequence, delta_len: int) -> None:
    params = seq.params
    longest = max(len(s) for s in params.stop)
    search_from = max(0, len(seq.text) - delta_len - longest + 1)
    hits = [(seq.text.find(s, search_from), s) for s in params.stop]
    hits = [(i, s) for i, s in hits if i >= 0]
    if hits:
      index, stop = min(hits)
      seq.text = seq.text[: index + len(stop) if params.include_stop_str_in_output else index]
      seq.finish_reason, seq.stop_reason = "stop", stop
