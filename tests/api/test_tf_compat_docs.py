"""docs/bad_inputs.md rows whose cases live in the tests/*/test_tf_compat_*.py
files (tests/api/test_bad_inputs.py checks the rest): each names a real case."""

import os
import re

import pytest

from _paths import REPO  # noqa: E402

pytestmark = pytest.mark.timeout(30)


def _rows():
    with open(os.path.join(REPO, "docs", "bad_inputs.md")) as f:
        return re.findall(r"^\| `([a-z0-9_]+)` \(in `(tests/[a-z0-9_/]+\.py)`\):",
                          f.read(), re.MULTILINE)


def test_each_row_names_a_case_in_its_file():
    rows = _rows()
    assert len(rows) >= 16
    for case, path in rows:
        with open(os.path.join(REPO, path)) as f:
            source = f.read()
        # A test function, or a parametrize id.
        assert (f"def {case}(" in source or f'"{case}"' in source), (case, path)
