"""The vocabulary-sharded sampler (`jaxengine.sample.sharded`, `sample(..., mesh=)`) against the
one-device sampler, on 4 host CPU devices in a subprocess (the device count must be set before JAX
starts). The engine under t = 2 and t = 4 x d = 2 (the same tokens as one device, nothing compiled
after warm-up) is tests/parallel/test_mesh.py's, which now runs this sampler.
"""

from __future__ import annotations

import os
import textwrap

from subprocess_utils import run_python

# Random batches using every feature on a 2 x 2 (data, model) mesh, rows and vocabulary both
# split: greedy, seeded random, top-k (shallow, both deep lists, beyond them: bisection), top-p,
# min-p, penalties, logit_bias, allowed ids, bad words, min_tokens, processed logprobs with all-V
# requests (logprobs=-1) and ranks, a tie at the top. Same tokens, ranks and (where finite) ids
# as one device; logprobs equal up to the rounding of their normaliser; no compile after warm-up.
SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jaxengine as je
    from jaxengine import parallel
    from jaxengine.sample import sample
    from jaxengine.testing import count_compiles

    R, V, MML = 8, 512, 32
    def params(rng):
      kw = {"temperature": float(rng.choice([0.0, 0.5, 1.0, 1.7]))}
      if rng.random() < 0.7: kw["seed"] = int(rng.integers(0, 2**31 - 1))
      if rng.random() < 0.5: kw["top_k"] = int(rng.choice([1, 2, 5, 10, 40, 300]))
      if rng.random() < 0.4: kw["top_p"] = float(rng.uniform(0.05, 1.0))
      if rng.random() < 0.3: kw["min_p"] = float(rng.uniform(0.0, 0.3))
      if rng.random() < 0.3:
        kw.update(presence_penalty=float(rng.uniform(-1, 1)),
                  frequency_penalty=float(rng.uniform(-1, 1)),
                  repetition_penalty=float(rng.uniform(0.5, 2)))
      if rng.random() < 0.3:
        kw["logit_bias"] = {int(t): float(rng.uniform(-3, 3)) for t in rng.integers(0, V, 5)}
      if rng.random() < 0.2:
        kw["allowed_token_ids"] = sorted(set(rng.integers(0, V, 200).tolist()))
      if rng.random() < 0.3:
        kw["bad_words_token_ids"] = [rng.integers(0, V, int(rng.integers(1, 3))).tolist()
                                     for _ in range(3)]
      if rng.random() < 0.3:
        kw.update(min_tokens=4, stop_token_ids=rng.integers(0, V, 3).tolist())
      if rng.random() < 0.6: kw["logprobs"] = int(rng.choice([0, 3, -1]))
      return je.SamplingParams(**kw)

    mesh = parallel.make_mesh(2, 2)
    rows_spec = lambda x: P("data") if x.ndim and x.shape[0] == R else P()
    by_row = lambda tree: jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(mesh, rows_spec(x))), tree)
    sharded = jax.jit(lambda s, m, x: sample(s, m, x, mesh=mesh))
    one = jax.jit(sample)
    rng = np.random.default_rng(0)
    for b in range(2):
      batch = je.InputBatch(R, MML, V, -1, "processed_logprobs", seed=b,
                            num_topk_candidates=3, deep_candidate_budgets=(7, 13))
      for i in range(R):
        batch.add_request(f"r{i}", rng.integers(0, V, 3).tolist(), params(rng),
                          output_token_ids=rng.integers(0, V, int(rng.integers(0, 3))).tolist())
      s1, md = batch.state, batch.sampling_metadata
      s2, md2 = by_row(jax.tree.map(jnp.copy, s1)), by_row(md)
      with count_compiles() as compiles:
        for step in range(3):
          logits = rng.normal(0, 2, size=(R, V)).astype(np.float32)
          if step == 1:
            logits[0, :7] = logits[0].max() + 1  # a tie at the top
          s1, want = one(s1, md, logits)
          x = jax.device_put(logits, NamedSharding(mesh, P("data", "model")))
          s2, got = sharded(s2, md2, x)
          assert np.array_equal(got.sampled_token_ids, want.sampled_token_ids), (b, step)
          lw, lg = want.logprobs, got.logprobs
          assert np.array_equal(lg.ranks, lw.ranks), (b, step)
          finite = np.isfinite(np.asarray(lw.logprobs))  # ids among -inf ties may differ
          assert np.array_equal(np.where(finite, lg.token_ids, 0), np.where(finite, lw.token_ids, 0))
          np.testing.assert_allclose(lg.logprobs, lw.logprobs, rtol=1e-5, atol=2e-5)
          assert np.array_equal(s1.token_ids, s2.token_ids)
          assert np.array_equal(s1.output_token_counts, s2.output_token_counts)
      if b > 0:  # the second batch (a new mix of every feature) compiles nothing
        assert compiles.count == 0, compiles.count
    print("ok")
""")


def test_vocabulary_sharded_sampler_matches_one_device():
  assert run_python(SCRIPT).strip().endswith("ok")


# SmolLM2 (9 query heads, 3 kv heads, vocabulary 49152 = 3 x 64 blocks of 256) under t = 3 on 3
# devices, the default model as a user would load it: each row gives the fixture's greedy tokens
# (an independent PyTorch implementation's). The steps run in one shape (`one_shape`: one compile
# of the 30-layer step instead of a prefill's and a decode's). Seeded rows against one device are
# the sampler test's above.
SMOLLM2_SCRIPT = textwrap.dedent("""
    import os, json, sys
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=3"
    import jaxengine as je
    from step_shapes import one_shape
    fixture = json.load(open(sys.argv[1]))
    # Every step in one shape (16 tokens of 2 rows: the prompts' 10 tokens): one compile.
    llm = one_shape(je.LLM(max_num_reqs=2, max_model_len=32, max_num_batched_tokens=16,
                           tensor_parallel_size=3))
    outs = llm.generate([fixture["prompt"]] * 2, je.SamplingParams(temperature=0, max_tokens=20),
                        use_tqdm=False)
    for out in outs:
      assert out.outputs[0].token_ids == fixture["new_ids"], out.outputs[0].token_ids
    print("ok")
""")


#: The tests' fixtures folder (tests/fixtures).
FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")


def test_smollm2_under_tensor_parallel_3_gives_the_fixture_greedy_tokens():
  fixture = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "smollm2_greedy.json"
  )
  assert run_python(SMOLLM2_SCRIPT, fixture).strip().endswith("ok")
