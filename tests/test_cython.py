"""What is specific to the Cython backend; every other test runs on it too (see conftest).

Its agreement with numba and between its builds, read-only inputs, the OpenMP status, the
fallback to it when numba cannot load, and what installing does when its build fails or the
compiler has no OpenMP.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import numpy as np
import pytest
from batches import Batch, ragged_batches
from conftest import RTOL
from hypothesis import given
from hypothesis import strategies as st
from kernel_cases import cases

from ppo_fast import _cython_backend, _cython_kernels, _reference, _validate
from ppo_fast._spec import ESTIMATORS, FLAGS

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str, cwd=None, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, **env},
        timeout=300,
    )


# -- the same numbers as numba, and the same bits from every build ---------------------------


# Kernels whose gradient at a token is a function of its row's sum (GSPO's sequence form: the
# row's summed slope): numba reassociates the sum, the C row adds in order, so the gradient gets
# the tolerance of a row sum.
GRADIENTS_OF_ROW_SUMS = frozenset({"gspo"})
# Kernels whose row sums both backends take in explicit float64 lanes, in one written order: the
# same bits, sums included.
SUMS_IN_WRITTEN_LANES = frozenset({"moments"})


def tolerance(case, output: str, dtype) -> dict[str, float]:
    """How closely Cython must equal numba: the same operations in the same order, except

    k3's exp is the twins' polynomial (_exp64) on both sides, which the tolerance lets differ by an
    ulp or so should a compiler evaluate it otherwise; the loss kernels' numba twins may
    reassociate (LLVM's reassoc, which vectorizes their row sums): a few ulp per token, and sums
    in another order. The moments' sums are lanes written out on both sides: the same bits.
    """
    eps = float(np.finfo(dtype).eps)
    kernel = case.kernel
    if kernel.specialise and case.arguments[kernel.specialise] == ESTIMATORS.index("k3"):
        # exp(-r) - 1 + r cancels near r = 0: an ulp of exp is an absolute error of ~eps.
        return {"rtol": 4 * eps, "atol": 8 * eps}
    if output in kernel.gradients and kernel.name not in GRADIENTS_OF_ROW_SUMS:
        return {"rtol": 4 * eps, "atol": 0.0}
    if kernel.name in SUMS_IN_WRITTEN_LANES:
        return {"rtol": 0.0, "atol": 0.0}
    if output in {a.name for a in kernel.row_outputs} or output in kernel.gradients:
        per_token = 4 * eps if kernel.gradients else 1e-13
        return {"rtol": per_token, "atol": per_token * row_scale(case)}
    return {"rtol": 0.0, "atol": 0.0}


def row_scale(case) -> float:
    """A bound on a row sum's terms: the largest input times the longest row."""
    inputs = [case.arguments[a.name] for a in case.kernel.inputs if a.dtype != FLAGS]
    finite = [float(np.abs(x[np.isfinite(x)]).max(initial=0.0)) for x in inputs]
    spans = case.arguments["spans"]
    longest = int(spans.max()) if spans.size else 0
    return max([1.0, *finite]) ** 2 * max(1, longest)


def assert_agrees_with_numba(batch):
    from ppo_fast import _numba_kernels

    for case in cases(batch):
        expected = case.run(_numba_kernels)
        actual = case.run(_cython_backend)
        for name, output in expected.items():
            with case.described(name):
                np.testing.assert_allclose(
                    actual[name], output, **tolerance(case, name, batch.dtype)
                )


def assert_every_build_gives_the_same_bits(batch, n_threads):
    """Each wider build this CPU runs (setup.py: avx2-fma, avx512) against the portable one."""
    builds = []
    for build in _cython_kernels.CPU_BUILDS[:-1]:
        kernels = importlib.import_module(f"ppo_fast.{_cython_backend.MODULES[build]}")
        assert kernels.BUILD == build
        builds.append(kernels)
    for case in cases(batch):
        portable = case.run(_cython_kernels)
        for kernels in builds:
            wider = case.run(kernels, n_threads)
            for name, output in portable.items():
                bits = f"u{output.itemsize}"
                with case.described(f"{kernels.BUILD}: {name}"):
                    np.testing.assert_array_equal(wider[name].view(bits), output.view(bits))


needs_a_wider_build = pytest.mark.skipif(
    _cython_kernels.CPU_BUILDS == ("portable",),
    reason="this CPU runs only the portable build (no AVX2 and FMA)",
)


@pytest.mark.numba
@given(data=st.data())
def test_agrees_with_numba(dtype, data):
    """The same operations in the same order: equal to numba, NaN and inf included (within the
    tolerances of ``tolerance``). One dtype a test, drawn inside it (test_kernels.py says why)."""
    assert_agrees_with_numba(data.draw(ragged_batches(dtypes=(dtype,))))


@pytest.mark.skipif(sys.platform != "linux", reason="reads ELF section names")
def test_the_built_modules_carry_no_debug_information():
    """setup.py compiles with -g0 after Python's -g: the kernels' debug information took GCC a
    third of each build's time and was nine tenths of each module's size (the same code)."""
    found = 0
    for name in [*_cython_backend.MODULES.values(), "_checks"]:
        # found, not imported: a build wider than this CPU runs stops the process at import
        spec = importlib.util.find_spec(f"ppo_fast.{name}")
        if spec is None:
            continue  # not built here (the x86-64 builds are optional)
        found += 1
        assert b".debug_info" not in Path(spec.origin).read_bytes(), name
    assert found >= 2  # the portable kernels and the checks at least (CI requires them)


def test_the_widest_build_the_cpu_runs_is_taken():
    on_x86_64 = platform.machine().lower() in ("x86_64", "amd64")
    assert _cython_kernels.BUILD == "portable"
    assert _cython_kernels.CPU_BUILDS[-1] == "portable"
    # On x86-64, setup.py builds all three (CI makes a failed build fatal).
    assert _cython_backend.ISA == (_cython_kernels.CPU_BUILDS[0] if on_x86_64 else "portable")


def test_a_build_that_was_not_built_gives_way_to_a_narrower_one(monkeypatch):
    for build in _cython_kernels.CPU_BUILDS[:-1]:
        # What importing a module that is not there raises (None in sys.modules: the same error).
        monkeypatch.setitem(sys.modules, f"ppo_fast.{_cython_backend.MODULES[build]}", None)
        builds = _cython_kernels.CPU_BUILDS
        assert _cython_backend._widest_build().BUILD == builds[builds.index(build) + 1]


@needs_a_wider_build
@given(batch=ragged_batches(), n_threads=st.sampled_from([1, 3]))
def test_every_build_gives_the_same_bits(batch, n_threads):
    """-ffp-contract=off, explicit fma() and the loss kernels' explicit lanes (src/lanes.h):
    wider vectors and hardware FMA change no bit."""
    assert_every_build_gives_the_same_bits(batch, n_threads)


# The kernels of src/rows_*.h go through a row 8 tokens at a time (the losses in chunks of
# 256; DPPO's exps two blocks of 8 a step, then an odd block), and copy a last partial
# block into padded lanes; the policy loss and shaped rewards stop at a row's length, the value
# loss reads the padding too. Rows on either side of each of those edges:
EDGE_LENGTHS = [0, 1, 7, 8, 9, 15, 16, 17, 24, 255, 256, 257, 263, 264, 513]


@pytest.mark.numba
@pytest.mark.parametrize("layout", ["mask", "lengths", "packed"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_loss_rows_at_the_edges_of_blocks_and_chunks(layout, dtype):
    rng = np.random.default_rng(7)
    width = max(EDGE_LENGTHS) + 3
    lengths = np.array(EDGE_LENGTHS)
    if layout == "packed":
        valid = np.ones(int(lengths.sum()), dtype=bool)
        kwargs = {"cu_seqlens": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)}
    else:
        valid = np.arange(width)[None, :] < lengths[:, None]
        kwargs = {"lengths": lengths}
        if layout == "mask":
            valid &= rng.random(valid.shape) >= 0.2  # holes
            kwargs = {"mask": valid}
    batch = Batch(layout, np.dtype(dtype), valid, len(lengths), kwargs, rng)
    assert_agrees_with_numba(batch)
    assert_every_build_gives_the_same_bits(batch, n_threads=3)


# Around exp's saturation (the polynomial stops at exp(709); k3 takes e * exp(x - 1) past 708, so
# that exp(-log_ratio) overflows to inf where libm's does), infinities, NaN and signed zeros.
KL_EDGES = [np.inf, -np.inf, np.nan, 0.0, -0.0, 1.0, -707.5, -708.0, -708.5, -709.5, -710.0, 800.0]


@pytest.mark.numba
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_kl_estimators_at_the_edges_of_exp_agree_with_numba(dtype):
    from ppo_fast import _numba_kernels

    grid = np.array(KL_EDGES, dtype)
    logprobs, ref_logprobs = (np.ascontiguousarray(a.ravel()) for a in np.meshgrid(grid, grid))
    starts, spans = np.array([0], np.int64), np.array([logprobs.size], np.int64)
    builds = [
        importlib.import_module(f"ppo_fast.{_cython_backend.MODULES[build]}")
        for build in _cython_kernels.CPU_BUILDS
    ]
    for estimator in range(4):
        for clamp in (np.inf, 1.5):
            expected = np.empty_like(logprobs)
            _numba_kernels.kl_penalty(
                logprobs, ref_logprobs, starts, spans, estimator, clamp, expected, 1
            )
            for kernels in builds:
                out = np.empty_like(logprobs)
                kernels.kl_penalty(logprobs, ref_logprobs, starts, spans, estimator, clamp, out, 1)
                case = f"{kernels.BUILD} build, estimator={estimator} clamp={clamp}"
                np.testing.assert_array_equal(out, expected, err_msg=case)


# -- read-only inputs ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_read_only_inputs_are_accepted_and_read_only_outputs_refused(dtype):
    rng = np.random.default_rng(5)
    valid = rng.random((3, 7)) < 0.7
    batch = Batch("mask", np.dtype(dtype), valid, 3, {"mask": valid}, rng)
    written = set()
    for case in cases(batch):
        kernel = case.kernel
        written = {a.name for a in (*kernel.outputs, *kernel.row_outputs)}
        for name, value in case.arguments.items():
            if isinstance(value, np.ndarray) and name not in written:
                value.flags.writeable = False
        expected = case.run(_reference)
        actual = case.run(_cython_backend)
        rtol = RTOL[np.dtype(dtype)]
        for name, output in expected.items():
            finite = np.abs(output[np.isfinite(output)])
            scale = max(1.0, float(finite.max())) if finite.size else 1.0
            if name in {a.name for a in kernel.row_outputs}:
                scale *= int(case.arguments["spans"].max())  # a row sum: its terms' scale
            np.testing.assert_allclose(
                actual[name], output, rtol=rtol, atol=rtol * scale, err_msg=f"{name} {case.name}"
            )

    rows = _validate.rows(valid.shape, mask=valid)
    values, out = np.zeros(21, dtype), np.zeros(21, dtype)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        _cython_backend.whiten(
            values, rows.starts, rows.spans, rows.lengths, rows.mask, 0, 1, 0, out, 1
        )


# -- OpenMP -------------------------------------------------------------------------------------


def test_openmp_status_is_reported_and_warned_about_only_without_openmp():
    assert isinstance(_cython_backend.OPENMP, bool)
    out = run_python("""
        import sys, warnings
        sys.modules["numba"] = None  # numba loads an OpenMP runtime of its own
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from ppo_fast import _cython_backend
        runtime = None
        if sys.platform.startswith("linux"):
            maps = open("/proc/self/maps").read()
            runtime = "libgomp" in maps or "libomp" in maps or "libiomp" in maps
        print(_cython_backend.OPENMP, runtime, [str(w.message) for w in caught])
    """)
    assert out.returncode == 0, out.stderr
    openmp, runtime, warned = out.stdout.split(maxsplit=2)
    assert openmp == str(_cython_backend.OPENMP)
    if runtime != "None":
        assert runtime == openmp, "OPENMP must say whether an OpenMP runtime was linked in"
    assert ("without OpenMP" in warned) == (openmp == "False"), warned


# -- auto without numba --------------------------------------------------------------------------


def test_auto_is_cython_and_gives_the_oracles_numbers_when_numba_cannot_load():
    out = run_python("""
        import sys
        sys.modules["numba"] = None  # numba missing, or failing to import
        import numpy as np, ppo_fast

        def pipeline(dtype, backend):
            rng = np.random.default_rng(3)
            logprobs = rng.uniform(-2, 0, (5, 33)).astype(dtype)
            ref_logprobs = rng.uniform(-2, 0, (5, 33)).astype(dtype)
            values = rng.normal(size=(5, 33)).astype(dtype)
            mask = rng.random((5, 33)) < 0.8
            rewards = ppo_fast.shape_rewards(
                rng.normal(size=5), logprobs, ref_logprobs, kl_coef=0.05, estimator="k3",
                mask=mask, backend=backend,
            )
            advantages, returns = ppo_fast.gae(
                rewards, values, gamma=0.99, lam=0.95, mask=mask, backend=backend
            )
            whitened = ppo_fast.whiten(advantages, mask=mask, backend=backend)
            return rewards, advantages, returns, whitened

        assert ppo_fast.get_backend() == "cython", ppo_fast.get_backend()
        assert ppo_fast.available_backends() == ["cython", "python"]
        for dtype, rtol in ((np.float32, 1e-5), (np.float64, 1e-12)):
            for auto, oracle in zip(pipeline(dtype, None), pipeline(dtype, "python")):
                assert auto.dtype == dtype
                np.testing.assert_allclose(auto, oracle, rtol=rtol, atol=rtol)
        assert sys.modules["numba"] is None
        print("auto:", ppo_fast.get_backend())
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "auto: cython"


# -- installing: a failed build, a compiler without OpenMP ---------------------------------------


def project_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "project"
    anywhere = shutil.ignore_patterns(".*", "*.egg-info", "__pycache__", "*.so", "*.c")

    def ignore(folder: str, names: list[str]) -> set[str]:
        # The suites and build outputs at the top only: ppo_fast/bench is part of the package.
        top = {"build", "dist", "bench", "tests"} if Path(folder) == ROOT else set()
        return set(anywhere(folder, names)) | (top & set(names))

    shutil.copytree(ROOT, copy, ignore=ignore)
    return copy


# For a subprocess that imports ppo_fast from an install folder: an editable install of this
# checkout would otherwise supply the modules that folder lacks.
IMPORT_FROM_PYTHONPATH_ONLY = """
import sys
sys.meta_path = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
"""


def pip_install(source: Path, target: Path, **env: str) -> subprocess.CompletedProcess:
    """`pip install .` into a folder of its own; -v, since pip shows a build's output only so."""
    command = [sys.executable, "-m", "pip", "install", "-v", "--no-deps", "--target", target]
    return subprocess.run(
        [*command, source],
        capture_output=True,
        text=True,
        env={**os.environ, "PPO_FAST_REQUIRE_CYTHON": "0", **env},
        timeout=600,
    )


@pytest.mark.slow  # installs, or runs fresh processes: the fast lane (-m "not slow") skips it
def test_a_failed_build_installs_without_cython_unless_cython_is_required(tmp_path):
    source = project_copy(tmp_path)
    target = tmp_path / "site"
    # The portable module alone: each build is cythonized before its compiler fails, and the
    # wider builds fail the same way (test_a_build_that_was_not_built_gives_way_to_a_narrower_one).
    out = pip_install(source, target, CC="false", PPO_FAST_CYTHON_BUILDS="portable")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    log = out.stdout + out.stderr
    assert "WARNING: ppo_fast: ppo_fast._cython_kernels was not built: CompileError" in log
    assert "PPO_FAST_REQUIRE_CYTHON=1 makes this fatal" in log
    assert "WARNING: ppo_fast: ppo_fast._checks was not built: CompileError" in log
    assert "ppo_fast checks the fast paths' arguments in Python instead" in log
    assert not list(target.glob("ppo_fast/_cython_kernels*"))
    assert not list(target.glob("ppo_fast/_checks*"))

    used = run_python(
        IMPORT_FROM_PYTHONPATH_ONLY
        + textwrap.dedent("""
        import numpy as np, ppo_fast
        assert ppo_fast.__file__.startswith("{target}"), ppo_fast.__file__
        print(ppo_fast.available_backends())
        from ppo_fast import _validate
        print(
            _validate.common_case is _validate.python_common_case
            and _validate.lengths_mask is _validate.python_lengths_mask
        )
        try:
            ppo_fast.gae(np.zeros((1, 2)), np.zeros((1, 2)), backend="cython")
        except ppo_fast.BackendUnavailableError as error:
            print(error)
        """).replace("{target}", str(target)),
        cwd=tmp_path,
        PYTHONPATH=str(target),
    )
    assert used.returncode == 0, used.stderr
    backends, python_checks, error = used.stdout.splitlines()
    assert backends == "['numba', 'python']"
    assert python_checks == "True"
    assert "ppo_fast._cython_kernels is not built" in error
    assert "PPO_FAST_REQUIRE_CYTHON=1 pip install -v ." in error

    out = pip_install(
        source,
        tmp_path / "required",
        CC="false",
        PPO_FAST_REQUIRE_CYTHON="1",
        PPO_FAST_CYTHON_BUILDS="portable",
    )
    assert out.returncode != 0
    assert (
        "error: PPO_FAST_REQUIRE_CYTHON=1 and ppo_fast._cython_kernels failed to build: "
        "CompileError" in out.stdout + out.stderr
    )


@pytest.mark.slow  # installs, or runs fresh processes: the fast lane (-m "not slow") skips it
def test_a_compiler_without_openmp_gives_a_serial_build_that_says_so_at_first_use(tmp_path):
    compiler = shlex.split(sysconfig.get_config_var("CC") or "cc")[0]
    no_openmp = tmp_path / "cc-without-openmp"
    no_openmp.write_text(
        "#!/bin/sh\n"
        'for arg in "$@"; do\n'
        '  if [ "$arg" = -fopenmp ]; then echo "unsupported option -fopenmp" >&2; exit 1; fi\n'
        "done\n"
        # -O0 last (gcc takes the last -O): what is tested is the build without OpenMP, and an
        # unoptimised build of the generated module takes a fraction of the -O3 one's time.
        f'exec {shlex.quote(compiler)} "$@" -O0\n'
    )
    no_openmp.chmod(0o755)
    target = tmp_path / "site"
    # The portable module alone: what is tested is the build without OpenMP, not the ISAs.
    out = pip_install(
        project_copy(tmp_path), target, CC=str(no_openmp), PPO_FAST_CYTHON_BUILDS="portable"
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "ppo_fast._cython_kernels was built without OpenMP" in out.stdout + out.stderr
    assert not list(target.glob("ppo_fast/_cython_kernels_avx*"))  # the builds asked for only
    assert list(target.glob("ppo_fast/_checks*"))  # it needs no OpenMP

    used = run_python(
        IMPORT_FROM_PYTHONPATH_ONLY
        + textwrap.dedent("""
        import warnings
        warnings.simplefilter("error")  # import ppo_fast must not warn
        import numpy as np, ppo_fast
        assert ppo_fast.__file__.startswith("{target}"), ppo_fast.__file__
        rng = np.random.default_rng(0)
        rewards, values = rng.normal(size=(2, 3, 1 << 16))
        mask = rng.random((3, 1 << 16)) < 0.9
        ppo_fast.set_num_threads(3)  # 3 rows of 65536 positions: 3 threads, were there OpenMP
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = ppo_fast.gae(rewards, values, mask=mask, backend="cython")
            second = ppo_fast.gae(rewards, values, mask=mask, backend="cython")
        oracle = ppo_fast.gae(rewards, values, mask=mask, backend="python")
        np.testing.assert_array_equal(first.advantages, second.advantages)
        np.testing.assert_allclose(first.advantages, oracle.advantages, rtol=1e-12, atol=1e-12)
        from ppo_fast import _cython_backend
        print(_cython_backend.OPENMP, [str(w.message) for w in caught])
        """).replace("{target}", str(target)),
        cwd=tmp_path,
        PYTHONPATH=str(target),
    )
    assert used.returncode == 0, used.stderr
    openmp, warned = used.stdout.split(maxsplit=1)
    assert openmp == "False"
    assert warned.count("built without OpenMP") == 1, warned
