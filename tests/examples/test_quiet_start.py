"""A quiet start: `import keras_cutbce`, the main job's runs and the README's blocks run with the environment's
Python print no other backend's startup lines and, with libtpu installed on a machine without a TPU, never
load it to probe for one (fresh processes)."""

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

from tests.backend_utils import BACKEND, ROOT

pytestmark = pytest.mark.slow

# The variables a quiet start sets: the child starts without them, as a user's shell does.
_SET_BY_QUIET_START = ("JAX_PLATFORMS", "TF_ENABLE_ONEDNN_OPTS", "TF_CPP_MIN_LOG_LEVEL")
_OTHER_BACKENDS_LINES = ("oneDNN", "cpu_feature_guard", "absl::InitializeLog", "TensorFlow binary")
# Whether JAX loaded libtpu's plugin (its probe for a TPU), read in the child at its end (a test-only
# private JAX name).
_PROBED = """
if "jax" in sys.modules:
    from jax._src.lib import _jax
    print("libtpu loaded:", _jax.pjrt_plugin_loaded("tpu"))
"""


def _run(code, **env_vars):
    env = {k: v for k, v in os.environ.items() if k not in _SET_BY_QUIET_START}
    env.update(KERAS_BACKEND=BACKEND, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", **env_vars)
    out = subprocess.run([sys.executable, "-c", "import sys\n" + code + _PROBED], cwd=ROOT, env=env,
                         text=True, capture_output=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stderr.splitlines()
    if BACKEND != "tensorflow":  # TensorFlow's own startup lines are its backend's
        assert not [l for l in lines if any(w in l for w in _OTHER_BACKENDS_LINES)], out.stderr[-3000:]
    assert not [l for l in lines if "tpu" in l.lower()], out.stderr[-3000:]
    assert "libtpu loaded: True" not in out.stdout
    return out


def test_import_is_quiet():
    """The import initialises no backend (a JAX program's first op is JAX's own start)."""
    out = _run("import keras_cutbce, keras_erase")
    if BACKEND != "tensorflow":
        assert out.stderr.strip() == "", out.stderr[-3000:]


def test_the_main_jobs_runs_are_quiet():
    """The main job's SASRec example as `run_all` starts it (`python -m examples.sasrec`), on a tiny budget:
    no other backend's lines, and TensorFlow not imported on JAX and torch."""
    argv = ["examples.sasrec", "--loss", "cutsoftmax", "--epochs", "1", "--num-users", "64",
            "--steps-per-epoch", "2", "--eval-users", "16", "--verbose", "0"]
    out = _run(f"import runpy\nsys.argv = {argv!r}\nrunpy.run_module('examples.sasrec', run_name='__main__')"
               "\nprint('tensorflow imported:', 'tensorflow' in sys.modules)")
    # Seeding through Keras imported TensorFlow into every JAX and torch run (its 420 MiB in the peak RSS).
    assert f"tensorflow imported: {BACKEND == 'tensorflow'}" in out.stdout, out.stdout[-2000:]


def test_the_environments_python_starts_quiet(tmp_path):
    """`scripts/setup_env.sh` puts `scripts/quiet_start.pth` in `.venv`: the README's first block, run as a
    reader runs it (no variable set), after `keras.utils.set_random_seed` (it imports TensorFlow)."""
    shutil.copy(os.path.join(ROOT, "scripts", "quiet_start.pth"), tmp_path / "keras_cutbce_quiet_start.pth")
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        block = f.read().split("```python\n", 1)[1].split("```", 1)[0]
    # `site` reads a folder's .pth files as it reads site-packages' at start (before any import here).
    out = _run(f"import site\nsite.addsitedir({str(tmp_path)!r})\nimport keras\n"
               f"keras.utils.set_random_seed(0)\n{block}\nprint('tensorflow imported:', 'tensorflow' in sys.modules)")
    assert "tensorflow imported: True" in out.stdout  # its lines were there to print


def test_the_probe_is_what_the_check_sees():
    """Without the quiet start JAX loads libtpu here (else the checks above would prove nothing);
    `JAX_PLATFORMS=""` (JAX's own choice) also overrides `scripts/quiet_start.pth`."""
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("the probe needs libtpu installed")
    with pytest.raises(AssertionError):
        _run("import jax\njax.devices()", JAX_PLATFORMS="")
