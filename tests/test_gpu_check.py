"""The GPU check meets its machine: the offline install, the preflight, the CutBCE part's dry run.

`scripts/gpu_check.sh --wheels DIR` runs on a machine without network whose `python3` (itself a
virtualenv) holds torch, Triton and JAX but not Keras. Here a stand-in for that machine is made
from this environment: a virtualenv whose packages are this one's, Keras, namex, optree and the
project left out; `--prepare` fetches the wheels (the package index, or the pip cache), and
`--wheels DIR --install-only` must install them offline over the stand-in's torch and import
the project from the installed wheel. Run once (torch backend).
"""

import os
import re
import subprocess
import sys
import sysconfig
import tomllib

import pytest

from tests.backend_utils import BACKEND

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import gpu_preflight  # noqa: E402

once = pytest.mark.skipif(BACKEND != "torch", reason="backend-independent: runs once, on torch")
# What the GPU machine lacks (and the stand-in leaves out); the project's own install files too.
LEFT_OUT = ("keras", "namex", "optree", "keras_cutbce", "keras_erase", "__editable__")


def test_the_preflights_minimums_are_pyprojects_lower_bounds():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    bounds = dict(re.match(r"([\w-]+)>=([\d.]+)$", r).groups()
                  for r in project["dependencies"] + project["optional-dependencies"]["torch"]
                  if ">=" in r)
    assert gpu_preflight.MINIMUMS["torch"][0] == bounds["torch"] == "2.11"
    assert gpu_preflight.MINIMUMS["keras"][0] == bounds["keras"]
    assert project["requires-python"] == ">=" + ".".join(map(str, gpu_preflight.PYTHON))


def test_the_preflight_names_each_version_too_old_and_why():
    found = {"keras": "3.15.1", "torch": "2.10.1+cu128", "triton": None, "numpy": "2.4.0"}
    problems = gpu_preflight.version_problems(found, python=(3, 10))
    assert len(problems) == 3
    assert problems[0].startswith("Python 3.11 or newer is needed")
    assert "torch >= 2.11 is needed, 2.10.1+cu128 is installed: the oldest torch" in problems[1]
    assert problems[2].startswith("triton >= 3.6 is needed and not installed: the fused CutBCE")
    ok = dict(found, torch="2.11.0+cu130", triton="3.6.0")
    assert gpu_preflight.version_problems(ok, python=(3, 12)) == []
    # a dry run needs no Triton, but not an old one
    assert gpu_preflight.version_problems(dict(ok, triton=None), (3, 12), dry_run=True) == []
    assert gpu_preflight.version_problems(dict(ok, triton="3.5.1"), (3, 12), dry_run=True)


def test_the_preflight_names_a_package_that_does_not_import_without_a_traceback(tmp_path):
    """torch installed but broken (say, built for another CUDA): one STOP line, exit 1."""
    broken = tmp_path / "torch"
    broken.mkdir()
    (broken / "__init__.py").write_text(
        "raise OSError('loading the CUDA runtime\\nlibcudart.so.13: cannot open shared object file')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]), KERAS_BACKEND="torch")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_preflight.py"), "--dry-run"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stderr.strip().splitlines() == [
        "gpu_preflight: STOP: torch does not import: OSError: libcudart.so.13: cannot open shared object file"]
    assert "Traceback" not in out.stdout + out.stderr


def _stand_in(folder, leave_out=()):
    """A 'GPU machine' python3: a virtualenv seeing this environment's packages, minus some."""
    here = sysconfig.get_path("purelib")
    site = folder / "site"
    site.mkdir(parents=True)
    for name in os.listdir(here):
        if not name.lower().startswith(LEFT_OUT + tuple(leave_out)):
            os.symlink(os.path.join(here, name), site / name)
    machine = folder / "machine"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(machine)], check=True)
    target = subprocess.run([str(machine / "bin" / "python"), "-c",
                             "import sysconfig; print(sysconfig.get_path('purelib'))"],
                            capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(target, "machine.pth"), "w") as f:
        f.write(f"import site; site.addsitedir({str(site)!r})\n")
    return machine


