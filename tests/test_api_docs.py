"""The API reference `docs/api.md` is generated from the docstrings and kept current.

A public name (or a method a public class adds) without a docstring fails
here, and so does a committed page that differs from what
`python scripts/api_docs.py` writes now. The docstrings' `>>>` examples run in
`tests/test_doctests.py`.
"""

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_generator():
    spec = importlib.util.spec_from_file_location(
        "api_docs", os.path.join(ROOT, "scripts", "api_docs.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


api_docs = _load_generator()


def test_every_public_name_has_a_docstring():
    assert api_docs.missing_docstrings() == []


def test_the_surface_covers_both_packages_and_their_all():
    import keras_cutbce
    import keras_erase

    names = {q for q, _ in api_docs.public_names()}
    for package in (keras_cutbce, keras_erase):
        for name in package.__all__:
            assert f"{package.__name__}.{name}" in names


def test_a_name_without_a_docstring_is_reported(monkeypatch):
    def undocumented():
        pass

    monkeypatch.setattr(api_docs, "public_names", lambda: [("pkg.undocumented", undocumented)])
    assert api_docs.missing_docstrings() == ["pkg.undocumented"]
    with pytest.raises(ValueError, match="pkg.undocumented"):
        api_docs.render()


def test_a_new_method_without_a_docstring_is_reported(monkeypatch):
    class Documented:
        """A class."""

        def new_method(self):
            pass

    monkeypatch.setattr(api_docs, "public_names", lambda: [("pkg.Documented", Documented)])
    assert api_docs.missing_docstrings() == ["pkg.Documented.new_method"]


def test_the_committed_page_is_what_the_generator_writes():
    with open(api_docs.OUTPUT, encoding="utf-8") as f:
        committed = f.read()
    assert committed == api_docs.render(), (
        "docs/api.md is stale: run `python scripts/api_docs.py` and commit it"
    )


def test_google_sections_become_markdown():
    text = api_docs._markdown(
        """Summary.

        Args:
            x: the input,
                continued.

        Returns:
            The output.

        >>> 1 + 1
        2
        """
    )
    assert "**Args:**" in text and "- `x`: the input," in text and "  continued." in text
    assert "**Returns:**" in text and "\nThe output." in text
    assert "```python\n>>> 1 + 1\n2\n```" in text
