"""The suite's own configuration: the `slow` marker is declared, and markers are strict."""

import os
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pytest_options():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["tool"]["pytest"]["ini_options"]


def test_slow_is_a_declared_marker_and_unknown_markers_fail():
    options = _pytest_options()
    assert any(m.startswith("slow:") for m in options["markers"])
    assert "--strict-markers" in options["addopts"].split()  # a typo such as `slwo` fails collection


@pytest.mark.slow
def test_a_slow_test_is_left_out_of_the_fast_subset(request):
    assert request.node.get_closest_marker("slow") is not None
    assert "not slow" not in (request.config.getoption("markexpr") or "")
