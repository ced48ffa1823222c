"""The measurement harness: suites (``python -m hf_division.bench SUITE``), the models and text
they measure on, peak memory, interleaved timing, GLUE data, and the demo. Needs the ``[bench]``
extra.
"""
