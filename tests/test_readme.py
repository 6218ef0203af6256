"""Every ```python block of README.md and docs/*.md runs as written, on the active Keras backend.

Each block runs in its own fresh Python process (as a reader would paste it),
with the repository on `PYTHONPATH` and `KERAS_BACKEND` set to this run's
backend, from an empty temporary folder. `docs/api.md` is generated from the
docstrings, whose examples run in `tests/test_doctests.py`.
"""

import glob
import os
import re
import subprocess
import sys

import keras
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
PAGES = [README] + sorted(
    p for p in glob.glob(os.path.join(ROOT, "docs", "*.md")) if os.path.basename(p) != "api.md"
)


def python_blocks(text):
    """`[(heading, code)]` of every ```python fenced block, with the nearest heading above."""
    blocks = []
    heading = "README"
    fence = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)
    last = 0
    for match in fence.finditer(text):
        headings = re.findall(r"^#+ (.+)$", text[last:match.start()], re.M)
        heading = headings[-1].strip() if headings else heading
        blocks.append((heading, match.group(1)))
        last = match.end()
    return blocks


def page_blocks(path):
    """`[(heading, code)]` of the ```python blocks of one markdown file."""
    with open(path, encoding="utf-8") as f:
        return python_blocks(f.read())


def run_block(code, folder, pythonpath):
    """Runs `code` as a script in a fresh process from `folder`; returns the `CompletedProcess`."""
    env = dict(os.environ, KERAS_BACKEND=keras.backend.backend())
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    script = os.path.join(folder, "block.py")
    with open(script, "w", encoding="utf-8") as f:
        f.write(code)
    return subprocess.run([sys.executable, script], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=600)


BLOCKS = [
    (os.path.relpath(page, ROOT), heading, code)
    for page in PAGES
    for heading, code in page_blocks(page)
]


def test_block_extraction_finds_the_readme_blocks():
    text = "# A\n```python\nx = 1\n```\n## B\n```bash\nls\n```\n```python\ny = 2\n```\n"
    assert python_blocks(text) == [("A", "x = 1\n"), ("B", "y = 2\n")]
    headings = [h for h, _ in page_blocks(README)]
    assert "Quickstart: CutBCE" in headings and "Quickstart: ERASE" in headings, headings
    pages = {page for page, _, _ in BLOCKS}
    assert {"docs/cutbce.md", "docs/erase.md"} <= pages, pages
    # Issue 52 items 7 and 4: the runnable answers, not prose alone.
    cutbce = {h for h, _ in page_blocks(os.path.join(ROOT, "docs", "cutbce.md"))}
    assert {"A loss rebuilt from its config", "How to check the numbers yourself"} <= cutbce, cutbce


@pytest.mark.parametrize(
    "page,heading,code", BLOCKS, ids=[f"{p}-{i}-{h}" for i, (p, h, _) in enumerate(BLOCKS)]
)
@pytest.mark.slow
def test_documented_block_runs_as_written(page, heading, code, tmp_path):
    done = run_block(code, str(tmp_path), ROOT)
    assert done.returncode == 0, f"{page} block under '{heading}' failed:\n{done.stderr[-3000:]}"


@pytest.mark.slow
def test_load_model_in_a_fresh_process_after_importing_keras_cutbce(tmp_path):
    """What the README says about saving: `import keras_cutbce`, then `load_model` works."""
    import numpy as np

    from keras_cutbce import CutBCELoss

    items = keras.layers.Embedding(50, 4, name="items")
    ids = keras.Input((3,), dtype="int32")
    model = keras.Model(ids, keras.layers.Dense(4)(items(ids)))
    model.compile(optimizer="adam", loss=CutBCELoss(items))
    x = np.arange(6, dtype="int32").reshape(2, 3)
    y = np.full((2, 3, 2), 7, "int32")
    model.fit(x, y, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    expected = float(model.evaluate(x, y, verbose=0))
    code = (
        "import keras, numpy as np\n"
        "import keras_cutbce  # registers CutBCELoss\n"
        f"model = keras.models.load_model({path!r})\n"
        "x = np.arange(6, dtype='int32').reshape(2, 3)\n"
        "print(float(model.evaluate(x, np.full((2, 3, 2), 7, 'int32'), verbose=0)))\n"
    )
    env = dict(os.environ, KERAS_BACKEND=keras.backend.backend())
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.strip().splitlines()[-1]) == pytest.approx(expected, rel=1e-5)


def _slug(heading):
    """GitHub's anchor of a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_relative_links_resolve():
    """Every relative link of the README and docs/ names a file that exists (and a heading there)."""
    broken = []
    for page in PAGES + [os.path.join(ROOT, "docs", "api.md"), os.path.join(ROOT, "CHANGELOG.md")]:
        with open(page, encoding="utf-8") as f:
            text = f.read()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(full):
                broken.append(f"{os.path.relpath(page, ROOT)}: {target}")
            elif anchor and full.endswith(".md"):
                with open(full, encoding="utf-8") as f:
                    slugs = {_slug(h) for h in re.findall(r"^#+ (.+)$", f.read(), re.M)}
                if anchor not in slugs:
                    broken.append(f"{os.path.relpath(page, ROOT)}: {target} (no such heading)")
    assert not broken, broken


def test_slug_matches_githubs_rule():
    assert _slug("SASRec: CutBCE vs dense BCE on a 10^6-item catalogue") == (
        "sasrec-cutbce-vs-dense-bce-on-a-106-item-catalogue"
    )
