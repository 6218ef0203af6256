"""Every ```python block of README.md runs as written, on the active Keras backend.

Each block runs in its own fresh Python process (as a reader would paste it),
with the repository on `PYTHONPATH` and `KERAS_BACKEND` set to this run's
backend, from an empty temporary folder.
"""

import os
import re
import subprocess
import sys

import keras
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")


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


BLOCKS = python_blocks(open(README, encoding="utf-8").read())


def test_block_extraction_finds_the_readme_blocks():
    text = "# A\n```python\nx = 1\n```\n## B\n```bash\nls\n```\n```python\ny = 2\n```\n"
    assert python_blocks(text) == [("A", "x = 1\n"), ("B", "y = 2\n")]
    headings = [h for h, _ in BLOCKS]
    assert "CutBCE" in headings and "ERASE" in headings, headings


@pytest.mark.parametrize("heading,code", BLOCKS, ids=[f"{i}-{h}" for i, (h, _) in enumerate(BLOCKS)])
def test_readme_block_runs_as_written(heading, code, tmp_path):
    env = dict(os.environ, KERAS_BACKEND=keras.backend.backend())
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    script = tmp_path / "block.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"README block under '{heading}' failed:\n{done.stderr[-3000:]}"


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
