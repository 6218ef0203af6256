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


def _plan(*args, **environment):
    """`scripts/test.sh`'s runs, as `TEST_PLAN=1` prints them: [(backend, pytest arguments)]."""
    import subprocess

    env = dict(os.environ, TEST_PLAN="1", **environment)
    done = subprocess.run(["bash", os.path.join(ROOT, "scripts", "test.sh"), *args], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    runs = []
    for line in done.stdout.splitlines():
        if line.startswith("KERAS_BACKEND="):
            backend, _, command = line[len("KERAS_BACKEND="):].partition(" ")
            runs.append((backend, command.split(": pytest ", 1)[1].split()))
    return runs


def test_the_parallel_plan_runs_every_test_file_once_per_backend():
    """With several jobs each backend's suite is split into parts: the files some parts name, and one
    run of the rest that --ignore's exactly those files, so no file is left out or run twice."""
    runs = _plan(TEST_JOBS="2", TEST_BACKENDS="jax torch tensorflow")
    assert sorted({backend for backend, _ in runs}) == ["jax", "tensorflow", "torch"]
    for backend in ("jax", "torch", "tensorflow"):
        named, rests = [], []
        for other, args in runs:
            if other != backend:
                continue
            files = [a for a in args if a.startswith("tests/")]
            ignored = [a[len("--ignore="):] for a in args if a.startswith("--ignore=")]
            (rests.append(ignored) if not files else named.extend(files))
        assert len(rests) == 1, (backend, rests)  # one run of the rest of the suite
        assert len(named) == len(set(named)), (backend, named)  # no file in two parts
        assert sorted(rests[0]) == sorted(named), backend  # a file PARTS names exists and runs once
        for f in named:
            assert os.path.basename(f).startswith("test_") and os.path.isfile(os.path.join(ROOT, f)), f


def test_one_job_or_a_named_test_runs_each_backends_suite_in_one_run():
    assert _plan(TEST_JOBS="1", TEST_BACKENDS="jax torch") == [
        ("jax", ["-q", "--durations=25"]), ("torch", ["-q", "--durations=25"])]
    assert _plan("tests/test_suite_config.py", TEST_JOBS="2", TEST_BACKENDS="jax torch") == [
        (backend, ["-q", "--durations=25", "tests/test_suite_config.py"]) for backend in ("jax", "torch")]
