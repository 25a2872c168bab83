"""The device core of jaxengine: the batch state and the sampler, model-agnostic.

Modules, in dependency order (each imports only modules listed above it; tests/project/test_layout.py
checks this index against the imports):
  row_params.py   RowParams: the one table of per-row sampling parameters (dtype, off value,
                  which rows use it, encoding from SamplingParams)
  custom.py       LogitsProcessor (your own, row state in the batch), the grammar bitmask
  state.py        BatchState (per-row arrays, static BatchConfig), RowUpdate, write_row(s), move_rows
  metadata.py     SamplingMetadata and refresh_metadata (per composition: flags, effective values)
  sharded.py      vocabulary-sharded top-k / argmax / scatters / draw under shard_map (mesh=)
  processors.py   stages 1-6: float32, allowed ids, bad words, min_tokens, logit_bias, penalties
  blocked.py      blocked_argmax, blocked_top_k: two-stage reductions over vocabulary blocks
  thresholds.py   exact bisection thresholds: kth_largest, top_p_threshold
  filters.py      stages 9-11: min-p / top-k / top-p cuts from candidates (Candidates, Cut)
  draw.py         stage 12: inverse-CDF draws from candidates or the vocabulary, top-p rejection
  budgets.py      which candidate list each row reads: the shallow list, or a deep one by lax.switch
  logprobs.py     stage 13: LogprobsTensors, gather_logprobs
  step.py         the pipeline: sample (unjitted), sample_step (jitted), SamplerOutput
  spec_history.py the draft-position view of the batch (one virtual row per row and position)
  spec_probs.py   drafts with probabilities: target distributions, acceptance, residual draws
  rejection.py    speculative decoding: rejection_sample(_step), RejectionOutput

Nothing here imports the host batch (`jaxengine.batch`), the engine or the models.
"""

from jaxengine.sample.custom import LogitsProcessor
from jaxengine.sample.logprobs import LogprobsTensors, gather_logprobs
from jaxengine.sample.metadata import SamplingMetadata, refresh_metadata
from jaxengine.sample.rejection import RejectionOutput, rejection_sample, rejection_sample_step
from jaxengine.sample.state import (
  MOVE_CHUNK,
  WRITE_CHUNK,
  BatchState,
  RowUpdate,
  batch_key_data,
  move_plan,
  move_rows,
  write_row,
  write_rows,
)
from jaxengine.sample.step import SamplerOutput, sample, sample_step

__all__ = [
  "MOVE_CHUNK",
  "WRITE_CHUNK",
  "BatchState",
  "LogitsProcessor",
  "LogprobsTensors",
  "RejectionOutput",
  "RowUpdate",
  "SamplerOutput",
  "SamplingMetadata",
  "batch_key_data",
  "gather_logprobs",
  "move_plan",
  "move_rows",
  "refresh_metadata",
  "rejection_sample",
  "rejection_sample_step",
  "sample",
  "sample_step",
  "write_row",
  "write_rows",
]
