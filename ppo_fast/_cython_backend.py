"""The Cython backend: the kernels of src/_kernels.pyx, as built by setup.py.

Same names and signatures as the oracle, ``_reference.py``. Nothing compiles at run time and
numba is not needed: this is what ``auto`` takes first (nothing to compile at first use).
setup.py builds the kernels three times on x86-64: ``_cython_kernels`` for any CPU,
``_cython_kernels_avx2`` for CPUs with AVX2 and FMA (hardware FMA matters to GAE), and
``_cython_kernels_avx512`` for CPUs with AVX-512 F, DQ, VL and BW too (float64 lanes in one
register: k3's exp; float32's AVX2 lanes with 32 registers). This module takes the widest the
CPU runs; ``ISA`` names it. All give the same bits.

This module is imported at the backend's first use (never by ``import ppo_fast``); that is when
it warns, once, if the kernels were built without OpenMP.
"""

from __future__ import annotations

import importlib
import warnings

from ._spec import KERNELS

try:
    from . import _cython_kernels as _portable
except ImportError as error:
    raise ImportError(
        f"the extension ppo_fast._cython_kernels is not built ({error}): its build failed or was "
        "skipped when ppo_fast was installed; reinstall with "
        "`PPO_FAST_REQUIRE_CYTHON=1 pip install -v .` to see the compiler's error"
    ) from error

# The module of each build (setup.py), which the CPU runs or not (_portable.CPU_BUILDS).
MODULES = {
    "avx512": "_cython_kernels_avx512",
    "avx2-fma": "_cython_kernels_avx2",
    "portable": "_cython_kernels",
}


def _widest_build():
    """The kernels of the widest build that was built and that this CPU runs."""
    for build in _portable.CPU_BUILDS:  # widest first, "portable" last
        name = f"{__package__}.{MODULES[build]}"
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name != name:
                raise
            # Not built (the x86-64 builds are optional): a narrower one gives the same bits.
    return _portable


_kernels = _widest_build()
OPENMP: bool = _kernels.OPENMP
ISA: str = _kernels.BUILD

# The backend interface: one function per kernel of the table (the module is generated from it),
# and the common-case entry of each kernel that has one (_backend.common).
for _name, _kernel in KERNELS.items():
    globals()[_name] = getattr(_kernels, _name)
    if _kernel.common:
        globals()[f"{_name}_common"] = getattr(_kernels, f"{_name}_common")

if not OPENMP:
    warnings.warn(
        "ppo_fast's Cython backend was built without OpenMP (the compiler did not support it): "
        "its kernels run on one thread whatever num_threads says",
        RuntimeWarning,
        stacklevel=2,
    )
