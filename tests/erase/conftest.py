"""Fixtures of the ERASE tests."""

import pytest


@pytest.fixture
def auto_measures(monkeypatch):
    """Lets `dispatch="auto"` measure on this machine as it does on CUDA (torch only).

    On a CPU `"auto"` is the standard step and measures nothing; its CUDA rule
    (the selector, every trial schedule, the explanations) runs when the train
    step sees a CUDA device. Here it does: `torch.cuda.synchronize` does
    nothing and `"block_streams"` runs on the checked stand-in streams
    (`tests.erase.fake_streams.CheckedStreams`).
    """
    import torch

    from keras_erase.torch import train_step
    from keras_erase.torch.schedules import placements
    from tests.erase.fake_streams import CheckedStreams

    monkeypatch.setattr(train_step, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    previous = placements.set_default_streams(CheckedStreams)
    try:
        yield
    finally:
        placements.set_default_streams(previous)
