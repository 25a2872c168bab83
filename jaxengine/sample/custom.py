"""Your own logits processors (`LogitsProcessor`) and the structured-output bitmask, on device.

A processor's per-row state is one more field of `BatchState` (`logits_processor_states`, a tuple
with one pytree per processor, every leaf `[R, ...]`), so `write_row`, `move_rows` and
`leading_rows` carry it with its row like any sampling parameter: vLLM's `BatchUpdate`
bookkeeping (`docs/sampling.md` §3.4) comes for free. Which rows a processor acts on is the
`[R, P] bool` field `logits_processor_active`; `SamplingMetadata.any_logits_processor` (`[P]
bool`, traced) lets a step skip a processor no live row uses, so one executable serves every mix.

Placement (vLLM HEAD, `docs/sampling.md` §1.1): the grammar bitmask first; then processors with
`argmax_invariant = False` after the allowed/bad-words/min_tokens masks and logit_bias, before
the penalties; processors with `argmax_invariant = True` on the temperature-scaled logits of
random rows, with min_p (greedy rows never see them).
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax import lax

NEG_INF = float("-inf")


class LogitsProcessor:
  """Base class of a JAX-native logits processor whose row state lives in the batch.

  Subclass it and give `init_state`, `row_state` and `apply` (and `update_state` if the state
  changes as tokens are generated). The batch builds a processor given as a class with no
  arguments; `"module:Class"` strings name such a class.

  Attributes:
    argmax_invariant: False (default): the processor may change which token is most likely; it
      runs with min_tokens and logit_bias, before the penalties, on every row it is active for.
      True: it never changes the argmax (it only reshapes or truncates the distribution); it runs
      after temperature with min_p and is skipped for greedy rows.
  """

  argmax_invariant: ClassVar[bool] = False

  def __eq__(self, other: object) -> bool:
    """Processors of one class with equal attributes are interchangeable: the batch's config
    (static in every jitted step) then compares equal, so engines built with such processors
    share their compiled steps. Attributes that do not compare to one bool (arrays) fall back
    to identity."""
    if type(self) is not type(other):
      return NotImplemented
    try:
      return self is other or bool(vars(self) == vars(other))
    except (TypeError, ValueError):
      return False

  def __hash__(self) -> int:
    return hash(type(self))

  def init_state(self, max_num_reqs: int, vocab_size: int) -> Any:
    """The state of an empty batch: a pytree of arrays, each with leading axis `max_num_reqs`.

    Returns `{}` by default (a processor without state).
    """
    del max_num_reqs, vocab_size
    return {}

  def row_state(self, params: Any, prompt_token_ids: list[int]) -> Any:
    """One request's row of the state (host values), or None when the processor does not act on it.

    Called on the host when a request is added, before anything changes. Leaves are converted to
    the dtype and shape of the state's leaves without the leading axis.

    Args:
      params: the request's `SamplingParams` (read `params.extra_args` for your own options).
      prompt_token_ids: the prompt.

    Raises:
      ValueError: to refuse the request; the batch is left unchanged.
    """
    del params, prompt_token_ids
    return None

  def apply(self, state: Any, active: jax.Array, logits: jax.Array) -> jax.Array:
    """Traced: the processed logits.

    Args:
      state: the processor's state (leaves `[R, ...]`).
      active: `[R] bool` rows the processor acts on (live rows whose request it accepted); leave
        the other rows exactly as they are.
      logits: `[R, V] float32`.

    Returns:
      `[R, V] float32`.
    """
    raise NotImplementedError

  def update_state(self, state: Any, sampled_token_ids: jax.Array, active: jax.Array) -> Any:
    """Traced, after each step: the new state given each row's sampled token `[R] int32`.

    `active` `[R] bool` marks the rows the processor acts on whose token was appended. The
    default keeps the state.
    """
    del sampled_token_ids, active
    return state


def checked_init_state(processor: LogitsProcessor, max_num_reqs: int, vocab_size: int) -> Any:
  """The processor's `init_state` as JAX arrays, after checking by `jax.eval_shape` that its
  leaves have the leading axis `R`, that `apply` returns `[R, V]` floats and that `update_state`
  keeps the state's structure and shapes, so a wrong processor fails when the batch is built,
  naming itself, rather than deep inside the compiled step.

  Raises:
    ValueError: naming the processor and what is wrong.
  """
  name = type(processor).__name__
  state = jax.tree.map(jnp.asarray, processor.init_state(max_num_reqs, vocab_size))
  for leaf in jax.tree.leaves(state):
    if leaf.ndim == 0 or leaf.shape[0] != max_num_reqs:
      raise ValueError(
        f"logits processor {name}: init_state leaves need the leading axis "
        f"max_num_reqs={max_num_reqs}, got a leaf of shape {leaf.shape}"
      )
  rows = lambda dtype: jax.ShapeDtypeStruct((max_num_reqs,), dtype)
  logits = jax.ShapeDtypeStruct((max_num_reqs, vocab_size), jnp.float32)
  try:
    out = jax.eval_shape(processor.apply, state, rows(jnp.bool_), logits)
    new = jax.eval_shape(processor.update_state, state, rows(jnp.int32), rows(jnp.bool_))
  except Exception as error:  # whatever tracing the user's code raises
    raise ValueError(f"logits processor {name}: tracing it failed: {error}") from error
  if not (
    isinstance(out, jax.ShapeDtypeStruct)
    and out.shape == logits.shape
    and jnp.issubdtype(out.dtype, jnp.floating)
  ):
    raise ValueError(
      f"logits processor {name}: apply must return float logits of shape "
      f"{logits.shape} ([max_num_reqs, vocab_size]), got {out}"
    )
  shapes = lambda tree: jax.tree.map(lambda a: a.shape, tree)
  same_structure = str(jax.tree.structure(new)) == str(jax.tree.structure(state))
  if not same_structure or shapes(new) != shapes(state):
    raise ValueError(
      f"logits processor {name}: update_state must return a state of init_state's structure "
      f"and shapes {shapes(state)}, got {shapes(new)}"
    )
  return state


def processor_active(state, md, index: int) -> jax.Array:
  """`[R] bool` live rows processor `index` acts on."""
  return state.logits_processor_active[:, index] & md.is_live


def apply_custom_processors(x: jax.Array, state, md, *, argmax_invariant: bool) -> jax.Array:
  """Applies the configured processors of one placement group, in order, each only when some live
  row uses it (a traced `lax.cond`).

  Args:
    x: `[R, V] float32` logits (temperature-scaled for the argmax-invariant group).
    state, md: the batch state and metadata.
    argmax_invariant: which group; the invariant group acts on random rows only.

  Returns:
    `[R, V] float32`.
  """
  processors = state.config.logits_processors
  for index, processor in enumerate(processors):
    if bool(processor.argmax_invariant) != argmax_invariant:
      continue
    active = processor_active(state, md, index)
    if argmax_invariant:
      active = active & ~md.is_greedy
    row_state = state.logits_processor_states[index]
    x = lax.cond(
      md.any_logits_processor[index],
      lambda x, s=row_state, a=active, p=processor: p.apply(s, a, x).astype(jnp.float32),
      lambda x: x,
      x,
    )
  return x


def has_processors(config, *, argmax_invariant: bool) -> bool:
  """Whether the (static) configuration has a processor of the given placement group."""
  return any(bool(p.argmax_invariant) == argmax_invariant for p in config.logits_processors)


def any_custom(md, config, *, argmax_invariant: bool) -> jax.Array:
  """`[] bool` whether some live row uses a processor of the group."""
  flags = [
    md.any_logits_processor[i]
    for i, p in enumerate(config.logits_processors)
    if bool(p.argmax_invariant) == argmax_invariant
  ]
  return jnp.any(jnp.stack(flags)) if flags else jnp.zeros((), bool)


def apply_invariant_processors(x: jax.Array, state, md, inv_temperature: jax.Array) -> jax.Array:
  """The argmax-invariant processors on the temperature-scaled logits `y = x / T` of random rows.

  The sampler works on unscaled logits and scales inside each stage, so the result is scaled back
  (`y' * T`); rows no invariant processor acts on keep `x` bit for bit.

  Args:
    x: `[R, V] float32` processed logits.
    state, md: the batch state and metadata.
    inv_temperature: `[R] float32` 1 / T.

  Returns:
    `[R, V] float32`.
  """
  y = apply_custom_processors(x * inv_temperature[:, None], state, md, argmax_invariant=True)
  touched = jnp.zeros_like(md.is_live)
  for index, processor in enumerate(state.config.logits_processors):
    if processor.argmax_invariant:
      touched = touched | processor_active(state, md, index)
  touched = touched & ~md.is_greedy
  return jnp.where(touched[:, None], y / inv_temperature[:, None], x)


def update_processor_states(state, md, tokens: jax.Array, appended: jax.Array) -> tuple:
  """Each processor's `update_state` after a step: the new `logits_processor_states` tuple."""
  new_states = []
  for index, processor in enumerate(state.config.logits_processors):
    active = processor_active(state, md, index) & appended
    new = processor.update_state(state.logits_processor_states[index], tokens, active)
    old = state.logits_processor_states[index]
    new_states.append(jax.tree.map(lambda n, o: jnp.asarray(n).astype(o.dtype), new, old))
  return tuple(new_states)


def apply_grammar_bitmask(x: jax.Array, state, is_live: jax.Array) -> jax.Array:
  """Masks the tokens a row's grammar forbids: `-inf` where the row's bit is 0.

  Args:
    x: `[R, V]` logits.
    state: the batch state (`grammar_bitmask [R, ceil(V / 32)] int32`, token `t` allowed when
      bit `t % 32` of word `t // 32` is set; `has_grammar [R] bool`).

  Returns:
    `[R, V]` logits of the same dtype; rows without a grammar unchanged.
  """
  rows, vocab = x.shape
  shifts = jnp.arange(32, dtype=jnp.int32)[None, None, :]
  bits = lax.shift_right_logical(state.grammar_bitmask[:, :, None], shifts) & 1  # [R, W, 32]
  allowed = bits.reshape(rows, -1)[:, :vocab]
  forbidden = (state.has_grammar & is_live)[:, None] & (allowed == 0)
  return jnp.where(forbidden, jnp.asarray(NEG_INF, x.dtype), x)
