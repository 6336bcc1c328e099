"""Builds the Cython backend (src/*.pyx) into ppo_fast; all other metadata is in pyproject.toml.

The Cython backend is the fallback for machines without numba, so a failed build does not fail
the install: it warns, and ppo_fast works on its other backends. ``PPO_FAST_REQUIRE_CYTHON=1``
makes a failed build fatal, so that CI never hides a broken one. A compiler without OpenMP gets a
serial build (the extension then says so at first use).

Flags stay portable, since this may become a wheel: no -march=native. Instead, x86-64 gets the
same kernels three times: ``_cython_kernels`` for any x86-64 CPU, ``_cython_kernels_avx2`` for
those with AVX2 and FMA, and ``_cython_kernels_avx512`` for those with AVX-512 F, DQ, VL and BW;
ppo_fast/_cython_backend.py picks the widest the CPU runs, at run time. Without hardware FMA each
fma() is a call into libm: GAE runs about 1.8 times slower than numba, and the losses, whose
polynomial exp is a chain of fma(), do not vectorize at all. AVX2 also doubles the width of the
vectorized loops. AVX-512 holds the eight float64 lanes of src/lanes.h in one register, which
halves the instructions of the float64 row code: k3's exp ran 1.2-1.3 times numba's time without
it (numba compiles for the host, AVX-512 included).
``-ffp-contract=off`` keeps the compiler from fusing multiply-adds on its own (numba does not
contract either), so the only fused operations are the explicit fma() calls that mirror numba's
llvm.fma, and every build gives the same bits.
``-fno-trapping-math`` lets it vectorize a masked loop by computing every lane and selecting; it
changes no value (LLVM, and so numba, assumes the same).

The Cython module is generated: ``render_kernels`` renders src/_kernels.pyx.tp with the kernel
table of ppo_fast/_spec.py into src/_kernels.pyx (not committed), so that the Cython functions,
their arguments and the C declarations of the row kernels come from the same table as every other
backend. The rows themselves are hand-written C in headers named for what they hold: src/lanes.h
(eight explicit lanes: AVX2 and FMA intrinsics when the compiler targets them, float64 in AVX-512
registers when it targets those too, else GCC and Clang's generic vectors, else plain C), src/exp.h
and src/rows.h with one src/rows_*.h per family of kernels. GCC vectorizes a floating-point sum
only when it may reassociate it, which would make the order of a row's sum depend on the build;
explicit lanes fix that order in the source, so every build still gives the same bits. Listing the
template, the table and the headers in ``depends`` makes a rebuild follow their changes and puts
them in the sdist.

The three builds compile at once, one compiler process each (as many as there are cores): each is
a GCC run of about 30 s on the same generated C, so on two cores the install took 95 s one after
another and 65 s so (measured with `python setup.py build_ext --inplace --force`). Without debug
information (``-g0``, below) the AVX2 build is a GCC run of 36-40 s on the AMD EPYC (51-57 s with
it), and `pip install --no-deps -e .` took 87 s there (124 s with it; 120 s of CPU against 176).

A fourth, small module, ``ppo_fast._checks`` (src/_checks.pyx), is the stages' common-case test of
their arguments in C, read from the arrays' fields with NumPy's headers (hence numpy in the build
requirements); without it ppo_fast runs the same test in Python (``_validate``), so it fails the
install only under ``PPO_FAST_REQUIRE_CYTHON=1``, like the kernels.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import platform
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import BaseError, CompileError, LinkError

REQUIRE_CYTHON = os.environ.get("PPO_FAST_REQUIRE_CYTHON", "") == "1"
# PPO_FAST_CYTHON_BUILDS=portable (or a comma list of portable, avx2, avx512): build only those
# of the three x86-64 modules, for a faster build (every build gives the same bits; the widest
# one built that the CPU runs is used). Default: all three.
BUILDS = {
    name.strip()
    for name in os.environ.get("PPO_FAST_CYTHON_BUILDS", "portable,avx2,avx512").split(",")
    if name.strip()
}

TEMPLATE = "src/_kernels.pyx.tp"
GENERATED = "src/_kernels.pyx"  # not committed: rendered at every build
SPEC = "ppo_fast/_spec.py"

PORTABLE = "ppo_fast._cython_kernels"
AVX2 = "ppo_fast._cython_kernels_avx2"
AVX512 = "ppo_fast._cython_kernels_avx512"
CHECKS = "ppo_fast._checks"
# The x86-64 builds beyond the portable one, and the flags each adds (GCC and Clang). The
# AVX-512 build takes VL and BW too, which every CPU with F and DQ has (Skylake-SP and later,
# Zen 4): its float32 code, AVX2 intrinsics, is then encoded with EVEX and has 32 vector registers
# instead of 16 (float32 (1024, 4096) one thread, in a loop of calls: the clipped surrogate 4.51
# -> 4.16 ms, GSPO 3.75 -> 3.46, SAPO 5.75 -> 4.89; the same instructions' results, the same bits).
X86_64_FLAGS = {
    AVX2: ["-mavx2", "-mfma"],
    AVX512: ["-mavx2", "-mfma", "-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw"],
}
HEADERS = [
    "src/lanes.h",
    "src/exp.h",
    "src/log.h",
    "src/totals.h",
    "src/rows.h",
    *sorted(glob.glob("src/rows_*.h")),
]
# NumPy's C API as of 1.7 only: no deprecated names.
NUMPY_API = ("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")

EXTENSIONS = [
    Extension(
        name,
        [GENERATED],
        depends=[TEMPLATE, SPEC, *HEADERS],
        include_dirs=["src"],
    )
    for name in (PORTABLE, AVX2, AVX512)
] + [Extension(CHECKS, ["src/_checks.pyx"], define_macros=[NUMPY_API])]

# Per compiler family: (optimisation and exact arithmetic, OpenMP compile, OpenMP link).
# MSVC does not contract under /fp:precise (its default since Visual Studio 2022).
# -g0 (after Python's own CFLAGS, which carry -g): no debug information. GCC took longer over the
# kernels' DWARF than over their code: the AVX2 build of the generated C 51-57 s -> 36-40 s on one
# core of the AMD EPYC, its object 21.6 MB -> 1.1 MB, the machine code (.text) byte for byte the
# same in the portable, AVX2 and AVX-512 builds.
FLAGS = {
    "msvc": (["/O2", "/fp:precise"], ["/openmp"], []),
    "unix": (
        ["-O3", "-g0", "-ffp-contract=off", "-fno-trapping-math"],
        ["-fopenmp"],
        ["-fopenmp"],
    ),
}


def render_kernels() -> None:
    """Render the Cython backend from its template and the kernel table (ppo_fast/_spec.py).

    The table is loaded by path, not imported as part of ppo_fast: it needs only the standard
    library, while the package needs numpy, which building does not.
    """
    from Cython import Tempita

    spec = importlib.util.spec_from_file_location("ppo_fast_kernel_table", SPEC)
    table = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = table  # dataclasses look their module up while the class is built
    spec.loader.exec_module(table)
    with open(TEMPLATE) as f:
        template = Tempita.Template(f.read(), name=TEMPLATE)
    text = template.substitute(
        KERNELS=table.KERNELS,
        ESTIMATORS=table.ESTIMATORS,
        EXP32=table.EXP32,
        EXP64=table.EXP64,
        LOG32=table.LOG32,
        LOG64=table.LOG64,
    )
    old = open(GENERATED).read() if os.path.exists(GENERATED) else None
    if text != old:  # an unchanged file keeps its time, so that nothing rebuilds for nothing
        with open(GENERATED, "w") as f:
            f.write(text)


def _build_name(module: str) -> str | None:
    """The name of a build of the kernels in PPO_FAST_CYTHON_BUILDS, None for the checks."""
    return {PORTABLE: "portable", AVX2: "avx2", AVX512: "avx512"}.get(module)


def _warn(message: str) -> None:
    # pip shows a build's output only with -v or when the build fails; CI logs keep it.
    print(f"\nWARNING: ppo_fast: {message}\n", file=sys.stderr, flush=True)


_cythonize_lock = threading.Lock()


class BuildCython(build_ext):
    """Cythonize and compile each extension with OpenMP, else serially, else skip it."""

    def build_extensions(self) -> None:
        render_kernels()
        family = "msvc" if self.compiler.compiler_type == "msvc" else "unix"
        x86_64 = platform.machine().lower() in ("x86_64", "amd64")
        built = []
        unknown = BUILDS - {"portable", "avx2", "avx512"}
        if unknown:
            raise BaseError(
                f"PPO_FAST_CYTHON_BUILDS names {sorted(unknown)}: use a comma list of "
                "portable, avx2 and avx512"
            )
        wanted = [
            extension
            for extension in self.extensions
            if (extension.name not in X86_64_FLAGS or (family == "unix" and x86_64))
            and _build_name(extension.name) in (*BUILDS, None)
        ]
        # The compiler runs in a process of its own, so threads overlap the builds; setuptools'
        # own parallel build_ext calls the same compiler object from threads.
        with ThreadPoolExecutor(max(1, min(len(wanted), os.cpu_count() or 1))) as pool:
            outcomes = list(pool.map(lambda e: self._try_build(e, family), wanted))
        for extension, error in zip(wanted, outcomes, strict=True):
            if error is None:
                built.append(extension)
                continue
            if REQUIRE_CYTHON:
                raise BaseError(
                    f"PPO_FAST_REQUIRE_CYTHON=1 and {extension.name} failed to build: "
                    f"{type(error).__name__}: {error}"
                ) from error
            _warn(
                f"{extension.name} was not built: {type(error).__name__}: {error}\n"
                + (
                    "ppo_fast's Cython backend uses a narrower build instead (same bits)."
                    if extension.name in X86_64_FLAGS
                    else "ppo_fast checks the fast paths' arguments in Python instead (the same "
                    "answers, about half a microsecond more a call). PPO_FAST_REQUIRE_CYTHON=1 "
                    "makes this fatal."
                    if extension.name == CHECKS
                    else "ppo_fast is installed without its Cython backend; numba and the "
                    "python oracle remain. PPO_FAST_REQUIRE_CYTHON=1 makes this fatal."
                )
            )
        # What follows (copying into the source tree for editable installs, listing the
        # wheel's files) must only see what was built.
        self.extensions = built

    def _try_build(self, extension: Extension, family: str) -> Exception | None:
        """Build ``extension``: None, or the error that stopped it."""
        try:
            self._build(extension, family)
        except Exception as error:
            return error
        return None

    def _build(self, extension: Extension, family: str) -> None:
        from Cython.Build import cythonize

        # One source, three modules: each gets its own generated C, under build/. Cython's
        # compiler keeps global state, so one thread at a time runs it (1.5 s a module).
        with _cythonize_lock:
            (cythonized,) = cythonize(
                [extension],
                include_path=["src"],
                build_dir=os.path.join(self.build_temp, extension.name),
                force=self.force,
                quiet=True,
            )
        # Keep setuptools' own Extension object: it carries what build_ext set up for it.
        extension.sources = cythonized.sources
        flags, openmp_compile, openmp_link = FLAGS[family]
        if extension.name == CHECKS:  # no loops to parallelise: no OpenMP
            import numpy

            extension.include_dirs = [numpy.get_include()]
            self._compile(extension, flags, [])
            return
        flags = flags + X86_64_FLAGS.get(extension.name, [])
        try:
            self._compile(extension, flags + openmp_compile, openmp_link)
            return
        except (CompileError, LinkError) as error:
            openmp_error = error
        self._compile(extension, flags, [])  # when this fails too, the extension is not built
        _warn(
            f"{extension.name} was built without OpenMP, so its kernels run on one thread: "
            f"the build with OpenMP failed ({openmp_error})"
        )

    def _compile(self, extension: Extension, compile_args: list[str], link_args: list[str]):
        extension.extra_compile_args = compile_args
        extension.extra_link_args = link_args
        super().build_extension(extension)


setup(ext_modules=EXTENSIONS, cmdclass={"build_ext": BuildCython})
