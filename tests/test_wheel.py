"""The package as users install it: a wheel built from the checkout, installed outside it.

The wheel is built from a copy of the files the distribution is made of
(`pip wheel --no-deps --no-build-isolation`, so nothing is downloaded and the
checkout gets no `build/` folder), installed non-editable with
`pip install --no-deps --target DIR`, and used through `PYTHONPATH=DIR` from a
folder outside the repository: both packages must import from `DIR`, and
every README python block must run there on the active backend.
"""

import email.parser
import glob
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.test_readme import README, ROOT, page_blocks, run_block

pytestmark = pytest.mark.slow

DISTRIBUTION_FILES = ("pyproject.toml", "README.md", "LICENSE", "keras_cutbce", "keras_erase")


def _pip(*args, cwd):
    done = subprocess.run([sys.executable, "-m", "pip", *args, "--no-index", "--quiet"],
                          cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"pip {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """Path of the wheel built from the checkout's distribution files."""
    source = tmp_path_factory.mktemp("source")
    for name in DISTRIBUTION_FILES:
        path = os.path.join(ROOT, name)
        if os.path.isdir(path):
            shutil.copytree(path, source / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(path, source / name)
    out = tmp_path_factory.mktemp("wheelhouse")
    _pip("wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(out), str(source),
         cwd=str(out))
    wheels = glob.glob(str(out / "*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def site(wheel, tmp_path_factory):
    """Folder the wheel is installed into (not editable), outside the repository."""
    target = tmp_path_factory.mktemp("site")
    _pip("install", "--no-deps", "--target", str(target), wheel, cwd=str(target))
    assert os.path.commonpath([str(target), ROOT]) != ROOT  # outside the repository
    return str(target)


def test_wheel_holds_both_packages_the_license_and_one_version(wheel):
    from keras_cutbce.version import __version__

    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = email.parser.Parser().parsestr(archive.read(metadata_name).decode())
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"keras_cutbce", "keras_erase"}, top
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE")
               for n in names), names
    assert metadata["Name"] == "keras-cutbce-erase"
    assert metadata["Version"] == __version__
    assert os.path.basename(wheel).startswith(f"keras_cutbce_erase-{__version__}-")


def test_both_packages_import_from_the_install(site, tmp_path):
    code = (
        "import keras_cutbce, keras_erase\n"
        "print(keras_cutbce.__file__)\n"
        "print(keras_erase.__file__)\n"
        "print(keras_cutbce.__version__, keras_erase.__version__)\n"
    )
    done = run_block(code, str(tmp_path), site)
    assert done.returncode == 0, done.stderr[-3000:]
    cutbce_file, erase_file, versions = done.stdout.strip().splitlines()[-3:]
    for path in (cutbce_file, erase_file):
        assert os.path.realpath(path).startswith(os.path.realpath(site)), path
    from keras_cutbce.version import __version__

    assert versions.split() == [__version__, __version__]


@pytest.mark.parametrize("heading,code", page_blocks(README),
                         ids=[h for h, _ in page_blocks(README)])
def test_readme_block_runs_on_the_installed_wheel(heading, code, site, tmp_path):
    check = (
        "import os as _os, keras_cutbce as _c, keras_erase as _e\n"
        f"assert all(_os.path.realpath(m.__file__).startswith({os.path.realpath(site)!r}) "
        "for m in (_c, _e)), (_c.__file__, _e.__file__)\n"
    )
    done = run_block(check + code, str(tmp_path), site)
    assert done.returncode == 0, (
        f"README block under '{heading}' failed on the installed wheel:\n{done.stderr[-3000:]}"
    )
