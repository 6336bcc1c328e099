"""The kernel table: every kernel's interface, written once.

Each backend (the oracle ``_reference.py``, ``_numba_kernels.py``, the Cython kernels generated
from ``src/_kernels.pyx.tp``) exposes one function per entry of ``KERNELS``, with the positional
arguments ``Kernel.arguments`` lists, in that order:

    inputs          token arrays read, flat (N,), C-contiguous, in the token dtype (float32 or
                    float64), or flags (dtype FLAGS: uint8, nonzero = set, one per position); an
                    optional one is passed empty, (0,), when absent
    layout          "rows": starts, spans, lengths (int64 (B,)) and mask (uint8 (N,), or (0,)
                    when every position within lengths is valid): see ``_rows.Rows``;
                    "elementwise": starts and spans only (the positions are cut into rows only so
                    that threads can share them);
                    "groups": the rows' four, then group_rows (int64 (B,): every row once,
                    ordered by group and, within a group, by row number) and group_starts (int64
                    (n_groups + 1,): group g is group_rows[group_starts[g]:group_starts[g + 1]]),
                    for a kernel that reduces across the rows of a group (``_rows.Rows``'
                    ``group_arguments``): it runs in parallel over groups, not rows
    row inputs      (B,) arrays, one value per row, float64 or in the token dtype
    scalars         float64, the token dtype (a NumPy scalar of it), or an integer code
    outputs         token arrays (or FLAGS) written at every position of every row (0 where not
                    valid)
    row outputs     float64 (B,), one value per row (sums and counts, reduced per row)
    n_threads       the threads the call may use

This module is plain Python with no import beyond the standard library: setup.py loads it by path
to generate the Cython wrappers, so the C side is written from the same table. The stages bind
their arguments by name (``Kernel.bind``); warmup, the generic differential test
(tests/test_kernels.py), the first-call probe and the benchmark registry iterate over the table.
A kernel marked ``common`` also has, on every backend, an entry for the stages' common case, with
the arguments ``Kernel.common_arguments``. Adding a kernel: CONTRIBUTING.md.
"""

from __future__ import annotations

import functools
import math
import operator
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Estimators of KL(policy || reference) per token, by code: the code is the position.
ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3", "abs")

FLOAT64, TOKEN, CODE = "float64", "token", "code"
FLAGS = "flags"  # a token array of uint8 flags (nonzero: set): a token selection
SCALES = "scales"  # a loss's row input: each row's aggregation weight, in the token dtype
# A loss's aggregation modes (``ppo_fast.loss``), by code: the code is the position. The common-case
# entry of a loss takes the code as ``agg``.
AGGREGATIONS: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)
ROWS, ELEMENTWISE, GROUPS = "rows", "elementwise", "groups"
ROW_LAYOUT = ("starts", "spans", "lengths", "mask")
GROUP_LAYOUT = (*ROW_LAYOUT, "group_rows", "group_starts")


@dataclass(frozen=True)
class Array:
    """A token array (input or output), or a per-row array (row input or row output)."""

    name: str
    dtype: str = TOKEN  # TOKEN or FLOAT64 (FLAGS: token inputs and outputs only)
    optional: bool = False  # an input that may be passed empty, (0,), when absent
    # Values the generic test and warmup draw for it: uniform in [low, high].
    low: float = -2.0
    high: float = 2.0


@dataclass(frozen=True)
class Scalar:
    """A scalar argument: FLOAT64, TOKEN (a NumPy scalar of the token dtype) or CODE (int)."""

    name: str
    dtype: str = FLOAT64
    # Values the generic test draws from (codes: every code of `choices`); the first is what
    # warmup uses.
    examples: tuple[float, ...] = ()
    choices: tuple[str, ...] = ()  # CODE: the names of the codes 0, 1, ...


@dataclass(frozen=True)
class Chunks:
    """How the long rows of a recursion are cut so that threads can share them.

    A row whose valid extent (min(length, span) positions from its start) is longer than
    ``long_row`` runs in chunks of ``size`` positions, cut at multiples of ``size`` from its
    start: fixed by the row, never by the number of threads, so that results stay identical on
    any number of threads. The work units of a call are then its other rows and these chunks
    (src/rows_gae.h says how a chunk is seeded).
    """

    long_row: int
    size: int  # a multiple of 8


