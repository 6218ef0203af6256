"""`keras_erase.throughput`: p90 QPS is the fast end of per-step examples/s."""

import numpy as np
import pytest

from keras_erase.throughput import (
    examples_per_second,
    global_step_seconds,
    throughput_percentiles,
)


def test_p90_is_the_fast_end_of_per_step_rates():
    steps = [0.1] * 9 + [0.01]  # one fast step in ten
    stats = throughput_percentiles(steps, batch_size=10)
    assert stats["p50"] == pytest.approx(100.0)
    # The fast end: p90 of rates lies above the median (batch / p90 step time would be below).
    assert stats["p90"] > stats["p50"]
    assert stats["p90"] == pytest.approx(np.percentile([100.0] * 9 + [1000.0], 90))
    assert stats["steps"] == 10


def test_rates_are_batch_over_step_time():
    np.testing.assert_allclose(examples_per_second([0.5, 2.0], 4), [8.0, 2.0])


@pytest.mark.parametrize("bad", [[], [0.0], [-1.0], [float("nan")]])
def test_bad_step_times_raise(bad):
    with pytest.raises(ValueError):
        examples_per_second(bad, 4)


def test_global_step_is_the_slowest_rank():
    np.testing.assert_allclose(global_step_seconds([[1.0, 3.0], [2.0, 1.0]]), [2.0, 3.0])
    with pytest.raises(ValueError):
        global_step_seconds([1.0, 2.0])
