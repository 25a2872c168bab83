#!/usr/bin/env bash
# One command for a GPU or TPU: the sampler, the paged attention kernels and the engine, in one
# run with absolute times (each table prints the machine, versions and date first).
#
#   bash benchmarks/accelerator.sh            # full sizes (about 6 minutes on one H200)
#   bash benchmarks/accelerator.sh --small    # tiny sizes on any machine: checks that it runs
#
# 1. the sampler, 256 rows x 151,936 (Qwen2.5's vocabulary), against one jitted log_softmax
#    pass over the same logits (bench_sampler.py);
# 2. one layer of paged attention: the Pallas kernel of the platform against the XLA path
#    (bench_attention_backends.py);
# 3. the host cost of a sampler call, and engine tokens/s at batch 1 / 32 / 256 on a random model
#    of Qwen2.5-0.5B's shape in bfloat16, synchronous against asynchronous scheduling, with the
#    host's share of a step (bench_async.py).
# Before renting the chip, `jaxengine compile` (docs/parallelism.md) compiles for its topology the
# executables step 3's engine will run, from any machine with `pip install -e ".[tpu]"`, and says
# whether they fit:
#   jaxengine compile benchmarks/model_configs/Qwen2.5-0.5B --topology v5e:1x1 --max-num-reqs 256
# Tables go to stdout and to $OUT/accelerator.md (or ./accelerator.md). JAX's persistent
# compilation cache lives in a temporary directory for the run, so engines of the same shapes
# compile once.
set -euo pipefail
cd "$(dirname "$0")"
small=0
[[ "${1:-}" == "--small" ]] && small=1
out="${OUT:-.}/accelerator.md"
cache="$(mktemp -d)"
trap 'rm -rf "$cache"' EXIT
export JAX_COMPILATION_CACHE_DIR="$cache" JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
if ((small)); then
  sampler=(--batch-sizes 8 --vocab-sizes 1024 --mixes greedy chat everything --repeats 2)
  attention=(--small --repeats 2)
  engine=(--tables sampler engine --models tiny --batch-sizes 1 2 --repeats 1 --sampler-repeats 20)
else
  sampler=(--batch-sizes 256 --vocab-sizes 151936 --repeats 20
           --mixes greedy temperature chat top_p everything everything_deep)
  attention=(--repeats 20)
  engine=(--tables sampler engine --models qwen2.5-0.5b --batch-sizes 1 32 256 --repeats 2
          --dtype bfloat16 --sampler-repeats 500)
fi
python -c "import jax; print('#', jax.devices())" | tee "$out"
{
  timeout 150 python bench_sampler.py "${sampler[@]}"
  timeout 120 python bench_attention_backends.py "${attention[@]}"
  timeout 300 python bench_async.py "${engine[@]}"
} 2>&1 | grep -v "it/s]" | tee -a "$out"
