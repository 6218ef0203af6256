"""Writes the API reference `docs/api.md` from the public docstrings.

`python scripts/api_docs.py` regenerates the page; `--check` exits non-zero if
the committed page is out of date or a public name has no docstring (the test
suite runs the same check, `tests/test_api_docs.py`).

The public surface is each package's `__all__`, plus the names in the
`__all__` of the modules listed in `MODULES` that the package itself does not
export, plus the few functions of named modules listed in `EXTRA_NAMES`. For a public class, every public method
or property the class adds to its Keras base class is documented (and must
have a docstring); overrides of Keras methods (`call`, `get_config`, ...) keep
Keras's documentation and are listed by name only.

Example:

```
python scripts/api_docs.py            # writes docs/api.md
python scripts/api_docs.py --check    # fails if docs/api.md is stale
```
"""

import argparse
import importlib
import inspect
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUTPUT = os.path.join(ROOT, "docs", "api.md")
PACKAGES = ("keras_cutbce", "keras_erase")
MODULES = ("keras_cutbce.ops",)
EXTRA_NAMES = {
    "keras_erase.torch.launch": ("run_local",),
    "keras_erase.throughput": ("examples_per_second", "throughput_percentiles",
                               "global_step_seconds"),
}
SECTIONS = ("Args", "Arguments", "Returns", "Yields", "Raises", "Example", "Examples", "Note")


def public_names():
    """`[(qualified name, object)]` of the documented surface, in page order."""
    names = []
    for package_name in PACKAGES:
        package = importlib.import_module(package_name)
        names += [(f"{package_name}.{n}", getattr(package, n)) for n in package.__all__]
        for module_name in MODULES:
            if module_name.startswith(package_name + "."):
                module = importlib.import_module(module_name)
                names += [
                    (f"{module_name}.{n}", getattr(module, n))
                    for n in module.__all__
                    if n not in package.__all__
                ]
        for module_name, members in EXTRA_NAMES.items():
            if module_name.startswith(package_name + "."):
                module = importlib.import_module(module_name)
                names += [(f"{module_name}.{n}", getattr(module, n)) for n in members]
    return names


def _own_members(cls):
    """`(new, overridden)`: public attributes `cls` adds, and those it overrides from a base.

    Members of a base of the same package that its module does not export
    (`loss.CutLoss` under `CutBCELoss`) count as the class's own.
    """
    package = cls.__module__.split(".")[0]
    own = [cls] + [base for base in cls.__mro__[1:]
                   if base.__module__.split(".")[0] == package and base.__name__ not in _public_in(base)]
    members = {}
    for klass in own:
        for name, value in vars(klass).items():
            members.setdefault(name, value)
    new, overridden = [], []
    for name, value in members.items():
        if name.startswith("_"):
            continue
        if not isinstance(value, (property, staticmethod, classmethod)) and not callable(value):
            continue
        bases = [base for base in cls.__mro__[1:] if base not in own]
        if any(name in vars(base) for base in bases):
            overridden.append((name, value))
        else:
            new.append((name, value))
    return new, overridden


def _public_in(cls):
    """The names a class's module exports (`__all__`)."""
    return getattr(importlib.import_module(cls.__module__), "__all__", ())


def _doc(value):
    """The docstring of a function, property, staticmethod or classmethod ('' if none)."""
    target = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
    return (target.__doc__ or "").strip()


def missing_docstrings():
    """Qualified names of public objects (and their new members) without a docstring."""
    missing = []
    for qualified, obj in public_names():
        if not _doc(obj):
            missing.append(qualified)
        if inspect.isclass(obj):
            missing += [f"{qualified}.{n}" for n, v in _own_members(obj)[0] if not _doc(v)]
    return missing


def _signature(name, obj):
    try:
        return f"{name}{inspect.signature(obj)}"
    except (TypeError, ValueError):
        return name


def _markdown(doc):
    """Google-style docstring -> markdown: section titles bold, `Args:` as a list,
    `>>>` examples fenced as python."""
    lines = inspect.cleandoc(doc).splitlines()
    out, section, in_fence, in_doctest = [], None, False, False
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("```"):
            in_fence = not in_fence
            out.append(stripped)
            continue
        if in_fence:
            out.append(line[4:] if section and line.startswith("    ") else line)
            continue
        if stripped.startswith(">>>") and not in_doctest:
            out.append("```python")
            in_doctest = True
        elif in_doctest and not stripped:
            out.append("```")
            in_doctest = False
        if in_doctest:
            out.append(stripped)
            continue
        title = re.fullmatch(r"([A-Z][a-z]+):", stripped)
        if title and title.group(1) in SECTIONS and not line.startswith(" "):
            section = title.group(1)
            out += [f"**{section}:**", ""]
            continue
        if not line.startswith(" "):
            section = None
        if section in ("Args", "Arguments", "Raises") and re.match(r"^    \S", line):
            item = re.match(r"^    (\*{0,2}[\w.]+)( \([^)]*\))?:(.*)$", line)
            if item:
                out.append(f"- `{item.group(1)}`{item.group(2) or ''}:{item.group(3)}")
                continue
        if section and line.startswith("    "):
            line = "  " + line.lstrip() if section in ("Args", "Arguments", "Raises") else line[4:]
        out.append(line)
    if in_doctest:
        out.append("```")
    text = "\n".join(out).strip()
    return re.sub(r"(\*\*[A-Z][a-z]+:\*\*)\n\n\n", r"\1\n\n", text)  # one blank after a title


def _entry(level, qualified, obj):
    short = qualified.rsplit(".", 1)[-1]
    parts = [f"{'#' * level} `{qualified}`", ""]
    if isinstance(obj, property):
        parts += ["*property*", ""]
    else:
        target = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
        if callable(target):
            parts += ["```python", _signature(short, target), "```", ""]
    parts.append(_markdown(_doc(obj)))
    return "\n".join(parts)


def render():
    """The whole page as markdown text (raises if a public name has no docstring)."""
    missing = missing_docstrings()
    if missing:
        raise ValueError("public names without a docstring: " + ", ".join(missing))
    pieces = [
        "# API reference",
        "",
        "Generated from the docstrings by `python scripts/api_docs.py` (do not edit by hand; "
        "`tests/test_api_docs.py` fails when this page is stale or a public name has no "
        "docstring).",
    ]
    current = None
    for qualified, obj in public_names():
        package = qualified.split(".")[0]
        if package != current:
            current = package
            module = importlib.import_module(package)
            summary = inspect.cleandoc(module.__doc__ or "").split("\n\n")[0]
            pieces += ["", f"## `{package}`", "", summary]
        pieces += ["", _entry(3, qualified, obj)]
        if inspect.isclass(obj):
            new, overridden = _own_members(obj)
            documented = new + [(n, v) for n, v in overridden if _doc(v)]
            overridden = [n for n, v in overridden if not _doc(v)]
            for name, value in documented:
                pieces += ["", _entry(4, f"{qualified}.{name}", value)]
            if overridden:
                listed = ", ".join(f"`{n}`" for n in overridden)
                pieces += ["", f"Overrides of the Keras base class (documented by Keras): {listed}."]
    return "\n".join(pieces).rstrip() + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help=f"fail if {os.path.relpath(OUTPUT, ROOT)} is not up to date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        with open(OUTPUT, encoding="utf-8") as f:
            if f.read() != text:
                sys.exit(f"{OUTPUT} is stale: run `python scripts/api_docs.py`")
        return
    os.makedirs(os.path.dirname(OUTPUT), exist_ok=True)
    with open(OUTPUT, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {OUTPUT}")


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
