"""The batch under a `jax.sharding.Mesh` (design.md §6), on 8 host CPU devices.

Runs in a subprocess because the device count must be set before JAX starts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jaxengine as je

    R, V = 16, 512
    batch = je.InputBatch(R, 32, V)
    for i in range(R):
      batch.add_request(f"r{i}", [1, 2], je.SamplingParams(
          temperature=0.8, top_k=20, top_p=0.9, seed=i, logprobs=2, presence_penalty=0.5))
    logits = np.random.default_rng(0).normal(size=(R, V)).astype(np.float32)
    state, metadata = batch.state, batch.sampling_metadata
    copy = lambda tree: jax.tree.map(jnp.copy, tree)
    _, want = je.sample_step(copy(state), metadata, logits)

    mesh = Mesh(np.array(jax.devices()), ("data",))
    def by_row(x):  # the request axis across data-parallel devices; scalars replicated
      spec = P("data") if x.ndim and x.shape[0] == R else P()
      return jax.device_put(x, NamedSharding(mesh, spec))
    for spec in (P("data", None), P(None, "data")):  # rows sharded, or the vocabulary sharded
      new_state, got = je.sample_step(jax.tree.map(by_row, copy(state)),
                                      jax.tree.map(by_row, metadata),
                                      jax.device_put(logits, NamedSharding(mesh, spec)))
      assert np.array_equal(got.sampled_token_ids, want.sampled_token_ids), spec
      np.testing.assert_allclose(got.logprobs.logprobs, want.logprobs.logprobs, rtol=1e-6)
      assert len(new_state.token_ids.sharding.device_set) == 8
    print("ok")
""")


def test_sample_step_under_a_mesh_matches_one_device():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  result = subprocess.run(
    [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.strip().endswith("ok")
