"""``python -m hf_division.bench SUITE [options]``."""
from hf_division.bench.suites import main

# a suite's ``main`` may return its rows (for callers in Python); the exit status is 0 either way
main()
