"""Builds the Cython backend (src/*.pyx) into ppo_fast; all other metadata is in pyproject.toml.

The Cython backend is the fallback for machines without numba, so a failed build does not fail
the install: it warns, and ppo_fast works on its other backends. ``PPO_FAST_REQUIRE_CYTHON=1``
makes a failed build fatal, so that CI never hides a broken one. A compiler without OpenMP gets a
serial build (the extension then says so at first use).

Flags stay portable, since this may become a wheel: no -march=native. Instead, x86-64 gets the
same kernels three times: ``_cython_kernels`` for any x86-64 CPU, ``_cython_kernels_avx2`` for
those with AVX2 and FMA, and ``_cython_kernels_avx512`` for those with AVX-512 F and DQ as well;
ppo_fast/_cython_backend.py picks the widest the CPU runs, at run time. Without hardware FMA each
fma() is a call into libm: GAE runs about 1.8 times slower than numba, and the losses, whose
polynomial exp is a chain of fma(), do not vectorize at all. AVX2 also doubles the width of the
vectorized loops. AVX-512 holds the eight float64 lanes of src/_lanes.h in one register, which
halves the instructions of the float64 row code: k3's exp ran 1.2-1.3 times numba's time without
it (numba compiles for the host, AVX-512 included).
``-ffp-contract=off`` keeps the compiler from fusing multiply-adds on its own (numba does not
contract either), so the only fused operations are the explicit fma() calls that mirror numba's
llvm.fma, and every build gives the same bits.
``-fno-trapping-math`` lets it vectorize a masked loop by computing every lane and selecting; it
changes no value (LLVM, and so numba, assumes the same).

The loss kernels' rows are C, in two headers that src/_kernels.pyx includes: src/_lanes.h (eight
explicit lanes: AVX2 and FMA intrinsics when the compiler targets them, float64 in AVX-512
registers when it targets those too, else GCC and Clang's generic vectors, else plain C) and
src/_loss_rows.h (the kernels, over those lanes). GCC vectorizes a floating-point sum only when
it may reassociate it, which would make the order of a row's sum depend on the build; explicit
lanes fix that order in the source, so every build still gives the same bits. Listing the
headers in ``depends`` makes a rebuild follow their changes and puts them in the sdist.
"""

from __future__ import annotations

import os
import platform
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import BaseError, CompileError, LinkError

REQUIRE_CYTHON = os.environ.get("PPO_FAST_REQUIRE_CYTHON", "") == "1"

PORTABLE = "ppo_fast._cython_kernels"
AVX2 = "ppo_fast._cython_kernels_avx2"
AVX512 = "ppo_fast._cython_kernels_avx512"
# The x86-64 builds beyond the portable one, and the flags each adds (GCC and Clang).
X86_64_FLAGS = {
    AVX2: ["-mavx2", "-mfma"],
    AVX512: ["-mavx2", "-mfma", "-mavx512f", "-mavx512dq"],
}
EXTENSIONS = [
    Extension(
        name,
        ["src/_kernels.pyx"],
        depends=["src/_rows.pxd", "src/_lanes.h", "src/_loss_rows.h"],
        include_dirs=["src"],
    )
    for name in (PORTABLE, AVX2, AVX512)
]

# Per compiler family: (optimisation and exact arithmetic, OpenMP compile, OpenMP link).
# MSVC does not contract under /fp:precise (its default since Visual Studio 2022).
FLAGS = {
    "msvc": (["/O2", "/fp:precise"], ["/openmp"], []),
    "unix": (["-O3", "-ffp-contract=off", "-fno-trapping-math"], ["-fopenmp"], ["-fopenmp"]),
}


def _warn(message: str) -> None:
    # pip shows a build's output only with -v or when the build fails; CI logs keep it.
    print(f"\nWARNING: ppo_fast: {message}\n", file=sys.stderr, flush=True)


class BuildCython(build_ext):
    """Cythonize and compile each extension with OpenMP, else serially, else skip it."""

    def build_extensions(self) -> None:
        family = "msvc" if self.compiler.compiler_type == "msvc" else "unix"
        x86_64 = platform.machine().lower() in ("x86_64", "amd64")
        built = []
        for extension in self.extensions:
            if extension.name in X86_64_FLAGS and not (family == "unix" and x86_64):
                continue
            try:
                built.append(self._build(extension, family))
            except Exception as error:
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
                        else "ppo_fast is installed without its Cython backend; numba and the "
                        "python oracle remain. PPO_FAST_REQUIRE_CYTHON=1 makes this fatal."
                    )
                )
        # What follows (copying into the source tree for editable installs, listing the
        # wheel's files) must only see what was built.
        self.extensions = built

    def _build(self, extension: Extension, family: str) -> Extension:
        from Cython.Build import cythonize

        # One source, three modules: each gets its own generated C, under build/.
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
        flags = flags + X86_64_FLAGS.get(extension.name, [])
        try:
            self._compile(extension, flags + openmp_compile, openmp_link)
            return extension
        except (CompileError, LinkError) as error:
            openmp_error = error
        self._compile(extension, flags, [])  # when this fails too, the extension is not built
        _warn(
            f"{extension.name} was built without OpenMP, so its kernels run on one thread: "
            f"the build with OpenMP failed ({openmp_error})"
        )
        return extension

    def _compile(self, extension: Extension, compile_args: list[str], link_args: list[str]):
        extension.extra_compile_args = compile_args
        extension.extra_link_args = link_args
        super().build_extension(extension)


setup(ext_modules=EXTENSIONS, cmdclass={"build_ext": BuildCython})
