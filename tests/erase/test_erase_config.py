"""The schedule options (every backend): launcher, placement and graphs, presets, labels, errors."""

import re

import keras
import pytest

from keras_erase import EraseModel
from keras_erase.config import EraseConfig, Schedule


@pytest.mark.parametrize(
    "dispatch,expected",
    [("blocking", ("inline", "default_stream")), ("threaded", ("worker", "default_stream")),
     ("streams", ("worker", "block_streams")), ("inline_streams", ("inline", "block_streams"))],
)
def test_schedule_names_are_a_launcher_and_a_placement(dispatch, expected):
    schedule = EraseConfig(dispatch=dispatch).schedule()
    assert (schedule.launcher, schedule.placement, schedule.graphs) == (*expected, False)
    assert schedule.name == dispatch
    assert EraseConfig(dispatch=dispatch, launcher=expected[0]).schedule() == schedule


def test_early_takes_the_options_and_defaults_to_a_worker_and_a_stream_per_block_on_cuda():
    config = EraseConfig(dispatch="early")
    assert config.schedule(cuda=True) == Schedule("worker", "block_streams")
    assert config.schedule(cuda=False) == Schedule("worker", "default_stream")
    assert not config.needs_cuda  # runs anywhere: the placement follows the device
    inline = EraseConfig(dispatch="early", launcher="inline", placement="block_streams",
                         cuda_graphs=True)
    assert inline.schedule().name == "inline_streams+graphs" and inline.needs_cuda
    assert EraseConfig(dispatch="streams").needs_cuda
    assert EraseConfig(dispatch="streams").num_streams is None  # one stream per block


@pytest.mark.parametrize(
    "kwargs,text",
    [({"dispatch": "blocking", "launcher": "worker"}, "use dispatch='early'"),
     ({"dispatch": "threaded", "placement": "block_streams"}, "placement='block_streams'"),
     ({"dispatch": "standard", "launcher": "inline"}, "dispatch='standard'"),
     ({"dispatch": "auto", "placement": "default_stream"}, "dispatch='auto'"),
     ({"dispatch": "early", "launcher": "thread"}, "launcher='thread'"),
     ({"dispatch": "early", "placement": "side"}, "placement='side'"),
     ({"num_streams": 0}, "num_streams=0")],
)
def test_bad_options_name_what_they_received(kwargs, text):
    with pytest.raises(ValueError, match=text.replace("(", r"\(")):
        EraseConfig(**kwargs)


def test_every_schedule_name_parses_back_and_is_a_dispatch_value():
    for graphs in (False, True):
        for schedule in Schedule.every(graphs):
            assert Schedule.from_name(schedule.name) == schedule
    assert [s.name for s in Schedule.every()] == [
        "blocking", "threaded", "streams", "inline_streams"
    ]
    for graphs in (False, True):  # a dispatch_choice is a dispatch value: the same schedule
        for schedule in Schedule.every(graphs):
            config = EraseConfig(dispatch=schedule.name)
            assert config.schedule() == schedule and config.cuda_graphs == graphs
            assert EraseConfig(**config.to_dict()) == config


@pytest.mark.parametrize("old,new", [("inline+block_streams", "inline_streams"),
                                     ("inline+block_streams+graphs", "inline_streams+graphs")])
def test_a_renamed_dispatch_value_still_works_with_a_deprecation_warning(old, new):
    with pytest.warns(DeprecationWarning, match=re.escape(f"dispatch='{new}'")):
        config = EraseConfig(dispatch=old)
    assert config.schedule() == Schedule.from_name(new)
    assert config.dispatch == "inline_streams"
    with pytest.raises(ValueError, match="standard\\+graphs"):
        EraseConfig(dispatch="standard+graphs")


def test_the_options_round_trip_through_get_config():
    inputs = keras.Input((3,))
    model = EraseModel(inputs, keras.layers.Dense(1)(inputs), dispatch="early",
                       launcher="inline", placement="default_stream", num_streams=2)
    clone = EraseModel.from_config(model.get_config())
    assert (clone.dispatch, clone.launcher, clone.placement, clone.num_streams) == (
        "early", "inline", "default_stream", 2
    )
