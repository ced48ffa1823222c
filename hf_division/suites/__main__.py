"""``python -m hf_division.suites SUITE [options]``."""
import sys

from hf_division.suites import main

sys.exit(main())
