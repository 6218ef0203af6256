"""The distribution's version, written once for `keras_cutbce`, `keras_erase` and `pyproject.toml`."""

__all__ = ["__version__"]

__version__ = "0.1.0"
