"""`BatchState`: the device side of the persistent batch, a frozen pytree of fixed-capacity arrays.

Every per-request value is a traced array with a leading `R` (`max_num_reqs`) axis, so no value a
request carries can trigger a compile; the only static field is the `BatchConfig`. Rows are
written whole by `write_row` from a typed `RowUpdate` (a request never inherits a previous
occupant's state) and moved by `move_rows` (condense and swap); both are jitted and donate the
state. `InputBatch` (`jaxengine.batch`) owns one `BatchState` and is the only host code that
updates it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxengine.config import BatchConfig
from jaxengine.params import SEED_MAX, SEED_MIN, is_int
from jaxengine.sample.custom import checked_init_state
from jaxengine.sample.row_params import Leaf, RowParams, empty_row_params

# Shape of one `jax.random.key` as raw uint32 words (threefry: (2,)). Keys are stored as raw words
# so that rows can be gathered, scattered and compared like any other array.
KEY_DATA_SHAPE = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowFields(RowParams[Leaf]):
  """Every per-row field a request's row sets whole: the sampling parameters (`RowParams`), the
  row's tokens, its list-valued parameters and its processor state.

  `BatchState` holds them with a leading `R` axis; a `RowUpdate` holds one row of each (shapes
  without the `R`). Declared here once for both (shape legend: `R` rows, `S` positions, `V`
  vocab; list capacities from `BatchConfig`).

  Attributes:
    token_ids: `[R, S] int32` prompt then output tokens of each row.
    num_tokens: `[R] int32` prompt plus output tokens so far.
    num_prompt_tokens: `[R] int32`.
    cache_slot: `[R] int32` KV-cache slot of the row's request, so reordering rows never moves
      cached keys and values.
    stop_token_ids: `[R, max_num_stop_token_ids] int32` the min_tokens stop set (the request's
      stop ids and the batch's EOS ids), padded with `V`.
    logit_bias_token_ids: `[R, max_num_logit_bias] int32`, padded with `V`.
    logit_bias: `[R, max_num_logit_bias] float32`, padded with `0`.
    has_allowed_token_ids: `[R] bool`.
    allowed_token_mask: `[R, V] bool`, True where a token is allowed (all True without a list).
    bad_words_prefix: `[R, max_num_bad_words, max_bad_word_len - 1] int32` each banned sequence
      without its last token, right-aligned and left-padded with `-1` (matches anything).
    bad_words_last: `[R, max_num_bad_words] int32` last token of each banned sequence, padded
      with `V`.
    logits_processor_states: one pytree per `config.logits_processors` entry (its `init_state`),
      every leaf `[R, ...]`: the processor's row state moves with its row.
    logits_processor_active: `[R, P] bool` whether processor `p` acts on the row's request.
    has_grammar: `[R] bool` whether the row's request has structured outputs.
  """

  token_ids: Leaf
  num_tokens: Leaf
  num_prompt_tokens: Leaf
  cache_slot: Leaf
  stop_token_ids: Leaf
  logit_bias_token_ids: Leaf
  logit_bias: Leaf
  has_allowed_token_ids: Leaf
  allowed_token_mask: Leaf
  bad_words_prefix: Leaf
  bad_words_last: Leaf
  logits_processor_states: tuple
  logits_processor_active: Leaf
  has_grammar: Leaf


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchState(RowFields[jax.Array]):
  """Per-row state of the persistent batch (shape legend: `R` rows, `S` positions, `V` vocab).

  The `RowFields` (with the sampling parameters of `RowParams`), each with a leading `R` axis,
  plus the fields below that `write_row` derives. A field named like a `SamplingParams` field
  holds that parameter for the request in each row, with vLLM's "disabled" sentinels: `top_k ==
  V`, `top_p == 1`, `min_p == 0`, penalties `(0, 0, 1)`. Rows that hold no request contain stale
  values that are never read (the metadata's `is_live` mask excludes them) and are overwritten
  entirely when a request is added.

  Attributes:
    key_data: `[R, *KEY_DATA_SHAPE] uint32` raw words of the request's base `jax.random.key`
      (`[R, 2]` for the default threefry implementation); the key for its t-th output token is
      `fold_in(key, t)`.
    output_token_counts: `[R, V] int32` occurrences of each token in the output so far (for the
      frequency and presence penalties), updated by every sample step.
    prompt_token_mask: `[R, V] bool` tokens present in the prompt (for the repetition penalty).
    grammar_bitmask: `[R, ceil(V / 32)] int32` allowed tokens of grammar rows, packed (bit
      `t % 32` of word `t // 32`); written by the host before each step (see
      `InputBatch.set_grammar_bitmask`), read only where `has_grammar`.
    config: static; the `BatchConfig` (capacities, logprobs mode, candidate budget).
  """

  key_data: jax.Array
  output_token_counts: jax.Array
  prompt_token_mask: jax.Array
  grammar_bitmask: jax.Array
  config: BatchConfig = dataclasses.field(metadata=dict(static=True))

  @property
  def max_num_reqs(self) -> int:
    """`R`, rows of the batch."""
    return self.config.max_num_reqs

  @property
  def max_model_len(self) -> int:
    """`S`, token capacity of a row."""
    return self.config.max_model_len

  @property
  def vocab_size(self) -> int:
    """`V`, width of the logits."""
    return self.config.vocab_size

  @property
  def num_top_logprobs(self) -> int:
    """Top logprobs computed per row (`config.num_top_logprobs`: `V` for the whole vocabulary)."""
    return self.config.num_top_logprobs

  @property
  def num_output_tokens(self) -> jax.Array:
    """`[R] int32` tokens generated so far by each row's request."""
    return self.num_tokens - self.num_prompt_tokens

  def leading_rows(self, num_rows: int) -> BatchState:
    """The state of the first `num_rows` rows, as a batch of `num_rows` rows (static count).

    An engine that samples only a bucket of rows holding every live one (the batch is condensed)
    computes on this smaller state, then writes it back with `with_leading_rows`.
    """
    rows = jax.tree.map(lambda a: a[:num_rows], self)
    return dataclasses.replace(rows, config=self.config.replace(max_num_reqs=num_rows))

  def with_leading_rows(self, rows: BatchState, before: BatchState | None = None) -> BatchState:
    """This state with its first rows replaced by `rows` (in place when this state is donated).

    With `before`, the `leading_rows` that `rows` was computed from, a leaf of `rows` that is
    `before`'s own (traced value, unchanged) is not written back: the write would be an identity
    that XLA:TPU does not drop. Measured on the sampler at one row of Llama-3.1-8B's 256 (v6e,
    `aot/hbm_bytes.py`): the allowed-token mask, `[R, V] bool`, was relaid out and copied whole
    into and out of on-core memory every step, 66 MB of 119 MB of the executable's HBM traffic.
    """
    rows = dataclasses.replace(rows, config=self.config)  # same static part, so the trees match
    if before is None:
      return jax.tree.map(lambda a, b: a.at[: b.shape[0]].set(b), self, rows)
    before = dataclasses.replace(before, config=self.config)
    return jax.tree.map(
      lambda a, b, old: a if b is old else a.at[: b.shape[0]].set(b), self, rows, before
    )

  @classmethod
  def create(cls, config: BatchConfig) -> BatchState:
    """Returns an empty state (every row free) with the capacities of `config`."""
    R, S, V = config.max_num_reqs, config.max_model_len, config.vocab_size
    i32 = lambda *shape, fill=0: np.full(shape, fill, np.int32)
    f32 = lambda *shape, fill=0.0: np.full(shape, fill, np.float32)
    num_bad_words, prefix_len = config.max_num_bad_words, config.max_bad_word_len - 1
    # Filled on the host and sent in one transfer: a `jnp.full` per field would compile (or read
    # back from the cache) one small program per shape, about a second of a fresh process.
    host = dict(
      **empty_row_params(config),
      token_ids=i32(R, S),
      num_tokens=i32(R),
      num_prompt_tokens=i32(R),
      cache_slot=np.arange(R, dtype=np.int32),
      key_data=np.zeros((R, *KEY_DATA_SHAPE), np.uint32),
      stop_token_ids=i32(R, config.max_num_stop_token_ids, fill=V),
      logit_bias_token_ids=i32(R, config.max_num_logit_bias, fill=V),
      logit_bias=f32(R, config.max_num_logit_bias),
      has_allowed_token_ids=np.zeros((R,), bool),
      allowed_token_mask=np.ones((R, V), bool),
      bad_words_prefix=i32(R, num_bad_words, prefix_len, fill=-1),
      bad_words_last=i32(R, num_bad_words, fill=V),
      output_token_counts=i32(R, V),
      prompt_token_mask=np.zeros((R, V), bool),
      logits_processor_active=np.zeros((R, len(config.logits_processors)), bool),
      has_grammar=np.zeros((R,), bool),
      grammar_bitmask=np.full((R, -(-V // 32)), -1, np.int32),
    )
    return cls(
      **jax.device_put(host),
      logits_processor_states=tuple(checked_init_state(p, R, V) for p in config.logits_processors),
      config=config,
    )


#: A `RowUpdate` field: NumPy values on the host (one row, built by `jaxengine.batch.rows`), traced
#: `jax.Array`s inside `write_row`.
RowArray = Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class RowUpdate(RowFields[RowArray]):
  """One request encoded as a row: every `BatchState` field `write_row` does not derive itself.

  Built on the host from NumPy values of explicit dtypes (so passing one never retraces): the
  `RowFields` (sampling parameters included) hold that field's row (shapes without the leading
  `R`; `RowArray`s: NumPy on the host, traced inside `write_row`). `write_row` derives the rest:
  `key_data` from the three key inputs below, and `output_token_counts` and `prompt_token_mask`
  from `token_ids`.

  Attributes:
    seed_words: `[2] uint32` the request's seed modulo 2**64 as (low, high) words.
    is_seeded: `[] bool` whether the request has a seed.
    serial: `[] uint32` the batch's running request number, which keys unseeded requests.
  """

  seed_words: RowArray
  is_seeded: RowArray
  serial: RowArray


def batch_key_data(seed) -> jax.Array:
  """Raw words of the batch key for an engine `seed` (low word keyed, high word folded in, as a
  request's seed).

  Raises:
    ValueError: for a seed that is not an int in `[-2**63, 2**63)` (bools refused).
  """
  if not is_int(seed) or not SEED_MIN <= seed < SEED_MAX:
    raise ValueError(f"seed must be an int in [-2**63, 2**63), got {seed!r}")
  seed = int(seed) % 2**64
  key = jax.random.key(seed & 0xFFFFFFFF)
  return jax.random.key_data(key if seed >> 32 == 0 else jax.random.fold_in(key, seed >> 32))


def request_key_data(batch_key_data: jax.Array, row: RowUpdate) -> jax.Array:
  """Raw words of a request's base key.

  A seeded request gets `jax.random.key(seed)` (for seeds in `[0, 2**32)`; a seed is taken modulo
  2**64, and a nonzero high word is folded in), so its stream depends on nothing but the seed. An
  unseeded request gets `fold_in(batch_key, serial)`: distinct serials never share a stream.

  Args:
    batch_key_data: raw words of the batch's key.
    row: the request's row.

  Returns:
    `[*KEY_DATA_SHAPE] uint32` raw words of the request's key.
  """
  low, high = row.seed_words[0], row.seed_words[1]
  key = jax.random.key(low)
  plain, folded = jax.random.key_data(key), jax.random.key_data(jax.random.fold_in(key, high))
  seeded = jnp.where(high == 0, plain, folded)
  unseeded = jax.random.key_data(
    jax.random.fold_in(jax.random.wrap_key_data(batch_key_data), row.serial)
  )
  return jnp.where(row.is_seeded, seeded, unseeded)


def _derived_fields(state: BatchState, row: RowUpdate, batch_key_data: jax.Array) -> dict:
  """The row's `key_data`, `output_token_counts` `[V]`, `prompt_token_mask` `[V]` and an
  all-allowed `grammar_bitmask` row.

  Token counts for the penalties are rebuilt from the row's own tokens here, once per admission;
  afterwards the sample step keeps them current.
  """
  V = state.vocab_size
  positions = jnp.arange(state.max_model_len)
  is_prompt = positions < row.num_prompt_tokens
  is_output = (positions >= row.num_prompt_tokens) & (positions < row.num_tokens)
  return dict(
    key_data=request_key_data(batch_key_data, row),
    output_token_counts=jnp.zeros((V,), jnp.int32)
    .at[row.token_ids]
    .add(is_output.astype(jnp.int32)),
    prompt_token_mask=jnp.zeros((V,), bool)
    .at[jnp.where(is_prompt, row.token_ids, V)]
    .set(True, mode="drop"),
    grammar_bitmask=jnp.full(state.grammar_bitmask.shape[1:], -1, jnp.int32),
  )


@functools.partial(jax.jit, donate_argnames=("state",))
def write_row(
  state: BatchState, index: jax.Array, row: RowUpdate, batch_key_data: jax.Array
) -> BatchState:
  """Overwrites every per-row field of row `index` (a `[] int32` array).

  Args:
    state: the batch state (donated: do not read it after the call).
    index: the row to write.
    row: the request's row values.
    batch_key_data: raw words of the batch key that unseeded requests derive theirs from.

  Returns:
    The new state.
  """
  values = {f.name: getattr(row, f.name) for f in dataclasses.fields(RowUpdate)}
  values.update(_derived_fields(state, row, batch_key_data))
  new_fields = {}
  for f in dataclasses.fields(BatchState):
    if f.metadata.get("static"):
      continue
    new_fields[f.name] = jax.tree.map(
      lambda old, new: old.at[index].set(jnp.asarray(new).astype(old.dtype)),
      getattr(state, f.name),
      values[f.name],
    )
  return dataclasses.replace(state, **new_fields)


#: Rows `write_rows` writes in one call (one shape: one executable for any number of admissions).
WRITE_CHUNK = 8


@functools.partial(jax.jit, donate_argnames=("state",))
def write_rows(
  state: BatchState, indices: jax.Array, rows: RowUpdate, batch_key_data: jax.Array
) -> BatchState:
  """`write_row` for `W` rows in one device call: row `indices[w]` gets `rows` at `w`, in order.

  Args:
    state: the batch state (donated: do not read it after the call).
    indices: `[W] int32` rows to write; a repeated `(index, row)` pair writes the same values
      again (the host pads a chunk with copies of its last write).
    rows: `W` requests' `RowUpdate`s stacked on a leading axis.
    batch_key_data: as `write_row`.

  Returns:
    The new state.
  """

  def body(w, state):
    row = jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, w, keepdims=False), rows)
    return write_row(state, indices[w], row, batch_key_data)

  return lax.fori_loop(0, indices.shape[0], body, state)


#: Rows `move_rows` gathers and scatters at a time.
MOVE_CHUNK = 8


def move_plan(moves: list[tuple[int, int]], max_num_reqs: int) -> tuple[np.ndarray, np.ndarray]:
  """`(src, dst)` `[n] int32` for `move_rows` (host NumPy): the `(from_row, to_row)` moves, then
  padding (`dst == R`, dropped) to a multiple of `MOVE_CHUNK` covering `R` (one shape: one
  compile)."""
  size = -(-max_num_reqs // MOVE_CHUNK) * MOVE_CHUNK
  src = np.zeros((size,), np.int32)
  dst = np.full((size,), max_num_reqs, np.int32)
  for i, (a, b) in enumerate(moves):
    src[i], dst[i] = a, b
  return src, dst


@functools.partial(jax.jit, donate_argnames=("state",))
def move_rows(state: BatchState, src: jax.Array, dst: jax.Array) -> BatchState:
  """Copies row `src[i]` to row `dst[i]` for each real move, in chunks of `MOVE_CHUNK` moves.

  Args:
    state: the batch state (donated: do not read it after the call).
    src, dst: `[n] int32` with `n` a multiple of `MOVE_CHUNK`: the moves first, then padding with
      `dst == R` (ignored). Within a chunk all sources are read before any row is written (a swap
      is the chunk `src = [i, j]`, `dst = [j, i]`); across chunks no source may be an earlier
      destination, which condense's moves (highest live rows into lowest holes) satisfy.

  Returns:
    The new state. Only the moved rows are read and written (a gather and a scatter on the
    donated buffers, for as many chunks as there are moves), never the whole state.
  """
  rows = state.max_num_reqs
  num_chunks = ((dst < rows).sum() + MOVE_CHUNK - 1) // MOVE_CHUNK

  def move_chunk(chunk, state):
    start = (chunk * MOVE_CHUNK,)
    chunk_src = lax.dynamic_slice(src, start, (MOVE_CHUNK,))
    chunk_dst = lax.dynamic_slice(dst, start, (MOVE_CHUNK,))
    return jax.tree.map(lambda leaf: leaf.at[chunk_dst].set(leaf[chunk_src], mode="drop"), state)

  return lax.fori_loop(0, num_chunks, move_chunk, state)
