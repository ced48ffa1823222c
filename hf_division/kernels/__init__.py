"""How the compressor runs: the native CPU library (``csrc/``), the ``torch.compile`` runner, and
:func:`configure`, the one switch board for every optional fast path (:mod:`.switches`).
"""
from hf_division.kernels.switches import configure, configured, switches

__all__ = ["configure", "configured", "switches"]