def _check(machine, wheels, venv, *args, **environment):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PATH=f"{machine / 'bin'}{os.pathsep}{env['PATH']}", GPU_CHECK_VENV=str(venv),
               **environment)
    return subprocess.run(["bash", SCRIPT, "--wheels", str(wheels), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wheels")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    env = dict(os.environ, GPU_CHECK_PY_VERSION=version, GPU_CHECK_HOST_PYTHON=sys.executable)
    done = subprocess.run(["bash", SCRIPT, "--prepare", str(folder)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0 and re.search(r"(?i)connection|network|resolve|timed out", done.stderr):
        pytest.skip(f"--prepare needs the package index: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stdout + done.stderr
    names = sorted(os.listdir(folder))
    assert [n.split("-")[0] for n in names] == ["cut_cross_entropy", "keras", "keras_cutbce_erase",
                                                 "liger_kernel", "namex", "optree"]  # the peers beside Keras
    assert sum(os.path.getsize(folder / n) for n in names) < 5 * 2**20  # a few MB
    return folder


@once
@pytest.mark.slow
def test_the_offline_install_imports_the_wheel_over_the_machines_torch(wheels, tmp_path):
    machine = _stand_in(tmp_path)
    venv = tmp_path / "check_venv"
    done = _check(machine, wheels, venv, "--dry-run", "--install-only")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    purelib = r"lib/python3\.\d+/site-packages"
    assert re.search(rf"keras 3\.15\.1 from {re.escape(str(venv))}/{purelib}/keras", out), out
    assert re.search(rf"keras-cutbce-erase \S+ from {re.escape(str(venv))}/{purelib}", out), out
    assert re.search(rf"torch \S+ from {re.escape(str(tmp_path / 'site'))}/torch", out), out
    assert "dry run: no CUDA check" in out
    # and the check runs there: the ERASE benchmark's dry run, small (the tests run in the suite), with the
    # budget of a CPU (the list gives the section the H200's 120 s)
    results = tmp_path / "results"
    done = _check(machine, wheels, venv, "--dry-run", "--models", "ctr", "--batches", "8",
                  "--modes", "standard", "threaded+graphs", "--steps", "2", "--warmup", "4", "--budget", "600",
                  "--plan", "full",
                  GPU_CHECK_PHASES="erase", GPU_CHECK_OUT=str(results))
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "gpu_check: passed" in out, out[-3000:]
    assert "Every planned cell ran" in (results / "erase_gpu.md").read_text()


@once
def test_a_host_python_without_wheels_is_refused_not_ignored():
    """`GPU_CHECK_HOST_PYTHON` is what `--wheels` installs over; without it the check would run .venv's."""
    env = dict(os.environ, GPU_CHECK_HOST_PYTHON=sys.executable)
    done = subprocess.run(["bash", SCRIPT, "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1 and "add --wheels DIR" in done.stderr, done.stdout + done.stderr


@once
@pytest.mark.slow
def test_a_dependency_the_machine_lacks_stops_the_install_naming_it(wheels, tmp_path):
    machine = _stand_in(tmp_path, leave_out=("rich",))
    done = _check(machine, wheels, tmp_path / "check_venv", "--dry-run", "--install-only")
    assert done.returncode != 0
    assert re.search(r"(?i)no matching distribution found for rich", done.stdout + done.stderr)


@once
@pytest.mark.slow
def test_the_cutbce_part_runs_every_section_in_the_interpreter(tmp_path):
    """`cutbce_triton.py --gpu --cpu-dry-run`: each section's code runs, both loss families (numbers mean nothing)."""
    if subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_preflight.py"),
                       "--triton-interpreter"], capture_output=True).returncode != 0:
        pytest.skip("Triton's interpreter cannot run the kernels here (gpu_preflight.py says why)")
    import json

    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "cutbce_triton.py"),
                           "--gpu", "--cpu-dry-run", "--budget", "600", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, KERAS_BACKEND="torch"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "cutbce_triton_gpu.json").read_text())
    assert report["errors"] == [] and report["skipped"] == []
    sections = report["sections"]
    assert list(sections) == ["peers", "chunked_tiles", "jit", "parity", "timings", "float16_zeros",
                              "mixed_bfloat16", "graph_breaks", "sweep", "ncu"]
    # the side by side: ours (op and Keras loss) and tuned dense, eager and compiled, both families
    for family in ("bce", "softmax"):
        timed = {r["implementation"] for r in sections["peers"] if r["family"] == family and "median_ms" in r}
        assert {"dense", "dense_compiled", "ours_op", "ours_keras_loss"} <= timed, (family, timed)
    assert all(isinstance(r["error_vs_float64"], float) and r["error_vs_float64"] < 1e-5
               for r in sections["peers"] if "median_ms" in r)
    assert all(r["within_limit"] for r in sections["parity"])
    for name in set(sections) - {"ncu"}:  # both loss families in every section
        assert {r["family"] for r in sections[name]} == {"bce", "softmax"}, name
    assert {r["implementation"] for r in sections["parity"]} == {"dense", "chunked", "triton"}
    assert {r["implementation"] for r in sections["timings"]} == {"dense", "chunked", "triton"}
    # The first GPU run decides full fp32's route (docs/cutbce.md): Triton against chunked at L = 8.
    timed = {(r["family"], r["variant"], r["implementation"])
             for r in sections["timings"] if r["targets"] == 8}
    assert {(f, "ieee", i) for f in ("bce", "softmax") for i in ("chunked", "triton")} <= timed
    assert sections["ncu"] == [{"ran": False, "why": "dry run"}]
    # softmax's columns kernel at 1 stage beside the table's 2 (Triton 3.6's narrow copies)
    stages = {tuple(r["columns_block"])[3] for r in sections["sweep"] if r["family"] == "softmax"}
    assert stages == {1, 2}


NCU_RAW = '''==PROF== Connected to process 4242
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","sm__warps_active.avg.per_cycle_active","smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio","smsp__average_warps_issue_stalled_wait_per_issue_active.ratio","smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio","smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio","smsp__inst_executed.sum","smsp__issue_active.avg.pct_of_peak_sustained_active"
"","","","","","","","warp","ratio","ratio","ratio","ratio","inst","%"
"0","4242","python3","h200","rows_kernel","1","7","15.8","0.42","0.31","1.07","0.02","8,192,000","74.5"
"1","4242","python3","h200","columns_kernel(float*, int)","1","7","14.1","2.50","0.20","0.11","0.90","6,144,000","40.0"
==PROF== Disconnected from process 4242
'''


@once
def test_the_check_is_one_priority_list_that_fits_its_call():
    """Issue 48/49: the peers and tuned dense first (~90 s), ERASE's cells (~120 s), the GPU tests, then the
    sweeps and the rest, in <= 8 minutes with the install; a section that does not fit is named, not dropped."""
    done = subprocess.run(["bash", SCRIPT, "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, GPU_CHECK_PLAN="print"))
    assert done.returncode == 0, done.stdout + done.stderr
    plan = [(name, int(seconds)) for name, seconds in map(str.split, done.stdout.strip().splitlines())]
    assert [name for name, _ in plan] == ["peers", "erase", "erase_tests", "capture", "cutbce_tests", "matrix",
                                          "cutbce_rest"]
    assert dict(plan)["peers"] == 90 and dict(plan)["erase"] == 120
    assert 20 + sum(seconds for _, seconds in plan) + 15 <= 480  # install, the list, the slack
    script = open(SCRIPT).read()
    assert 'SKIPPED+=("$name: needs ~$seconds s, $left s left")' in script


def test_nsight_compute_counters_are_read_per_kernel_and_logit():
    from tools.nsight_compute import parse_ncu_csv

    rows = parse_ncu_csv(NCU_RAW, logits=4_096_000)
    assert [r["kernel"] for r in rows] == ["rows_kernel", "columns_kernel"]
    assert rows[0]["instructions_per_logit"] == pytest.approx(2.0)
    assert rows[1]["instructions_per_logit"] == pytest.approx(1.5)
    assert rows[0]["issue_active_pct"] == 74.5 and rows[0]["warps_per_sm"] == 15.8
    assert rows[0]["top_stalls"] == "math_pipe_throttle 1.07, long_scoreboard 0.42, wait 0.31"
    assert rows[1]["top_stalls"].startswith("long_scoreboard 2.50, barrier 0.90")
    with pytest.raises(ValueError, match="no ncu metrics"):
        parse_ncu_csv("==ERROR== LibraryNotLoaded", logits=1)
