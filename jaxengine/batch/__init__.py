"""The host side of the persistent batch: `InputBatch` and the encoding of a request as a row.

composition.py         BatchComposition: rows, ids, cache slots, composition changes, and the
                       tokens of dispatched steps landing in their requests' outputs
ledger.py              RequestLedger: what a row reads of its request (its tokens, those in
                       flight; an engine's Completion), BatchLedger: the batch's own
input_batch.py         InputBatch (a BatchComposition): built from keywords; `sample`,
                       `run_step`, `dispatch_step` (the one way a step replaces the device state)
rows.py                validating one request and encoding it as a `RowUpdate`
logits_processors.py   building the batch's LogitsProcessors, encoding a request's processor rows
logits_input.py        the logits check, padding `N` rows to `R`, the sampler alone as a step
host_output.py         HostSamplerOutput, LogprobsArrays, FetchedStep: NumPy results over live rows
step_queue.py          StepQueue: the steps dispatched and not read yet, oldest first
step_loop.py           run_steps: the host side of a k-step device loop (up to k tokens per row)
draft_verification.py  InputBatch.rejection_sample's input checks, run_rejection,
                       HostRejectionOutput
block_table.py         BlockTable: each row's pages of a paged KV cache, moving with its row
"""

from jaxengine.batch.draft_verification import HostRejectionOutput
from jaxengine.batch.host_output import HostSamplerOutput, LogprobsArrays
from jaxengine.batch.input_batch import InputBatch

__all__ = ["HostRejectionOutput", "HostSamplerOutput", "InputBatch", "LogprobsArrays"]
