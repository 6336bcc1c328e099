"""The numba backend: one @njit kernel per stage, written over rows.

Signatures and semantics are those of the oracle, ``_reference.py``; each kernel names its
Cython twin in ``src/``. Conventions that keep them fast and exact:

- Compiled lazily at first call (no eager signatures), ``nogil``. Each kernel is built twice from
  the same source: serial, and ``parallel=True`` with ``prange`` over rows. Both do the same
  arithmetic per row and reduce per row, so results are identical bit for bit on any number of
  threads. Numba's default threading layer must not be entered from two Python threads at once
  (it aborts the process), so the parallel build runs under a lock and a call that finds the
  lock taken runs the serial build on its own thread instead.
- Positions are indexed with unsigned integers, which removes numba's negative-index
  wrap-around check from the inner loops (worth about 1.3x on GAE).
- Multiply-adds on a dependency chain use an explicit ``llvm.fma``: one rounding, half the
  latency of a multiply then an add, and the same result whatever LLVM decides elsewhere
  (implicit contraction via fastmath could differ between the serial and parallel builds).
- The on-disk cache is off by default: numba issues #4807 and #7518 (cache races between
  processes). ``PPO_FAST_NUMBA_CACHE=1`` turns it on, with a warning naming them.
"""

from __future__ import annotations

import math
import os
import threading
import warnings

import numba
import numpy as np
from llvmlite import ir
from numba import prange
from numba.core import types
from numba.extending import intrinsic

_CACHE = os.environ.get("PPO_FAST_NUMBA_CACHE", "") == "1"
if _CACHE:
    warnings.warn(
        "PPO_FAST_NUMBA_CACHE=1: numba's on-disk cache can race when several processes compile "
        "at once (numba issues #4807 and #7518); unset it if you see corrupted-cache errors",
        RuntimeWarning,
        stacklevel=2,
    )

K1, K2, K3, ABS = 0, 1, 2, 3
_U1 = np.uint64(1)


@intrinsic
def fma(typingctx, a, b, c):
    """a * b + c with a single rounding (llvm.fma on float64)."""
    signature = types.float64(types.float64, types.float64, types.float64)

    def codegen(context, builder, sig, args):
        double = ir.DoubleType()
        function = builder.module.declare_intrinsic(
            "llvm.fma", [double], ir.FunctionType(double, [double, double, double])
        )
        return builder.call(function, args)

    return signature, codegen


def _jit(function):
    return numba.njit(nogil=True, cache=_CACHE, inline="always")(function)


@_jit
def kl_value(log_ratio, estimator, clamp):
    """Twin of ``_reference.kl_value``."""
    if estimator == K1:
        value = log_ratio
    elif estimator == K2:
        value = 0.5 * log_ratio * log_ratio
    elif estimator == K3:
        value = (math.exp(-log_ratio) if -log_ratio < 709.0 else math.inf) - 1.0 + log_ratio
    else:
        value = abs(log_ratio)
    return min(max(value, -clamp), clamp)


@_jit
def is_valid(mask, i, t, length):
    return t < length and (mask.shape[0] == 0 or mask[i] != 0)


def _kl_penalty_rows(logprobs, ref_logprobs, starts, spans, estimator, clamp, out):
    """Twin: src/_kernels.pyx kl_penalty."""
    for b in prange(starts.shape[0]):
        start = np.uint64(starts[b])
        for t in range(np.uint64(spans[b])):
            i = start + t
            log_ratio = np.float64(logprobs[i]) - np.float64(ref_logprobs[i])
            out[i] = kl_value(log_ratio, estimator, clamp)


def _shape_rewards_rows(
    scores, logprobs, ref_logprobs, starts, spans, lengths, mask, kl_coef, estimator, clamp, out
):
    """Twin: src/_kernels.pyx shape_rewards."""
    for b in prange(starts.shape[0]):
        start = np.uint64(starts[b])
        span = np.uint64(spans[b])
        length = np.uint64(lengths[b])
        last = start + span  # one past the row when it has no valid position
        for k in range(span):
            t = span - _U1 - k
            if is_valid(mask, start + t, t, length):
                last = start + t
                break
        score = np.float64(scores[b])
        for t in range(span):
            i = start + t
            if is_valid(mask, i, t, length):
                log_ratio = np.float64(logprobs[i]) - np.float64(ref_logprobs[i])
                reward = -kl_coef * kl_value(log_ratio, estimator, clamp)
                out[i] = reward + (score if i == last else 0.0)
            else:
                out[i] = 0.0


def _gae_rows(
    rewards, values, starts, spans, lengths, mask, gammas, lams, bootstrap, advantages, returns
):
    """Twin: src/_kernels.pyx gae. The running state is float64 whatever the input dtype."""
    for b in prange(starts.shape[0]):
        start = np.uint64(starts[b])
        span = np.uint64(spans[b])
        length = np.uint64(lengths[b])
        gamma = gammas[b]
        gamma_lam = gamma * lams[b]
        next_value = bootstrap[b]
        running = 0.0
        for k in range(span):
            t = span - _U1 - k
            i = start + t
            if is_valid(mask, i, t, length):
                value = np.float64(values[i])
                delta = fma(gamma, next_value, np.float64(rewards[i])) - value
                running = fma(gamma_lam, running, delta)
                advantages[i] = running
                returns[i] = running + value
                next_value = value
            else:
                advantages[i] = 0.0
                returns[i] = 0.0


def _moments_rows(x, starts, spans, lengths, mask, shift, counts, sums, sums_sq):
    """Twin: src/_kernels.pyx moments."""
    for b in prange(starts.shape[0]):
        start = np.uint64(starts[b])
        length = np.uint64(lengths[b])
        count = 0.0
        total = 0.0
        total_sq = 0.0
        for t in range(np.uint64(spans[b])):
            i = start + t
            if is_valid(mask, i, t, length):
                centred = np.float64(x[i]) - shift
                count += 1.0
                total += centred
                total_sq += centred * centred
        counts[b] = count
        sums[b] = total
        sums_sq[b] = total_sq


def _whiten_rows(x, starts, spans, lengths, mask, mean, scale, offset, out):
    """Twin: src/_kernels.pyx whiten."""
    for b in prange(starts.shape[0]):
        start = np.uint64(starts[b])
        length = np.uint64(lengths[b])
        for t in range(np.uint64(spans[b])):
            i = start + t
            if is_valid(mask, i, t, length):
                out[i] = (np.float64(x[i]) - mean) / scale + offset
            else:
                out[i] = 0.0


_parallel_lock = threading.Lock()


class _Kernel:
    """A row kernel built serial and parallel from one source, compiled on first use."""

    def __init__(self, function):
        self.serial = numba.njit(nogil=True, cache=_CACHE)(function)
        self.parallel = numba.njit(nogil=True, cache=_CACHE, parallel=True)(function)

    def __call__(self, *args):
        *args, n_threads = args  # the backend signature ends with n_threads
        n_threads = min(n_threads, numba.config.NUMBA_NUM_THREADS)
        if n_threads > 1 and _parallel_lock.acquire(blocking=False):
            try:
                numba.set_num_threads(n_threads)
                self.parallel(*args)
            finally:
                _parallel_lock.release()
        else:
            self.serial(*args)


# The backend interface: same names and signatures as _reference.py.
kl_penalty = _Kernel(_kl_penalty_rows)
shape_rewards = _Kernel(_shape_rewards_rows)
gae = _Kernel(_gae_rows)
moments = _Kernel(_moments_rows)
whiten = _Kernel(_whiten_rows)
