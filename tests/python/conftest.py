"""The Python tools' tests: their subprocess time limits are safety nets written
in the reference machine's seconds and scaled() by this machine's measured
speed (tests/machine_speed.py)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from machine_speed import (  # noqa: E402,F401 (the hooks are pytest's)
    pytest_collection_modifyitems, pytest_configure, pytest_runtest_makereport,
    pytest_terminal_summary, scaled)