@dataclass(frozen=True)
class Kernel:
    name: str
    summary: str
    inputs: tuple[Array, ...]
    layout: str = ROWS
    row_inputs: tuple[Array, ...] = ()
    scalars: tuple[Scalar, ...] = ()
    outputs: tuple[Array, ...] = ()
    row_outputs: tuple[Array, ...] = ()
    # output -> the input it is the gradient of (d loss / d input, per token)
    gradients: dict[str, str] = field(default_factory=dict)
    # A CODE scalar the compiled backends build one kernel for each value of (a run-time switch
    # in the token loop keeps it from vectorizing).
    specialise: str | None = None
    # Whether the stages have a fast path for this kernel: every backend then has an entry for its
    # common case (``common_arguments``).
    common: bool = False
    # A recursion whose long rows run in chunks (``Chunks``): the Cython backend calls its C
    # function once for the whole batch (ppo_<name>_rows_<dtype>), which runs its own threads.
    chunks: Chunks | None = None
    # A "groups" kernel that shares each group's rows among the threads itself (KL-Cov's
    # selection, whose one group is the batch): the Cython C function of a group takes n_threads
    # and the groups run in turn; numba's parallel build is the group's work with a number of
    # ranges of rows (``_numba_builds._Kernel``'s ``shared``) built with parallel=True.
    splits_groups: bool = False
    # A kernel that runs each row from its end (the recursions, GAE and the returns; whitening,
    # which follows the moments' pass up through the batch and so starts on what that pass read
    # last, still in the cache: src/rows_moments.h): every backend takes its rows from the last
    # to the first, so that a batch is one stream going down through memory. From the first row
    # up, each row's end starts a new stream that the hardware prefetchers pick up only after
    # its first misses: GAE over float32 1024 x 4096 from memory on one thread took 1.5x its
    # time on rows in the cache, and 1.1x with the rows from the last (AMD EPYC). Which row runs
    # when never changes a bit.
    backwards: bool = False

    def parallel_units(self, n_rows: int, n_positions: int) -> int:
        """At most how many units a call can share among threads: its rows, and for a kernel
        with ``chunks`` the chunks its long rows may be cut into too."""
        return n_rows if self.chunks is None else n_rows + n_positions // self.chunks.size

    @functools.cached_property
    def layout_arguments(self) -> tuple[str, ...]:
        if self.layout == ROWS:
            return ROW_LAYOUT
        if self.layout == GROUPS:
            return GROUP_LAYOUT
        return ("starts", "spans")

    @functools.cached_property
    def arguments(self) -> tuple[str, ...]:
        """The positional arguments of every backend's function, in order."""
        return (
            *(a.name for a in self.inputs),
            *self.layout_arguments,
            *(a.name for a in self.row_inputs),
            *(s.name for s in self.scalars),
            *(a.name for a in self.outputs),
            *(a.name for a in self.row_outputs),
            "n_threads",
        )

    @functools.cached_property
    def aggregates(self) -> bool:
        """Whether the kernel weights its rows by row scales (``SCALES``: a loss), which its
        common-case entry works out itself from the aggregation mode it is given (``agg``)."""
        return any(a.name == SCALES for a in self.row_inputs)

    @functools.cached_property
    def common_arguments(self) -> tuple[str, ...]:
        """The arguments of a backend's entry for the stages' common case (a kernel with
        ``common``, layout "rows"; ``_backend.common``, the Cython kernels' ``<name>_common``).

        They are: the token arrays, (B, T), C-contiguous, of one float dtype (an optional one
        empty, (0,), when absent; a FLAGS input a bool or uint8 (B, T) array); the mask, None or
        a bool or uint8 (B, T) array; for a loss (``aggregates``), ``agg``, the code of its
        aggregation mode (``AGGREGATIONS``), and ``normaliser``, the float that mode divides by
        in place of the batch's own count (num_tokens, num_seqs or loss_scale; 0.0: none, the
        batch's count); one value of each row input, the same for every row, but for a loss's
        row scales, which are not passed: the entry works them out as ``loss._row_scales`` does
        from the mode and the valid positions (token-mean: 1 / (the valid positions, or
        num_tokens); seq-mean-token-mean: 1 / (the non-empty rows, or num_seqs, x the row's valid
        positions); seq-mean-token-sum: 1 / (the non-empty rows, or num_seqs);
        seq-mean-token-sum-norm: 1 / (T, or loss_scale); 0 where that divides by 0); the
        scalars; the (B, T) outputs; n_threads. The entry returns None when the kernel has no
        row outputs, else the totals of its row outputs over the rows, each summed as
        ``row_output.sum()`` sums (NumPy's order), the first weighted row by row by a loss's row
        scale, and before them, for a loss, the valid positions (a float). Those are the general
        way's numbers (``loss._totals``), bit for bit but for the payload of a NaN
        (tests/test_fast_path.py).
        """
        return (
            *(a.name for a in self.inputs),
            "mask",
            *(["agg", "normaliser"] if self.aggregates else []),
            *(a.name for a in self.row_inputs if a.name != SCALES),
            *(s.name for s in self.scalars),
            *(a.name for a in self.outputs),
            "n_threads",
        )

    def scalar(self, name: str) -> Scalar:
        return next(s for s in self.scalars if s.name == name)

    @functools.cached_property
    def _getter(self) -> Callable[[dict[str, Any]], tuple[Any, ...]]:
        return operator.itemgetter(*self.arguments)  # C speed: bind runs on every call

    def bind(self, named: dict[str, Any]) -> tuple[Any, ...]:
        """The positional arguments from a dict of every one of them by name."""
        try:
            return self._getter(named)
        except KeyError as error:
            raise TypeError(f"kernel {self.name} needs argument {error.args[0]!r}") from None


