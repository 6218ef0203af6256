"""The suite's own configuration: every `SLOW` entry names a test that exists."""

import os
import re

import pytest

from tests.conftest import SLOW, slow_entry_matches

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("entry", SLOW)
def test_slow_entry_names_an_existing_test(entry):
    path, _, name = entry.partition("::")
    name = name.split("[")[0]  # a case `test_x[id]` names the test `test_x`
    file = os.path.join(ROOT, path)
    assert os.path.isfile(file), f"SLOW entry {entry!r}: no file {path}"
    if name:
        source = open(file, encoding="utf-8").read()
        assert re.search(rf"^\s*def {re.escape(name)}\(", source, re.M), (
            f"SLOW entry {entry!r}: no test {name} in {path}"
        )


def test_slow_entries_are_unique():
    assert len(set(SLOW)) == len(SLOW)


def test_entry_matching_is_by_file_test_or_case_never_by_name_prefix():
    assert slow_entry_matches("tests/a.py", "tests/a.py::test_x[1]")
    assert slow_entry_matches("tests/a.py::test_x", "tests/a.py::test_x")
    assert slow_entry_matches("tests/a.py::test_x", "tests/a.py::test_x[jax-1]")
    assert not slow_entry_matches("tests/a.py::test_x", "tests/a.py::test_x_more")
    assert not slow_entry_matches("tests/a.py", "tests/a.py.bak::test_x")
    assert not slow_entry_matches("tests/a", "tests/a.py::test_x")
