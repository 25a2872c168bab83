"""The host side of the persistent batch: `InputBatch` and the encoding of a request as a row.

input_batch.py   InputBatch: rows, ids, cache slots, composition changes, sampling on the host
rows.py          validating one request and encoding it as a `RowUpdate`
host_output.py   HostSamplerOutput, LogprobsArrays: NumPy results over the live rows
multi_step.py    run_steps: host bookkeeping of a k-step device loop (up to k tokens per row)
speculative.py   InputBatch.rejection_sample's input checks and HostRejectionOutput
jitted.py        the sampler as a step, the logits check, row padding, move plans
"""

from jaxengine.batch.host_output import HostSamplerOutput, LogprobsArrays
from jaxengine.batch.input_batch import InputBatch
from jaxengine.batch.speculative import HostRejectionOutput

__all__ = ["HostRejectionOutput", "HostSamplerOutput", "InputBatch", "LogprobsArrays"]
