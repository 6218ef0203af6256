"""The examples' command line as a new user meets it.

`--help` with no backend chosen imports no backend at all (no TensorFlow log
lines); a bad `--data-dir` is a usage error, not a
traceback; the CTR plot's default lives in the output folder.
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROBE = (
    "import runpy, sys\n"
    "sys.argv = [{module!r}] + {argv!r}\n"
    "try:\n"
    "    runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n"
    "except SystemExit as exit:\n"
    "    code = exit.code\n"
    "else:\n"
    "    code = 0\n"
    "loaded = sorted(m for m in ('jax', 'tensorflow', 'torch') if m in sys.modules)\n"
    "print('LOADED', ','.join(loaded), file=sys.stderr)\n"
    "sys.exit(code)\n"
)


def run_example(module, argv, tmp_path):
    """Runs `python -m module argv` from `tmp_path` without KERAS_BACKEND; returns
    `(returncode, stdout, stderr, backend modules imported)`."""
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-c", PROBE.format(module=module, argv=argv)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    loaded = done.stderr.rsplit("LOADED", 1)[-1].strip()
    return done.returncode, done.stdout, done.stderr, set(filter(None, loaded.split(",")))


def test_sasrec_help_imports_no_backend(tmp_path):
    code, out, err, loaded = run_example("examples.sasrec", ["--help"], tmp_path)
    assert code == 0, err
    assert "--data-dir" in out and "(default: cutbce)" in out
    assert loaded == set(), loaded


def test_ctr_help_imports_no_backend_and_is_self_contained(tmp_path):
    code, out, err, loaded = run_example("examples.ctr", ["--help"], tmp_path)
    assert code == 0, err
    assert loaded == set(), loaded
    assert "oneDNN" not in err and "cpu_feature_guard" not in err, err
    assert "table above" not in out
    text = " ".join(out.split())
    assert "erase-blocking and erase-threaded (torch)" in text
    assert "(default: ctr_ne.png)" in text and "runs/" in text


@pytest.mark.parametrize("argv,message", [
    (["--data", "movielens", "--data-dir", "/nonexistent"], "--data-dir must be an existing folder"),
    (["--data", "yambda", "--data-dir", "/nonexistent"], "--data-dir must be an existing folder"),
    (["--data", "yambda"], "--data yambda needs --data-dir"),
])
def test_sasrec_bad_data_dir_is_a_usage_error(argv, message, tmp_path):
    code, out, err, loaded = run_example("examples.sasrec", argv, tmp_path)
    assert code == 2, (out, err)
    assert "usage: python -m examples.sasrec" in err and message in err, err
    assert "Traceback" not in err
    assert loaded == set(), loaded


def test_ctr_plot_default_is_in_the_output_folder():
    from examples import DEFAULT_OUTPUT_DIR
    from examples.ctr.cli import build_parser

    parser = build_parser()
    assert parser.parse_args([]).plot == os.path.join(DEFAULT_OUTPUT_DIR, "ctr_ne.png")
    assert parser.parse_args(["--plot", "ne.png"]).plot == os.path.join(DEFAULT_OUTPUT_DIR, "ne.png")
    assert parser.parse_args(["--plot", "/tmp/x/ne.png"]).plot == "/tmp/x/ne.png"
    assert parser.parse_args(["--plot", ""]).plot == ""
    assert not os.path.isabs(parser.get_default("plot"))