_CLAMPS = (math.inf, 10.0, 0.3)
_LOG_RATIOS = Array("logprobs"), Array("ref_logprobs")
_GAMMAS = Array("gammas", FLOAT64, low=0.0, high=1.0)
_BOOTSTRAP = Array("bootstrap", FLOAT64)
_POLICY_INPUTS = (
    Array("logprobs", low=-3.0, high=0.0),
    Array("old_logprobs", low=-3.0, high=0.0),
    Array("advantages"),
    Array("weights", optional=True, low=0.0, high=2.0),
)
_SCALES = Array("scales", TOKEN, low=0.0, high=1.0)
# gspo's codes: how the gradient reaches the tokens. "detached" (verl): each token's ratio is
# sg(s) * exp(logp - sg(logp)), so a token's gradient is its own term's; "sequence" (TRL,
# OpenRLHF): the ratio s = exp(mean log-ratio) itself, so every token of a row gets the row's.
GSPO_FORMS = ("detached", "sequence")
# dppo's codes: the trust region's divergence between the sampled token's probabilities.
DIVERGENCES = ("tv", "kl")
# zero_tail's codes: whether the unique longest row of a group gets no baseline past the
# second-longest row's length.
ZERO_TAIL = ("off", "on")

# GAE's rows longer than 65,536 positions of valid extent run in chunks of 16,384 (the sizes'
# measurements: src/rows_gae.h).
GAE_CHUNKS = Chunks(long_row=1 << 16, size=1 << 14)

