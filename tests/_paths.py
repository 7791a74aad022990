"""Where things are, for tests in any subfolder of tests/."""

import os

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
