"""Helpers vLLM scripts import from `vllm.utils` (imports nothing heavy).

FlexibleArgumentParser  an `argparse.ArgumentParser` that takes `--max_model_len` for
                        `--max-model-len` (argparse_utils.py)
"""

from jaxengine.utils.argparse_utils import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