KERNELS: dict[str, Kernel] = {
    kernel.name: kernel
    for kernel in (
        Kernel(
            "kl_penalty",
            "per-token KL estimate, elementwise",
            inputs=_LOG_RATIOS,
            layout=ELEMENTWISE,
            scalars=(
                Scalar("estimator", CODE, choices=ESTIMATORS),
                Scalar("clamp", examples=_CLAMPS),
            ),
            outputs=(Array("kl"),),
            specialise="estimator",
        ),
        Kernel(
            "shape_rewards",
            "KL-shaped rewards, the score on each row's last valid token",
            inputs=_LOG_RATIOS,
            row_inputs=(Array("scores", FLOAT64),),
            scalars=(
                Scalar("kl_coef", examples=(0.05, 0.0, 1.5)),
                Scalar("estimator", CODE, choices=ESTIMATORS),
                Scalar("clamp", examples=_CLAMPS),
            ),
            outputs=(Array("rewards"),),
            specialise="estimator",
        ),
        Kernel(
            "gae",
            "GAE advantages and returns, float64 state",
            inputs=(Array("rewards"), Array("values")),
            row_inputs=(_GAMMAS, Array("lams", FLOAT64, low=0.0, high=1.0), _BOOTSTRAP),
            outputs=(Array("advantages"), Array("returns")),
            common=True,
            chunks=GAE_CHUNKS,
            backwards=True,
        ),
        Kernel(
            "discounted_returns",
            "discounted returns (reward-to-go), float64 state",
            inputs=(Array("rewards"),),
            row_inputs=(_GAMMAS, _BOOTSTRAP),
            outputs=(Array("returns"),),
            backwards=True,
        ),
        Kernel(
            "remax",
            "discounted returns, and returns minus each row's baseline (ReMax)",
            inputs=(Array("rewards"),),
            row_inputs=(_GAMMAS, _BOOTSTRAP, Array("baselines", FLOAT64)),
            outputs=(Array("advantages"), Array("returns")),
            backwards=True,
        ),
        Kernel(
            "optimal_token_baseline",
            "returns minus the group's optimal baseline at each valid-token index (OTB)",
            inputs=(
                Array("rewards"),
                Array("old_logprobs", low=-3.0, high=0.0),
                Array("sum_pi_squared", low=0.0, high=1.0),
                Array("is_weights", optional=True, low=0.0, high=2.0),
            ),
            layout=GROUPS,
            row_inputs=(_GAMMAS, _BOOTSTRAP),
            scalars=(
                Scalar("eps", examples=(1e-8, 0.0, 0.5, 1.0)),
                Scalar("zero_tail", CODE, choices=ZERO_TAIL),
            ),
            outputs=(Array("advantages"), Array("returns")),
        ),
        Kernel(
            "moments",
            "per-row count, sum and sum of squares of x - shift (float64)",
            inputs=(Array("x"),),
            scalars=(Scalar("shift", examples=(0.0, 0.7)),),
            row_outputs=(
                Array("counts", FLOAT64),
                Array("sums", FLOAT64),
                Array("sums_sq", FLOAT64),
            ),
            common=True,
        ),
        Kernel(
            "whiten",
            "(x - mean) * scale + offset at the valid positions",
            inputs=(Array("x"),),
            scalars=(
                Scalar("mean", examples=(0.0, 0.3)),
                Scalar("scale", examples=(1.0, 0.01, 7.0)),
                Scalar("offset", examples=(0.0, 0.3)),
            ),
            outputs=(Array("whitened"),),
            common=True,
            backwards=True,
        ),
        Kernel(
            "clipped_surrogate",
            "PPO's clipped surrogate: per-row loss sums, d loss / d logprobs and statistics",
            inputs=(
                Array("logprobs", low=-3.0, high=0.0),
                Array("old_logprobs", low=-3.0, high=0.0),
                Array("advantages"),
                Array("weights", optional=True, low=0.0, high=2.0),
            ),
            row_inputs=(Array("scales", TOKEN, low=0.0, high=1.0),),
            scalars=(
                Scalar("ratio_low", TOKEN, examples=(0.8, 0.0, 0.95)),
                Scalar("ratio_high", TOKEN, examples=(1.28, 1.2, math.inf)),
                Scalar("dual_clip", TOKEN, examples=(3.0, math.inf, 1.01)),
                Scalar("log_ratio_clamp", TOKEN, examples=(20.0, math.inf, 0.1)),
            ),
            outputs=(Array("grad"),),
            row_outputs=(
                Array("row_loss", FLOAT64),
                Array("row_clipped", FLOAT64),
                Array("row_dual", FLOAT64),
                Array("row_kl", FLOAT64),
            ),
            gradients={"grad": "logprobs"},
            common=True,
        ),
        Kernel(
            "reinforce",
            "REINFORCE / GPG (-A log pi), with DRO's quadratic log-ratio penalty when beta > 0: "
            "per-row loss sums, d loss / d logprobs and the KL sum",
            inputs=_POLICY_INPUTS,
            row_inputs=(_SCALES,),
            scalars=(Scalar("beta", TOKEN, examples=(0.0, 0.1, 3.0)),),
            outputs=(Array("grad"),),
            row_outputs=(Array("row_loss", FLOAT64), Array("row_kl", FLOAT64)),
            gradients={"grad": "logprobs"},
            common=True,
        ),
        Kernel(
            "cispo",
            "CISPO: the clipped ratio, held constant, times -A log pi: per-row loss sums, "
            "d loss / d logprobs and statistics",
            inputs=_POLICY_INPUTS,
            row_inputs=(_SCALES,),
            scalars=(
                Scalar("ratio_low", TOKEN, examples=(0.8, 0.0, 0.95)),
                Scalar("ratio_high", TOKEN, examples=(1.28, 1.2, math.inf)),
                Scalar("log_ratio_clamp", TOKEN, examples=(20.0, math.inf, 0.1)),
            ),
            outputs=(Array("grad"),),
            row_outputs=(
                Array("row_loss", FLOAT64),
                Array("row_clipped", FLOAT64),
                Array("row_lower", FLOAT64),
                Array("row_kl", FLOAT64),
            ),
            gradients={"grad": "logprobs"},
            common=True,
        ),
        Kernel(
            "sapo",
            "SAPO: a sigmoid gate of the ratio, one temperature for A > 0 and one for A <= 0: "
            "per-row loss sums, d loss / d logprobs and the KL sum",
            inputs=_POLICY_INPUTS,
            row_inputs=(_SCALES,),
            scalars=(
                Scalar("tau_pos", TOKEN, examples=(1.0, 0.1, 10.0)),
                Scalar("tau_neg", TOKEN, examples=(1.05, 3.0, 0.5)),
                Scalar("log_ratio_clamp", TOKEN, examples=(20.0, math.inf, 0.1)),
            ),
            outputs=(Array("grad"),),
            row_outputs=(Array("row_loss", FLOAT64), Array("row_kl", FLOAT64)),
            gradients={"grad": "logprobs"},
            common=True,
        ),
        Kernel(
            "gspo",
            "GSPO: the clipped surrogate on each row's sequence ratio exp(mean log-ratio), a "
            "pre-pass per row: per-row loss sums, d loss / d logprobs and statistics",
            inputs=_POLICY_INPUTS,
            row_inputs=(_SCALES,),
            scalars=(
                Scalar("ratio_low", TOKEN, examples=(0.8, 0.0, 0.95)),
                Scalar("ratio_high", TOKEN, examples=(1.28, 1.2, math.inf)),
                Scalar("dual_clip", TOKEN, examples=(3.0, math.inf, 1.01)),
                Scalar("log_ratio_max", TOKEN, examples=(10.0, math.inf, 0.05)),
                Scalar("form", CODE, choices=GSPO_FORMS),
            ),
            outputs=(Array("grad"),),
            row_outputs=(
                Array("row_loss", FLOAT64),
                Array("row_clipped", FLOAT64),
                Array("row_lower", FLOAT64),
                Array("row_kl", FLOAT64),
            ),
            gradients={"grad": "logprobs"},
            common=True,
        ),
        Kernel(
            "geo_mean",
            "verl's geometric-mean loss (GMPO): -mean(A) * exp(mean clipped log-ratio) per row, "
            "a pre-pass per row: per-row loss sums, d loss / d logprobs and statistics",
            inputs=(
                *_POLICY_INPUTS[:3],
                Array("weights", optional=True, low=0.1, high=2.0),
            ),
            row_inputs=(_SCALES,),
            scalars=(
                Scalar("log_ratio_low", TOKEN, examples=(0.2, 0.0, math.inf)),
                Scalar("log_ratio_high", TOKEN, examples=(0.28, 1.0, math.inf)),
            ),
            outputs=(Array("grad"),),
            row_outputs=(
                Array("row_loss", FLOAT64),
                Array("row_clipped", FLOAT64),
                Array("row_lower", FLOAT64),
                Array("row_kl", FLOAT64),
            ),
            gradients={"grad": "logprobs"},
            common=True,
        ),
        Kernel(
            "dppo",
            "DPPO: -A * sg(min(rho, cap)) * log pi where the binary TV or KL divergence of the "
            "token's probability is within the trust region: per-row loss sums, d loss / d "
            "logprobs and statistics",
            inputs=_POLICY_INPUTS,
            row_inputs=(_SCALES,),
            scalars=(
                Scalar("divergence", CODE, choices=DIVERGENCES),
                # a bound of 0 (the binary KL's minimum), and inf with the other bound finite
                Scalar("divergence_low", TOKEN, examples=(0.2, 0.0, math.inf)),
                Scalar("divergence_high", TOKEN, examples=(0.28, math.inf, 0.01)),
                Scalar("ratio_cap", TOKEN, examples=(20.0, math.inf, 1.0)),
                Scalar("log_ratio_clamp", TOKEN, examples=(20.0, math.inf, 0.1)),
            ),
            outputs=(Array("grad"),),
            row_outputs=(
                Array("row_loss", FLOAT64),
                Array("row_outside", FLOAT64),
                Array("row_capped", FLOAT64),
                Array("row_kl", FLOAT64),
            ),
            gradients={"grad": "logprobs"},
            common=True,
        ),
        Kernel(
            "kl_cov",
            "KL-Cov: -A * rho, plus coef * |log rho| at the selected tokens: per-row loss sums, "
            "d loss / d logprobs and statistics",
            inputs=(*_POLICY_INPUTS, Array("selected", FLAGS)),
            row_inputs=(_SCALES,),
            scalars=(Scalar("coef", TOKEN, examples=(0.1, 0.0, 1.5)),),
            outputs=(Array("grad"),),
            row_outputs=(
                Array("row_loss", FLOAT64),
                Array("row_penalised", FLOAT64),
                Array("row_abs_kl", FLOAT64),
            ),
            gradients={"grad": "logprobs"},
            common=True,
        ),
        Kernel(
            "kl_cov_top_k",
            "KL-Cov's selection: 1 at the k = max(1, floor(ratio * n)) valid tokens of largest "
            "(A - mean A) * (logp - mean logp) over the group's n valid tokens, 0 elsewhere",
            inputs=(Array("logprobs", low=-3.0, high=0.0), Array("advantages")),
            layout=GROUPS,
            scalars=(Scalar("ratio", examples=(0.0002, 0.3, 1.0, 7.0)),),
            outputs=(Array("selected", FLAGS),),
            splits_groups=True,
        ),
        Kernel(
            "value_loss",
            "clipped value loss: per-row loss sums, d loss / d values and the clipped count",
            inputs=(Array("values"), Array("old_values"), Array("returns")),
            row_inputs=(Array("scales", TOKEN, low=0.0, high=1.0),),
            scalars=(Scalar("clip", TOKEN, examples=(0.2, math.inf, 0.0)),),
            outputs=(Array("grad"),),
            row_outputs=(Array("row_loss", FLOAT64), Array("row_clipped", FLOAT64)),
            gradients={"grad": "values"},
            common=True,
        ),
    )
}


