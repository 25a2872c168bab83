"""jaxengine inside the frameworks its users train and evaluate in (each module imports its
framework; install its extra).

lm_eval.py           `JaxEngineLM`: jaxengine as lm-evaluation-harness's `jaxengine` model
tunix.py             `JaxEngineRollout`: jaxengine as a Tunix RL rollout engine
tunix_placement.py   the rollout engine's mesh on Tunix's rollout mesh, and its memory share
tunix_sampling.py    Tunix's prompt padding and `RolloutConfig` as the engine's requests
tunix_logprobs.py    teacher-forced logprobs of completions under the engine's weights
tunix_config.py      Tunix's Llama 3 / Qwen2 / Qwen3 (dense, MoE) / Gemma / Gemma 3 configs as the
                     engine model's configs
tunix_weight_sync.py the rollout's weight sync with versions, and pause / resume for Tunix's
                     asynchronous pipeline
tunix_weights.py     Tunix's weights as the engine model's leaves (its configs re-exported)
tunix_lora.py        a qwix LoRA actor's pairs as an engine LoRA adapter

Each module names its extra when its framework is missing (`MissingExtraError`). The extras are
spelled in their normalised form (PEP 685: lower case, runs of ``-``, ``_``, ``.`` as one ``-``),
the only spelling every pip finds: pip 23.2 (Python 3.11's) looks an extra up as it is typed,
and setuptools writes the package's extras normalised.
"""

from __future__ import annotations

#: The extra of each framework an integration needs, by the framework's top-level module.
EXTRAS = {"lm_eval": "lm-eval", "tunix": "tunix"}
#: What each framework is called in messages.
FRAMEWORKS = {"lm_eval": "lm-evaluation-harness", "tunix": "Tunix (google-tunix)"}


class MissingExtraError(ModuleNotFoundError):
  """An integration's framework is not installed; the message gives the pip command."""


def install_command(extra: str) -> str:
  """The pip command that installs the extra `extra`, from the index and from a checkout."""
  return f'pip install "jaxengine[{extra}]" (from a checkout: pip install -e ".[{extra}]")'


def missing_extra(error: ModuleNotFoundError, integration: str) -> ModuleNotFoundError:
  """The error to raise when importing an integration's framework failed with `error`.

  Args:
    error: the `ModuleNotFoundError` of the framework's import.
    integration: the integration module (``"jaxengine.integrations.lm_eval"``).

  Returns:
    A `MissingExtraError` naming the extra to install when the missing module is a framework of
    `EXTRAS` itself; else `error` unchanged (a dependency missing inside an installed framework
    is that framework's problem, reported as it is).
  """
  top = (error.name or "").partition(".")[0]
  if top not in EXTRAS:
    return error
  return MissingExtraError(
    f"{integration} needs {FRAMEWORKS[top]}, which is not installed: "
    f"{install_command(EXTRAS[top])}",
    name=error.name,
  )
