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