# -- exp -----------------------------------------------------------------------------------------
#
# The compiled kernels' vectorizable exp (numba's _exp32/_exp64 and src/exp.h's, which the
# generated Cython defines these for): x = n ln2 + r, |r| <= ln2/2, exp(x) = 2^n p(r), n rounded by
# the 1.5 * 2^(mantissa bits) shift trick, 2^n built from its exponent bits, inputs saturated so
# that 2^n stays a normal number.


def _float32(x: float) -> float:
    """x rounded to float32 (as a Python float), so that C and numba read the same constant."""
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclass(frozen=True)
class ExpConstants:
    low: float
    high: float
    shift: float
    log2e: float
    ln2_high: float
    ln2_low: float
    polynomial: tuple[float, ...]


EXP64 = ExpConstants(
    low=-708.0,
    high=709.0,
    shift=6755399441055744.0,  # 1.5 * 2^52
    log2e=1.4426950408889634,
    ln2_high=6.93147180369123816490e-01,  # n * ln2_high is exact
    ln2_low=1.90821492927058770002e-10,
    # Taylor to degree 12: the remainder is below 2e-16 relative on |r| <= ln2/2.
    polynomial=(
        2.08767569878680989792e-09,
        2.50521083854417187751e-08,
        2.75573192239858906526e-07,
        2.75573192239858906526e-06,
        2.48015873015873015873e-05,
        1.98412698412698412698e-04,
        1.38888888888888888889e-03,
        8.33333333333333333333e-03,
        4.16666666666666666667e-02,
        1.66666666666666666667e-01,
        0.5,
        1.0,
        1.0,
    ),
)
EXP32 = ExpConstants(
    low=_float32(-87.3),
    high=_float32(88.3),
    shift=12582912.0,  # 1.5 * 2^23
    log2e=_float32(1.44269504),
    ln2_high=0.693359375,  # Cephes' two-part ln2
    ln2_low=_float32(-2.12194440e-4),
    # Cephes' expf minimax polynomial (its last steps, p * r * r + r + 1, are in the code).
    polynomial=tuple(
        _float32(c)
        for c in (
            1.9875691500e-4,
            1.3981999507e-3,
            8.3334519073e-3,
            4.1665795894e-2,
            1.6666665459e-1,
            5.0000001201e-1,
        )
    ),
)


