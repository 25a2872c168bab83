"""The worker: the model's weights, the KV-cache pages and the jitted steps (vLLM V1's `worker/`).

buckets.py            bucket sizes of every step (rows, tokens)
kv_cache_size.py      the default number of pages (rows, memory limit)
kv_cache_pool.py      the pool of pages: its attention backend, size and arrays
recurrent_state.py    a hybrid model's recurrent state pool beside the pages; what it refuses
routed_experts.py     a MoE model's routed experts kept per KV-cache slot on the host
weight_loader.py      the served module (batch-invariant, quantized) and load_weights
lora_loader.py        the LoRA adapters' manager built for a model
prompt_logprobs.py    prompt logprobs gathered chunk by chunk until a prompt's last prediction
placement.py          placing weights, KV-cache pages and batch state on a mesh
step_inputs.py        a ragged step's positions, slots and attention metadata
ragged_step.py        the model once over a ragged step's tokens, then the sampler
multi_step.py         k ragged decode steps in one device loop (num_decode_steps), rows stopping
                      on the device
verify_step.py        speculative decoding on the device: drafts as query tokens, the verify step
device_steps.py       the steps jitted once per model structure and placement, shared by runners
compile_beside.py     a new row bucket's sampler compiled on a thread beside its step's model part
sleep_mode.py         sleep and wake: freeing the pages, weights to host memory and back
outputs.py            `StepOutput` (a step on the host), `InFlightStep` (dispatched, not read)
model_runner.py       `ModelRunner`: the model, pages and jitted steps; a `SchedulerOutput` in,
                      a `StepOutput` out
precompile.py         every executable a runner's steps can reach, compiled before serving
"""
