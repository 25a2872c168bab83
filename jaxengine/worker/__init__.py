"""The worker: the model's weights, the KV-cache pages and the jitted steps (vLLM V1's `worker/`).

buckets.py            bucket sizes of every step (rows, tokens)
kv_cache_size.py      the default number of pages (rows, memory limit)
placement.py          placing weights, KV-cache pages and batch state on a mesh
step_inputs.py        a ragged step's positions, slots and attention metadata
ragged_step.py        the model once over a ragged step's tokens, then the sampler
multi_step.py         k ragged decode steps in one device loop (num_decode_steps), rows stopping
                      on the device
verify_step.py        speculative decoding on the device: drafts as query tokens, the verify step
device_steps.py       the steps jitted once per model structure and placement, shared by runners
sleep_mode.py         sleep and wake: freeing the pages, weights to host memory and back
model_runner.py       `ModelRunner`: weights, pages, persistent batch, the jitted steps (one
                      ragged step per call), precompile
"""