# -- log -----------------------------------------------------------------------------------------
#
# The compiled kernels' vectorizable log (numba's _log32/_log64 and src/log.h's): x = 2^k m with m
# in [sqrt(2)/2, sqrt(2)), found from the bits (fdlibm's method: adding 1 - sqrt(2)/2 to the bits
# carries into the exponent exactly when m >= sqrt(2)), f = m - 1 (exact), s = f / (2 + f) and
# log(1 + f) = f - (f^2/2 - s (f^2/2 + R(s^2))), with R(z) = sum_k 2 z^k / (2k + 1) (the series of
# 2 atanh(s) / s - 2, |s| <= 0.1716), and k ln2 added in the two parts of exp's ln2.


@dataclass(frozen=True)
class LogConstants:
    offset: int  # the bits of 1.0 minus those of sqrt(2)/2 (rounded down)
    sqrt_half_bits: int  # the bits of sqrt(2)/2
    mantissa_bits: int  # the width of the mantissa
    bias: int
    smallest_normal: float
    subnormal_scale_bits: int  # a subnormal is scaled by 2^this first
    polynomial: tuple[float, ...]  # R(z) / z, highest power first


def _series(terms: int, rounded: Callable[[float], float]) -> tuple[float, ...]:
    return tuple(rounded(2.0 / (2 * k + 1)) for k in range(terms, 0, -1))


LOG64 = LogConstants(
    offset=0x3FF00000_00000000 - 0x3FE6A09E_00000000,
    sqrt_half_bits=0x3FE6A09E_00000000,
    mantissa_bits=52,
    bias=1023,
    smallest_normal=2.2250738585072014e-308,
    subnormal_scale_bits=54,
    # ten terms: the remainder is below 1e-18 relative on |s| <= 0.1716
    polynomial=_series(10, float),
)
LOG32 = LogConstants(
    offset=0x3F800000 - 0x3F3504F3,
    sqrt_half_bits=0x3F3504F3,
    mantissa_bits=23,
    bias=127,
    smallest_normal=_float32(1.1754943508222875e-38),
    subnormal_scale_bits=25,
    # four terms: the remainder is below 3e-9 relative (float32's half ulp is 3e-8)
    polynomial=_series(4, _float32),
)
