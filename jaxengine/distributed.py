"""vLLM's module path `vllm.distributed`, for scripts that free an engine before building
another: `cleanup_dist_env_and_memory`."""

from __future__ import annotations

import gc


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
  """Frees what engines no longer referenced hold (vLLM's name; call it after ``del llm``).

  There is no process group to tear down here (one process drives every device through JAX's
  mesh) nor a CUDA allocator cache to empty: an engine's device buffers are freed when the last
  reference to them goes, which this makes happen now by running Python's garbage collector
  (an engine's objects can form reference cycles). Compiled executables stay cached, so a
  later engine of the same shapes does not compile again. `shutdown_ray` is vLLM's, ignored
  (no Ray here).
  """
  del shutdown_ray
  gc.collect()
