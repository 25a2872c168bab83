"""Two processes on this machine form one mesh through `jax.distributed` (CPU collectives over
gloo) and generate what one device generates.

Each process has 2 host CPU devices; together they make a ``model=4`` mesh (the model axis across
both processes; the tiny model's 2 key/value heads leave the pages replicated). Both processes
submit the same requests, as multi-controller JAX requires; both must print the same tokens, and
both check them against one device of their own (no mesh).
"""

from __future__ import annotations

import ast
import socket
import subprocess
import sys

from subprocess_utils import child_env

WORKER = """
import os, sys
process_id, port = int(sys.argv[1]), sys.argv[2]
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)
import jaxengine as je
from jaxengine.testing import tiny_llama
from step_shapes import one_shape

assert jax.device_count() == 4 and jax.local_device_count() == 2
model, _ = tiny_llama(vocab_size=256)
prompts = [[5, 6, 7], [8, 9]]
params = [je.SamplingParams(temperature=0, max_tokens=4),
          je.SamplingParams(temperature=1.0, top_k=20, seed=3, max_tokens=4)]
def tokens(llm):  # the steps in their largest shape only: half the compiles
  return [o.outputs[0].token_ids for o in one_shape(llm).generate(prompts, params, use_tqdm=False)]
mesh = tokens(je.LLM(model, max_num_reqs=2, max_model_len=16, tensor_parallel_size=4))
print("MESH", mesh, flush=True)
# The reference, in both processes (so both reach the shutdown barrier alike): one device (the
# process's first), no mesh.
print("ONE", tokens(je.LLM(model, max_num_reqs=2, max_model_len=16)), flush=True)
"""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_two_processes_form_one_mesh_and_generate_one_devices_tokens():
  env = child_env()
  port = str(_free_port())
  workers = [
    subprocess.Popen(
      [sys.executable, "-c", WORKER, str(i), port],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
      env=env,
    )
    for i in range(2)
  ]
  results = []
  try:
    for worker in workers:
      out, err = worker.communicate(timeout=400)
      assert worker.returncode == 0, err[-3000:]
      lines = dict(line.split(" ", 1) for line in out.splitlines() if line[:4] in ("MESH", "ONE "))
      results.append({k: ast.literal_eval(v) for k, v in lines.items()})
  finally:
    for worker in workers:
      if worker.poll() is None:
        worker.kill()
  assert results[0]["MESH"] == results[1]["MESH"] == results[0]["ONE"] == results[1]["ONE"], results
  assert len(results[0]["MESH"]) == 2 and all(len(t) == 4 for t in results[0]["MESH"])
