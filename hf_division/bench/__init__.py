"""The measurement harness: suites (``python -m hf_division.bench SUITE``), the models and text
they measure on, peak memory, GLUE data and metrics, and the demo. The suites and GLUE need the
``[bench]`` extra; the demo (``hf-division demo``) runs on the core install.
"""
