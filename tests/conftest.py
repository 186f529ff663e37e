"""Test-wide setup: test helper modules in tests/ import from subfolders (tests/reliability/)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
