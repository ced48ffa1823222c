"""How the compressor runs: the native CPU library (``csrc/``), the ``torch.compile`` runner, and
``configure()``, the one switch board for every optional fast path.
"""
