"""The Cython backend: the kernels of src/_kernels.pyx, as built by setup.py.

Same names and signatures as the oracle, ``_reference.py``. Nothing compiles at run time and
numba is not needed: this is what ``auto`` takes when numba is missing or fails to import.
setup.py builds the kernels twice on x86-64: ``_cython_kernels`` for any CPU and
``_cython_kernels_avx2`` for CPUs with AVX2 and FMA, which this module prefers where the CPU has
them (hardware FMA matters to GAE). Both give the same bits.

This module is imported at the backend's first use (never by ``import ppo_fast``); that is when
it warns, once, if the kernels were built without OpenMP.
"""

from __future__ import annotations

import warnings

try:
    from . import _cython_kernels as _portable
except ImportError as error:
    raise ImportError(
        f"the extension ppo_fast._cython_kernels is not built ({error}): its build failed or was "
        "skipped when ppo_fast was installed; reinstall with "
        "`PPO_FAST_REQUIRE_CYTHON=1 pip install -v .` to see the compiler's error"
    ) from error

_kernels = _portable
if _portable.CPU_HAS_AVX2_FMA:
    try:
        from . import _cython_kernels_avx2 as _kernels
    except ModuleNotFoundError as error:
        if error.name != "ppo_fast._cython_kernels_avx2":
            raise
        # Not built (its build is optional): the portable kernels give the same bits.

OPENMP: bool = _kernels.OPENMP
ISA = "avx2-fma" if _kernels.BUILT_FOR_AVX2_FMA else "portable"

kl_penalty = _kernels.kl_penalty
shape_rewards = _kernels.shape_rewards
gae = _kernels.gae
moments = _kernels.moments
whiten = _kernels.whiten
clipped_surrogate = _kernels.clipped_surrogate
value_loss = _kernels.value_loss

if not OPENMP:
    warnings.warn(
        "ppo_fast's Cython backend was built without OpenMP (the compiler did not support it): "
        "its kernels run on one thread whatever num_threads says",
        RuntimeWarning,
        stacklevel=2,
    )
