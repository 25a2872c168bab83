"""The device a trace is compiled for, which need not be a local one.

Compiling ahead of time for a TPU topology on a machine without a TPU (`jax.experimental.
topologies`) traces on the CPU backend: `jax.default_backend()` says "cpu" and `jax.devices()`
holds CPU devices. The target is the topology's device, which the compiling code makes jax's
default device (`with jax.default_device(topology.devices[0]):`; Mosaic, the Pallas TPU
compiler, reads it there too). Code that picks a kernel or its block sizes per platform asks
here instead of querying the local devices.
"""

from __future__ import annotations

import jax


def _default_device() -> jax.Device | None:
  """Jax's default device when one is set (`jax.default_device`) and is a device object."""
  device = getattr(jax.config, "jax_default_device", None)
  return device if hasattr(device, "platform") else None


def target_platform() -> str:
  """The platform being compiled for: the default device's (`jax.default_device`), else
  `jax.default_backend()`: "cpu", "gpu" or "tpu"."""
  device = _default_device()
  return device.platform if device is not None else jax.default_backend()


def target_device_kind() -> str | None:
  """The `device_kind` of the TPU being compiled for ("TPU v5 lite", "TPU v6 lite", ...), or
  None when the target is not a TPU."""
  device = _default_device()
  if device is None and jax.default_backend() == "tpu":
    device = jax.devices()[0]
  if device is None or device.platform != "tpu":
    return None
  return str(device.device_kind)
