"""The paged engine's k-step decode: up to `k` ragged decode steps in one device loop.

When a step of the paged engine only decodes (every scheduled row computes exactly its last
sampled token; nothing is admitted or prefilling; no structured-output row runs), the scheduler
reserves pages ahead for up to `k` tokens per row (`Scheduler.schedule_decode_steps`) and
`decode_steps` runs `k` decode-and-sample iterations in one `lax.while_loop`, paying the
host round trip once per `k` tokens (on accelerators a decode step of a small model takes about
as long as the host needs to launch it and read its tokens back).

Each iteration is a ragged step of one query token per row: row `r`'s token is its last one, at
position `p = num_tokens[r] - 1`; its key and value go to slot `block_tables[r, p // B] * B + p % B`
(computed on the device from the block table, which the host filled for every position the row may
reach), it attends to its `p + 1` context tokens, and the sampler appends the next token, so a row's
tokens, logprobs and random streams are those of `k` single steps. A row stops on the device after
the token that ends it by the rules the device can see (`device_stop_rules`: `max_tokens`,
`max_model_len`, EOS unless `ignore_eos` and `stop_token_ids`, the last two never before
`min_tokens`) or when it has used its `max_num_steps` (the tokens its pages hold; 0 for a row not
scheduled this step); a stopped row writes nothing more (its slot is `NULL_SLOT`) and appends
nothing. The loop ends after `k` iterations, when no row runs, or (with `end_on_first_finish`, set
while requests wait) after the iteration in which a row stopped by a stop rule (not by its step
limit), so its row and pages are handed on at once. Stop strings need the text: the host checks them
afterwards and discards what follows a match.

After the loop, row `r` has sampled `num_sampled[r]` tokens and computed the keys and values of
as many positions (`p .. p + num_sampled - 1`; the last sampled token's are computed by the next
step), so the scheduler's `num_computed_tokens` advance by `num_sampled`.

Shape legend: `R` rows (a row bucket above the batch's live rows; also the query tokens of an
iteration), `P` pages per row (`max_num_blocks_per_req`), `k` steps, `C` stop ids per row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxengine.batch import InputBatch
from jaxengine.batch.block_table import BlockTable
from jaxengine.batch.step_loop import MultiStepOutput
from jaxengine.core.request import Completion
from jaxengine.lora import LoRAManager
from jaxengine.models.lora import LoRAInputs
from jaxengine.models.paged_attention import NULL_SLOT, PagedAttentionMetadata
from jaxengine.params import SamplingParams
from jaxengine.sample import LogprobsTensors, sample
from jaxengine.worker.routed_experts import RoutedExperts


def device_stop_rules(
  params: SamplingParams, eos_token_ids: Sequence[int], max_model_len: int
) -> tuple[int, tuple[int, ...]]:
  """A completion's stop rules the device loop checks: `(max_output_tokens, stop ids)`.

  Args:
    params: the completion's sampling parameters.
    eos_token_ids: the engine's EOS ids (all of them end generation unless `ignore_eos`).
    max_model_len: the engine's limit (a row also stops when its sequence reaches it).

  Returns:
    The most output tokens the completion may have, and the ids that end it once it has
    `min_tokens` tokens.
  """
  eos = () if params.ignore_eos else tuple(eos_token_ids)
  stop_ids = tuple(dict.fromkeys((*eos, *(params.stop_token_ids or ()))))
  return params.max_tokens or max_model_len, stop_ids


def stop_rule_arrays(
  rules: Sequence[tuple[int, tuple[int, ...]]], num_rows: int, max_num_stop_ids: int
) -> tuple[np.ndarray, np.ndarray]:
  """Rows of `device_stop_rules` as the loop's arrays, padded to `num_rows` rows.

  Returns:
    `max_output_tokens [num_rows] int32` and `stop_ids [num_rows, max_num_stop_ids] int32`
    (padded with -1, which no token equals).
  """
  max_output_tokens = np.zeros((num_rows,), np.int32)
  stop_ids = np.full((num_rows, max_num_stop_ids), -1, np.int32)
  for row, (limit, ids) in enumerate(rules):
    max_output_tokens[row] = limit
    stop_ids[row, : len(ids)] = ids
  return max_output_tokens, stop_ids


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeStepsInputs:
  """A k-step paged decode's device inputs.

  Attributes:
    block_tables: `[R, P] int32` each row's pages, holding every position it may reach in the
      loop (0, the null page, past them and for padding rows); `[G, R, P]` with KV cache groups.
    num_reqs: `[] int32` live rows (rows `num_reqs:` of the bucket are padding).
    max_num_steps: `[R] int32` the most tokens each row may sample in the loop (the positions its
      pages hold from its last token on; 0 for rows not scheduled and padding rows).
    max_output_tokens: `[R] int32` output tokens after which a row stops (`max_tokens`).
    stop_ids: `[R, C] int32` ids that stop a row once it has `min_tokens` outputs (-1 pads).
    end_on_first_finish: `[] bool` end the loop after the iteration in which some row stopped by
      a stop rule (requests are waiting for a row or for pages).
    lora: None (an engine without `enable_lora`), or the LoRA adapters' device slots with each
      row's slot (`[R] int32`, 0: the base): every iteration's query token of row `r` is flat
      token `r`, so the row slots are the token slots.
    state_slots: None (a model without recurrent state), or `[R] int32` each row's recurrent
      state slot (`jaxengine.worker.recurrent_state`; 0, the null slot, for rows not scheduled
      and padding rows); an iteration gives a row that no longer runs the null slot, so its
      state stays where its last sampled token left it.
  """

  block_tables: jax.Array
  num_reqs: jax.Array
  max_num_steps: jax.Array
  max_output_tokens: jax.Array
  stop_ids: jax.Array
  end_on_first_finish: jax.Array
  lora: LoRAInputs | None = None
  state_slots: jax.Array | None = None


class DeviceStopRules:
  """How a runner lays out its rows' `device_stop_rules`: the engine's EOS ids, limit and stop-id
  columns. The rules themselves are read from each completion's `SamplingParams` when a loop is
  laid out (the request is their one record).

  Args:
    input_batch: the batch (its EOS ids and `max_num_stop_token_ids` size the stop-id columns).
    max_model_len: the engine's limit on a sequence's tokens.
  """

  def __init__(self, input_batch: InputBatch, max_model_len: int) -> None:
    self.eos_token_ids = tuple(input_batch.eos_token_ids)
    self.max_model_len = max_model_len
    #: `C`, the stop-id columns: the most stop ids a request may name, and the EOS ids.
    self.max_num_stop_ids = input_batch.config.max_num_stop_token_ids + len(self.eos_token_ids)

  def rows(self, params: Sequence[SamplingParams]) -> list[tuple[int, tuple[int, ...]]]:
    """The rules of completions with these `params`, in order."""
    return [device_stop_rules(p, self.eos_token_ids, self.max_model_len) for p in params]


def decode_steps_inputs(
  batch: InputBatch,
  block_table: BlockTable,
  num_decode_steps: Mapping[str, int],
  num_rows: int,
  stop_rules: DeviceStopRules,
  running: Mapping[str, Completion],
  end_on_first_finish: bool,
  lora: LoRAManager | None = None,
  sharding: jax.sharding.Sharding | None = None,
  state_slots: Mapping[str, int] | None = None,
) -> DecodeStepsInputs:
  """A k-step loop's `DecodeStepsInputs` from the host, put on the device in one transfer.

  Args:
    batch: the persistent batch (condensed): its live rows run.
    block_table: their pages (the row bucket's rows go to the device).
    num_decode_steps: the most tokens each scheduled row may sample (`SchedulerOutput`).
    num_rows: `R`, the row bucket.
    stop_rules: the runner's `DeviceStopRules`.
    running: each live row's completion by `seq_id` (its `params`: the stop rules' one record).
    end_on_first_finish: end the loop once some row stops by a stop rule.
    lora: the runner's adapters (each row's slot an input), None without LoRA.
    sharding: where the inputs go, None: the default device.
    state_slots: None (a model without recurrent state), or the recurrent state slot of each
      scheduled row's completion by `seq_id` (`SchedulerOutput.state_slots`).
  """
  req_ids = batch.req_ids
  max_num_steps = np.zeros(num_rows, np.int32)
  for seq_id, steps in num_decode_steps.items():
    max_num_steps[batch.req_id_to_index[seq_id]] = steps
  grouped = block_table.num_groups > 1
  tables = (
    block_table.group_block_ids[:, :num_rows] if grouped else block_table.block_ids[:num_rows]
  )
  rules = stop_rules.rows([running[seq_id].params for seq_id in req_ids])
  max_output_tokens, stop_ids = stop_rule_arrays(rules, num_rows, stop_rules.max_num_stop_ids)
  host: tuple[Any, ...] = (
    tables,
    np.int32(batch.num_reqs),
    max_num_steps,
    max_output_tokens,
    stop_ids,
    np.bool_(end_on_first_finish),
  )
  if lora is not None:  # row r's token is flat token r: one slot per row
    host += (lora.token_slots(req_ids, 1, num_rows),)
  if state_slots is not None:
    row_slots = np.zeros(num_rows, np.int32)
    for seq_id in num_decode_steps:
      row_slots[batch.req_id_to_index[seq_id]] = state_slots[seq_id]
    host += (row_slots,)
  device = jax.device_put(host, sharding)  # one transfer for the loop's inputs
  return DecodeStepsInputs(
    block_tables=device[0],
    num_reqs=device[1],
    max_num_steps=device[2],
    max_output_tokens=device[3],
    stop_ids=device[4],
    end_on_first_finish=device[5],
    lora=None if lora is None else lora.inputs(device[6]),
    state_slots=None if state_slots is None else device[-1],
  )


def _decode_metadata(
  inputs: DecodeStepsInputs, positions: jax.Array, running: jax.Array, block_size: int
) -> PagedAttentionMetadata:
  """One iteration's attention metadata: one query token per row, row `r`'s at flat index `r`.

  Args:
    inputs: the loop's inputs.
    positions: `[R] int32` each row's query position (its last token's).
    running: `[R] bool` rows that compute this iteration (the others write to `NULL_SLOT`).
    block_size: `B`.
  """
  num_rows = positions.shape[0]
  rows = jnp.arange(num_rows, dtype=jnp.int32)
  page = inputs.block_tables[..., rows, positions // block_size]  # [R] or [G, R] (groups)
  slots = jnp.where(running, page * block_size + positions % block_size, NULL_SLOT)
  return PagedAttentionMetadata(
    slot_mapping=slots.astype(jnp.int32),
    block_tables=inputs.block_tables,
    query_start_loc=jnp.minimum(jnp.arange(num_rows + 1, dtype=jnp.int32), inputs.num_reqs),
    seq_lens=jnp.where(rows < inputs.num_reqs, positions + 1, 0).astype(jnp.int32),
    num_reqs=inputs.num_reqs,
    state_slots=(None if inputs.state_slots is None else jnp.where(running, inputs.state_slots, 0)),
  )


def decode_steps(
  graphdef,
  state,
  metadata,
  weights,
  kv_cache,
  inputs: DecodeStepsInputs,
  num_rows,
  num_steps,
  mesh=None,
):
  """Up to `num_steps` ragged decode-and-sample steps over the first `num_rows` rows.

  Args:
    graphdef: the model's graph definition (bound by the runner).
    state: the batch's `BatchState` (donated).
    metadata: its `SamplingMetadata`.
    weights: the model's weights.
    kv_cache: the `PagedKVCache` (donated).
    inputs: the loop's `DecodeStepsInputs`.
    num_rows: `R` (static), a row bucket holding every live row (the batch is condensed).
    num_steps: `k` (static).
    mesh: None, or the engine's mesh (static): each iteration samples the vocabulary-sharded
      logits, as the ragged step does.

  Returns:
    `(state, MultiStepOutput, (kv_cache, routed))`: `sampled_token_ids [k, R]`, logprobs `[k,
    R, c]`, `num_sampled [R]` the tokens each row appended; `routed` the `RoutedExperts` of
    every iteration's tokens (`[k, R, M, k]`, slots `[k, R]`, `NULL_SLOT` where a row did not
    compute) with a model whose ``return_routed_experts`` is set, else None.
  """
  model = nnx.merge(graphdef, weights)
  routing = bool(getattr(model, "return_routed_experts", False))  # static: the graphdef's
  rows_state = state.leading_rows(num_rows)
  rows_metadata = metadata.leading_rows(num_rows)
  block_size = kv_cache.block_size
  max_model_len = state.max_model_len
  num_columns = state.num_top_logprobs + 1
  carry = dict(
    step=jnp.int32(0),
    state=rows_state,
    kv_cache=kv_cache,
    running=rows_metadata.is_live & (inputs.max_num_steps > 0),
    any_finished=jnp.bool_(False),
    tokens=jnp.zeros((num_steps, num_rows), jnp.int32),
    logprobs=LogprobsTensors(
      token_ids=jnp.zeros((num_steps, num_rows, num_columns), jnp.int32),
      logprobs=jnp.zeros((num_steps, num_rows, num_columns), jnp.float32),
      ranks=jnp.zeros((num_steps, num_rows), jnp.int32),
    ),
    num_sampled=jnp.zeros((num_rows,), jnp.int32),
  )
  if routing:
    num_moe_layers, top_k = model.num_moe_layers, model.config.num_experts_per_tok
    carry["routed"] = RoutedExperts(
      experts=jnp.zeros((num_steps, num_rows, num_moe_layers, top_k), jnp.int32),
      slots=jnp.full((num_steps, num_rows), NULL_SLOT, jnp.int32),
    )

  def go_on(c):
    ended = inputs.end_on_first_finish & c["any_finished"]
    return (c["step"] < num_steps) & c["running"].any() & ~ended

  def one_step(c):
    rows, running = c["state"], c["running"]
    positions = jnp.maximum(rows.num_tokens - 1, 0)  # [R] the last token's
    token_ids = rows.token_ids[jnp.arange(num_rows), positions]  # [R]
    attention = _decode_metadata(inputs, positions, running, block_size)
    lora = {} if inputs.lora is None else {"lora": inputs.lora}
    hidden, kv, *routed = model(token_ids[None], positions[None], c["kv_cache"], attention, **lora)
    logits = model.compute_logits(hidden[0])  # [R, V]: row r's token is flat token r
    step_metadata = dataclasses.replace(rows_metadata, is_live=running)
    rows, output = sample(rows, step_metadata, logits, mesh=mesh)
    tokens, appended = output.sampled_token_ids, output.is_appended
    num_sampled = c["num_sampled"] + appended.astype(jnp.int32)
    num_output = rows.num_output_tokens
    is_stop_id = (inputs.stop_ids == tokens[:, None]).any(-1) & (num_output >= rows.min_tokens)
    stopped = (
      (num_output >= inputs.max_output_tokens) | (rows.num_tokens >= max_model_len) | is_stop_id
    )
    finished = running & (~appended | stopped)
    out_of_pages = num_sampled >= inputs.max_num_steps
    step = c["step"]
    more = {}
    if routed:  # [1, R, M, k]: row r's token is flat token r
      more["routed"] = RoutedExperts(
        experts=c["routed"].experts.at[step].set(routed[0][0]),
        slots=c["routed"].slots.at[step].set(attention.slot_mapping),
      )
    return dict(
      **more,
      step=step + 1,
      state=rows,
      kv_cache=kv,
      running=running & ~finished & ~out_of_pages,
      any_finished=c["any_finished"] | finished.any(),
      tokens=c["tokens"].at[step].set(tokens),
      logprobs=jax.tree.map(lambda a, b: a.at[step].set(b), c["logprobs"], output.logprobs),
      num_sampled=num_sampled,
    )

  c = lax.while_loop(go_on, one_step, carry)
  output = MultiStepOutput(
    sampled_token_ids=c["tokens"], logprobs=c["logprobs"], num_sampled=c["num_sampled"]
  )
  return state.with_leading_rows(c["state"]), output, (c["kv_cache"], c.get("routed"))
