"""Ahead-of-time compiles of the engine for Cloud TPU topologies, from any machine with libtpu
(``pip install "jaxengine[tpu]"``), and for NVIDIA GPUs (``"h100"``, ``"h100:4"``) with the CUDA
plugin (`jaxengine.aot.cuda`): `compile_for_topology` (and ``jaxengine compile``) builds the
engine from a model's ``config.json`` alone, compiles every executable it precompiles for the
topology, and plans each chip's memory (see `jaxengine.aot.compile`).
"""

from jaxengine.aot.compile import compile_for_topology
from jaxengine.aot.executables import Executable, abstract_engine, engine_executables
from jaxengine.aot.topologies import TOPOLOGIES

__all__ = [
  "TOPOLOGIES",
  "Executable",
  "abstract_engine",
  "compile_for_topology",
  "engine_executables",
]
