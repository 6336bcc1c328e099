"""The numba backend's vectorizable exp and log (twins: src/exp.h, src/log.h and the lane forms of
src/lanes.h), with the constants of the kernel table (_spec.EXP32, EXP64, LOG32, LOG64, which the
Cython build reads too). Shared pieces of the backend are in ``_numba_core.py``."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic, models, overload, register_model

from ._numba_core import _AVX512, _U8, _as_float_bits, _as_int_bits, _jit, _select, fma
from ._numba_lanes import (
    _LANES,
    _lanes_add,
    _lanes_any_at_least,
    _lanes_clip,
    _lanes_gt,
    _lanes_load,
    _lanes_mul,
    _lanes_negative,
    _lanes_splat,
    _lanes_store,
    _lanes_sub,
    _lanes_where,
    _lanes_where_valid,
    _with_lane,
)
from ._spec import EXP32, EXP64, LOG32, LOG64

# exp by range reduction and a polynomial, with the constants of the kernel table (_spec.EXP64 and
# _spec.EXP32, which the Cython build reads too): x = n ln2 + r, |r| <= ln2/2, exp(x) = 2^n p(r),
# with n rounded by the 1.5 * 2^(mantissa bits) shift trick and 2^n built from its exponent bits.
# All of it is plain arithmetic LLVM vectorizes (math.exp is a libm call that it cannot: PyPI's
# llvmlite has no SVML). Finite inputs are saturated so that 2^n stays a normal number: the result
# is finite for every finite input, within 2 ulp of exp in float64 and 1 ulp in float32
# (tests/test_loss.py); below exp(-708) (float64) or exp(-87.3) (float32) it returns that bound
# instead of a subnormal, above exp(709) or exp(88.3) that bound instead of overflowing. NaN, inf
# and -inf give NaN, inf and 0, as math.exp: a non-finite input is never made finite.
_F32 = np.float32
# numba reads globals as constants: plain numbers and tuples, not the table's records.
_E64_LOW, _E64_HIGH, _E64_SHIFT = EXP64.low, EXP64.high, EXP64.shift
_E64_LOG2E, _E64_LN2_HIGH, _E64_LN2_LOW = EXP64.log2e, EXP64.ln2_high, EXP64.ln2_low
_P64 = EXP64.polynomial
_F64_SHIFT_BITS = np.int64(np.float64(_E64_SHIFT).view(np.int64))
_E32_LOW, _E32_HIGH, _E32_SHIFT = _F32(EXP32.low), _F32(EXP32.high), _F32(EXP32.shift)
_E32_LOG2E, _E32_LN2_HIGH = _F32(EXP32.log2e), _F32(EXP32.ln2_high)
_E32_LN2_LOW = _F32(EXP32.ln2_low)
_P32 = tuple(_F32(c) for c in EXP32.polynomial)
_F32_SHIFT_BITS = np.int32(_E32_SHIFT.view(np.int32))


@_jit
def _exact_where_nonfinite(x, y):
    """y = exp(x) as computed, except where x is not finite: the saturation is for finite
    arguments only, and NaN, inf and -inf come out as math.exp's (NaN, inf, 0)."""
    y = y - y if x == -np.inf else y
    y = x if x == np.inf else y
    return y if x == x else x


@intrinsic
def _opaque(typingctx, x):
    """x, as a value LLVM cannot see the constant of (an empty inline asm that returns its
    operand in a vector register). A loop's constants so made before it stay in registers or
    stack slots: as constants, under the register pressure of AVX2's 16 vector registers, LLVM
    remakes each at every use, two instructions with numba's large code model (the constant's
    64-bit address, then a broadcast load): the clipped surrogate's exp pre-pass took 56
    instructions per 8 tokens so and 41 with the constants made before its loop (AMD EPYC,
    AVX2); AVX-512's 32 registers hold them as they are (exp_constants gives them so there)."""
    if x not in (types.float32, types.float64):
        return None

    def codegen(context, builder, sig, args):
        item = context.get_value_type(sig.args[0])
        return builder.asm(ir.FunctionType(item, [item]), "", "=x,0", [args[0]], False)

    return x(x), codegen


_E64_CONSTANTS = (_E64_LOW, _E64_HIGH, _E64_SHIFT, _E64_LOG2E, _E64_LN2_HIGH, _E64_LN2_LOW, *_P64)
_E32_CONSTANTS = (
    _E32_LOW, _E32_HIGH, _E32_SHIFT, _E32_LOG2E, _E32_LN2_HIGH, _E32_LN2_LOW, *_P32, _F32(1.0)
)  # fmt: skip


@_jit
def _exp64_with(argument, constants):
    low, high, shift, log2e, ln2_high, ln2_low = constants[:6]
    x = min(max(argument, low), high)
    shifted = fma(x, log2e, shift)  # x / ln2 + shift
    n = shifted - shift
    r = fma(-n, ln2_high, x)  # ln2 in two parts: exact n * ln2_high
    r = fma(-n, ln2_low, r)
    p = fma(constants[6], r, constants[7])
    p = fma(p, r, constants[8])
    p = fma(p, r, constants[9])
    p = fma(p, r, constants[10])
    p = fma(p, r, constants[11])
    p = fma(p, r, constants[12])
    p = fma(p, r, constants[13])
    p = fma(p, r, constants[14])
    p = fma(p, r, constants[15])
    p = fma(p, r, constants[16])
    p = fma(p, r, constants[17])
    p = fma(p, r, constants[18])
    exponent = _as_int_bits(shifted) - _F64_SHIFT_BITS
    power = _as_float_bits((exponent + np.int64(1023)) << np.int64(52))
    return _exact_where_nonfinite(argument, p * power)


@_jit
def _exp32_with(argument, constants):
    low, high, shift, log2e, ln2_high, ln2_low = constants[:6]
    x = min(max(argument, low), high)
    shifted = fma(x, log2e, shift)
    n = shifted - shift
    r = fma(-n, ln2_high, x)
    r = fma(-n, ln2_low, r)
    p = fma(constants[6], r, constants[7])
    p = fma(p, r, constants[8])
    p = fma(p, r, constants[9])
    p = fma(p, r, constants[10])
    p = fma(p, r, constants[11])
    p = fma(p * r, r, r) + constants[12]
    exponent = _as_int_bits(shifted) - _F32_SHIFT_BITS
    # numba widens int32 arithmetic to int64: narrow back so the bits are a float32's.
    power = _as_float_bits(np.int32((exponent + 127) << 23))
    return _exact_where_nonfinite(argument, p * power)


@_jit
def _exp64(argument):
    return _exp64_with(argument, _E64_CONSTANTS)


def exp_poly(x):
    """exp in the dtype of x (float32 or float64), vectorizable; see _exp64_with and
    _exp32_with. In a loop, exp_with(x, exp_constants(x)) with the constants made before it."""


def exp_constants(like):
    """exp_with's constants for the dtype of ``like`` (a float or an array of floats), opaque
    (_opaque) where numba compiles without AVX-512: make them once before a loop of exps, not in
    it (LLVM does not move an asm out of a loop before it vectorizes the loop, and a loop with
    one stays scalar: 7.4 ns a token instead of about 1)."""


def exp_with(x, constants):
    """exp_poly(x) with its constants given (exp_constants): the same bits."""


@overload(exp_poly, inline="always")
def _exp_poly_overload(x):
    if x == types.float32:
        return lambda x: _exp32_with(x, _E32_CONSTANTS)
    if x == types.float64:
        return lambda x: _exp64_with(x, _E64_CONSTANTS)
    return None


@overload(exp_constants, inline="always")
def _exp_constants_overload(like):
    dtype = like.dtype if isinstance(like, types.Array) else like
    constants = {types.float32: _E32_CONSTANTS, types.float64: _E64_CONSTANTS}.get(dtype)
    if constants is None:
        return None
    if _AVX512:  # AVX-512's 32 registers hold them: the table's numbers as constants
        return lambda like: constants
    # a tuple of the table's numbers, each through _opaque (written out: numba builds a tuple
    # of a fixed length, not one from a loop)
    items = ", ".join(f"_opaque(constants[{k}])" for k in range(len(constants)))
    namespace = {"_opaque": _opaque, "constants": constants}
    exec(f"def make(like):\n    return ({items},)", namespace)
    return namespace["make"]


@overload(exp_with, inline="always")
def _exp_with_overload(x, constants):
    if x == types.float32:
        return lambda x, constants: _exp32_with(x, constants)
    if x == types.float64:
        return lambda x, constants: _exp64_with(x, constants)
    return None


# log by range reduction and a series, with the constants of the kernel table (_spec.LOG64 and
# _spec.LOG32, which the Cython build reads too; the method is described there): plain arithmetic
# and selects that LLVM vectorizes, as exp. Within 1 ulp of math.log in both dtypes
# (tests/test_policy_token.py), subnormal arguments included (scaled by 2^54 or 2^25 first);
# +0 and -0 give -inf, a negative argument NaN, inf inf and NaN NaN, as numpy's log. Its rounding
# depends on the order of the operations: it runs in functions compiled without fastmath.
_L64_OFFSET, _L64_SQRT_HALF = np.int64(LOG64.offset), np.int64(LOG64.sqrt_half_bits)
_L64_MANTISSA = np.int64((1 << LOG64.mantissa_bits) - 1)
_L64_SHIFT, _L64_BIAS = np.int64(LOG64.mantissa_bits), np.int64(LOG64.bias)
_L64_TINY, _L64_SCALE = LOG64.smallest_normal, float(2**LOG64.subnormal_scale_bits)
_L64_SCALE_BITS = np.int64(LOG64.subnormal_scale_bits)
_Q64 = LOG64.polynomial
_L32_OFFSET, _L32_SQRT_HALF = np.int64(LOG32.offset), np.int64(LOG32.sqrt_half_bits)
_L32_MANTISSA = np.int64((1 << LOG32.mantissa_bits) - 1)
_L32_SHIFT, _L32_BIAS = np.int64(LOG32.mantissa_bits), np.int64(LOG32.bias)
_L32_TINY, _L32_SCALE = _F32(LOG32.smallest_normal), _F32(2**LOG32.subnormal_scale_bits)
_L32_SCALE_BITS = np.int64(LOG32.subnormal_scale_bits)
_Q32 = tuple(_F32(c) for c in LOG32.polynomial)


@_jit
def _log64(x):
    tiny = x < _L64_TINY
    scaled = _select(tiny, x * _L64_SCALE, x)
    bits = _as_int_bits(scaled) + _L64_OFFSET
    k = (bits >> _L64_SHIFT) - _L64_BIAS - (_L64_SCALE_BITS if tiny else np.int64(0))
    m = _as_float_bits((bits & _L64_MANTISSA) + _L64_SQRT_HALF)
    f = m - 1.0
    half_square = 0.5 * f * f
    s = f / (2.0 + f)
    z = s * s
    r = fma(_Q64[0], z, _Q64[1])
    r = fma(r, z, _Q64[2])
    r = fma(r, z, _Q64[3])
    r = fma(r, z, _Q64[4])
    r = fma(r, z, _Q64[5])
    r = fma(r, z, _Q64[6])
    r = fma(r, z, _Q64[7])
    r = fma(r, z, _Q64[8])
    r = fma(r, z, _Q64[9]) * z
    n = np.float64(k)
    y = n * _E64_LN2_HIGH - ((half_square - (s * (half_square + r) + n * _E64_LN2_LOW)) - f)
    y = _select(x == np.inf, x, y)
    y = _select(x == 0.0, -np.inf, y)
    return _select(x < 0.0, np.nan, _select(x == x, y, x))


@_jit
def _log32(x):
    tiny = x < _L32_TINY
    scaled = _select(tiny, x * _L32_SCALE, x)
    bits = np.int64(_as_int_bits(scaled)) + _L32_OFFSET
    k = (bits >> _L32_SHIFT) - _L32_BIAS - (_L32_SCALE_BITS if tiny else np.int64(0))
    # numba widens int32 arithmetic to int64: narrow back so the bits are a float32's.
    m = _as_float_bits(np.int32((bits & _L32_MANTISSA) + _L32_SQRT_HALF))
    one = _F32(1.0)
    f = m - one
    half_square = _F32(0.5) * f * f
    s = f / (_F32(2.0) + f)
    z = s * s
    r = fma(_Q32[0], z, _Q32[1])
    r = fma(r, z, _Q32[2])
    r = fma(r, z, _Q32[3]) * z
    n = _F32(k)
    y = n * _E32_LN2_HIGH - ((half_square - (s * (half_square + r) + n * _E32_LN2_LOW)) - f)
    y = _select(x == _F32(np.inf), x, y)
    y = _select(x == _F32(0.0), _F32(-np.inf), y)
    return _select(x < _F32(0.0), _F32(np.nan), _select(x == x, y, x))


def log_poly(x):
    """log in the dtype of x (float32 or float64), vectorizable; see _log64 and _log32."""


@overload(log_poly, inline="always")
def _log_poly_overload(x):
    if x == types.float32:
        return lambda x: _log32(x)
    if x == types.float64:
        return lambda x: _log64(x)
    return None


# -- AVX-512's exp of the losses' clipped log-ratios, a register at a time ----------------------
# Twin: src/lanes.h ppo_exp32_bounded_ps16 and ppo_exp64_bounded_pd8. Where numba compiles for
# AVX-512, the losses' ratio pre-pass (_numba_losses._chunk_ratios) runs a 64-byte register of
# exps at a time in three fewer kinds of steps than exp_with's vectorized form, with the same
# bits: the clip to [-clamp, clamp] and exp's saturation in one pair of max and min (their bounds
# met: the clamp is >= 0), 2^n p(r) in one vscalefps (p times an exact power of 2, one rounding,
# as p * power), and what a non-finite argument gives (NaN, inf, 0) in one vfixupimmps, by the
# class of the raw log-ratio: NaN is the clipped argument's NaN, bit for bit, and +-inf reach
# exp only without a clamp. The table's nibbles, by class: QNaN, SNaN, 0, 1, -inf, +inf,
# negative, positive; 0 keeps exp's value, 1 takes the argument, 8 is +0.
EXP_FIXUP_UNCLAMPED = 0x00180011
EXP_FIXUP_CLAMPED = 0x00000011  # only NaN: a finite clamp leaves no infinite argument


class _RegisterType(types.Type):
    """One 64-byte register of a float dtype (<16 x float>, <8 x double>): exp_registers'."""

    def __init__(self, dtype):
        self.dtype = dtype
        super().__init__(name=f"Register({dtype} x {64 // (dtype.bitwidth // 8)})")


def _register_vector(dtype):
    item = ir.FloatType() if dtype == types.float32 else ir.DoubleType()
    return ir.VectorType(item, 64 // (dtype.bitwidth // 8))


@register_model(_RegisterType)
class _RegisterModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _register_vector(fe_type.dtype))


_REGISTER_CONSTANTS = {types.float32: _E32_CONSTANTS, types.float64: _E64_CONSTANTS}
_REGISTERS_OF = {
    dtype: types.UniTuple(_RegisterType(dtype), len(constants))
    for dtype, constants in _REGISTER_CONSTANTS.items()
}


@intrinsic
def exp_registers(typingctx, like):
    """The exp's constants (exp_constants' numbers) for the dtype of ``like`` (an array or a
    float), each in a 64-byte register behind an empty asm that LLVM cannot see through: made
    before a loop of register exps (_exp_register), they stay in registers through it. Made as
    constants in the loop, numba's code model (64-bit addresses) took a movabs and a load for
    each in every trip: 23 of the 75 instructions of k3's block of 8 in shape_rewards, and 4
    more reloaded the loop's pointers from the stack for want of general registers."""
    dtype = like.dtype if isinstance(like, types.Array) else like
    if dtype not in _REGISTER_CONSTANTS:
        return None
    constants = _REGISTER_CONSTANTS[dtype]

    def codegen(context, builder, sig, args):
        vector_type = _register_vector(dtype)
        values = [
            ir.Constant(vector_type, [float(value)] * vector_type.count) for value in constants
        ]
        if _AVX512:  # elsewhere no register holds them, and the register exps are not run
            asm_type = ir.FunctionType(vector_type, [vector_type])
            made = {}  # equal constants in one register (float64's last two coefficients, 1)
            for value in constants:
                if value not in made:
                    constant = ir.Constant(vector_type, [float(value)] * vector_type.count)
                    made[value] = builder.asm(asm_type, "", "=v,0", [constant], False)
            values = [made[value] for value in constants]
        return context.make_tuple(builder, sig.return_type, values)

    return _REGISTERS_OF[dtype](like), codegen


def _exp_register(builder, raw, low, high, table, item_type, registers):
    """exp(min(high, max(low, raw))) on one register (<16 x float> or <8 x double>), fixed up by
    ``table`` (a vfixupimm table, splat) at raw's non-finite lanes; its other constants from
    ``registers`` (exp_registers' values, in _E32_CONSTANTS' or _E64_CONSTANTS' order)."""
    vector_type = raw.type
    lanes = vector_type.count
    bits = 32 if item_type == types.float32 else 64
    # the bounds are the caller's (low, high); float32's polynomial ends with the 1 added last
    _, _, shift, log2e, ln2_high, ln2_low, *polynomial = registers

    def declare(name, argument_types):
        try:
            return builder.module.get_global(name)
        except KeyError:
            return ir.Function(builder.module, ir.FunctionType(vector_type, argument_types), name)

    suffix = f"v{lanes}f{bits}"
    fma_function = declare(f"llvm.fma.{suffix}", [vector_type] * 3)

    def fma_(a, b, c):
        return builder.call(fma_function, [a, b, c])

    x = builder.select(builder.fcmp_ordered(">", low, raw), low, raw)
    x = builder.select(builder.fcmp_ordered("<", high, x), high, x)
    shifted = fma_(x, log2e, shift)
    n = builder.fsub(shifted, shift)
    negative_n = builder.fneg(n)
    r = fma_(negative_n, ln2_high, x)
    r = fma_(negative_n, ln2_low, r)
    if bits == 32:
        *polynomial, one = polynomial
    p = polynomial[0]
    for coefficient in polynomial[1:]:
        p = fma_(p, r, coefficient)
    if bits == 32:
        p = builder.fadd(fma_(builder.fmul(p, r), r, r), one)
    mask_type = ir.IntType(lanes)
    i32 = ir.IntType(32)
    kind = "ps" if bits == 32 else "pd"
    scalef = declare(
        f"llvm.x86.avx512.mask.scalef.{kind}.512",
        [vector_type, vector_type, vector_type, mask_type, i32],
    )
    y = builder.call(scalef, [p, n, vector_type(None), mask_type(-1), i32(4)])
    integer_vector = ir.VectorType(ir.IntType(bits), lanes)
    fixup = declare(
        f"llvm.x86.avx512.mask.fixupimm.{kind}.512",
        [vector_type, vector_type, integer_vector, i32, mask_type, i32],
    )
    return builder.call(fixup, [y, raw, table, i32(0), mask_type(-1), i32(4)])


@intrinsic
def clipped_exps(typingctx, logprobs, old_logprobs, i, low, high, table, out, j, registers):
    """out[j .. j + w) = exp(clip(logprobs[i + k] - old_logprobs[i + k], -clamp, clamp)) for
    k < w, w = 64 bytes of the dtype (16 float32, 8 float64): one AVX-512 register
    (_exp_register; only where numba compiles for AVX-512). ``low`` and ``high``: the clip's
    bounds met with exp's saturation (max(-clamp, low), min(clamp, high) in the dtype), ``table``
    EXP_FIXUP_CLAMPED where the clamp is finite, else EXP_FIXUP_UNCLAMPED; ``registers``:
    exp_registers of the dtype."""
    if not isinstance(logprobs, types.Array) or logprobs.dtype not in (
        types.float32,
        types.float64,
    ):
        return None
    dtype = logprobs.dtype
    if registers != _REGISTERS_OF[dtype]:
        return None

    def codegen(context, builder, sig, args):
        logprobs_, old_, i_, low_, high_, table_, out_, j_, registers_ = args
        item = context.get_value_type(dtype)
        lanes = 64 // (dtype.bitwidth // 8)
        vector_type = ir.VectorType(item, lanes)
        align = dtype.bitwidth // 8

        def pointer(array_type, array, index):
            data = context.make_array(array_type)(context, builder, array).data
            return builder.bitcast(builder.gep(data, [index]), vector_type.as_pointer())

        def splat(value, value_type):
            vector = builder.insert_element(
                ir.Constant(value_type, ir.Undefined), value, ir.Constant(ir.IntType(32), 0)
            )
            zeros = ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes)
            return builder.shuffle_vector(vector, ir.Constant(value_type, ir.Undefined), zeros)

        raw = builder.fsub(
            builder.load(pointer(sig.args[0], logprobs_, i_), align=align),
            builder.load(pointer(sig.args[1], old_, i_), align=align),
        )
        integer = ir.IntType(dtype.bitwidth)
        table_value = context.cast(builder, table_, sig.args[5], types.int64)
        if dtype.bitwidth == 32:
            table_value = builder.trunc(table_value, integer)
        result = _exp_register(
            builder, raw, splat(low_, vector_type), splat(high_, vector_type),
            splat(table_value, ir.VectorType(integer, lanes)), dtype,
            cgutils.unpack_tuple(builder, registers_),
        )  # fmt: skip
        builder.store(result, pointer(sig.args[6], out_, j_), align=align)
        return context.get_dummy_value()

    return types.none(logprobs, old_logprobs, i, low, high, table, out, j, registers), codegen


@_jit
def exp_bounds(clamp, constants):
    """clipped_exps' bounds for a clamp >= 0: max(-clamp, exp's low) and min(clamp, exp's high)
    (exp_constants' first two), with the twins' max and min."""
    low, high = constants[0], constants[1]
    return _select(-clamp > low, -clamp, low), _select(clamp < high, clamp, high)


@intrinsic
def exp64_lanes(typingctx, lanes, registers):
    """exp of eight float64 lanes in one AVX-512 register (_exp_register, exp's own saturation
    and every non-finite class fixed up: _exp64's bits; only where numba compiles for AVX-512),
    its constants from ``registers`` (exp_registers of a float64)."""
    if lanes != _LANES or registers != _REGISTERS_OF[types.float64]:
        return None

    def codegen(context, builder, sig, args):
        values = cgutils.unpack_tuple(builder, args[1])
        return _exp_register(
            builder, args[0], values[0], values[1],
            ir.Constant(ir.VectorType(ir.IntType(64), 8), [EXP_FIXUP_UNCLAMPED] * 8),
            types.float64, values,
        )  # fmt: skip

    return _LANES(_LANES, registers), codegen


_E = 2.718281828459045  # math.e, as kl_value's correction past 708
_U16 = np.uint64(16)


@_jit
def k3_lanes(log_ratio, clamps, negative_clamps, registers):
    """kl_value's k3 of eight float64 log-ratios, clipped to [-clamp, clamp] (twin: src/rows_kl.h
    ppo_kl_values with PPO_K3): exp(-log_ratio) by exp64_lanes, e * exp(-log_ratio - 1) past 708
    in a block that has such a lane (elsewhere the correction subtracts 0 and multiplies by 1,
    which changes no bit). The bits of _numba_kernels.kl_value, lane by lane."""
    one = _lanes_splat(1.0)
    x = _lanes_negative(log_ratio)
    if _lanes_any_at_least(x, 708.0):
        beyond = _lanes_gt(x, _lanes_splat(708.0))
        shifted = _lanes_sub(x, _lanes_where(beyond, one, _lanes_splat(0.0)))
        exp_neg = _lanes_mul(
            exp64_lanes(shifted, registers), _lanes_where(beyond, _lanes_splat(_E), one)
        )
    else:
        exp_neg = exp64_lanes(x, registers)
    value = _lanes_add(_lanes_sub(exp_neg, one), log_ratio)
    return _lanes_clip(value, negative_clamps, clamps)


@_jit
def k3_lanes_at(logprobs, ref_logprobs, i, clamps, negative_clamps, registers):
    """k3_lanes of positions i .. i + 7 of the two arrays (their log-ratios in float64)."""
    log_ratio = _lanes_sub(_lanes_load(logprobs, i), _lanes_load(ref_logprobs, i))
    return k3_lanes(log_ratio, clamps, negative_clamps, registers)


@_jit
def k3_blocks(logprobs, ref_logprobs, start, end, clamp, kl):
    """kl_penalty's k3 (k3_lanes, clipped to [-clamp, clamp]) from position start of a row into
    kl, 16 positions a step, two registers whose exp chains interleave (the twin's steps: k3 is
    bound by their latency); returns where the step stopped (fewer than 16 positions before
    end: the caller's)."""
    clamps, negative_clamps = _lanes_splat(clamp), _lanes_splat(-clamp)
    registers = exp_registers(0.0)
    i = start
    while i + _U16 <= end:
        first = k3_lanes_at(logprobs, ref_logprobs, i, clamps, negative_clamps, registers)
        second = k3_lanes_at(logprobs, ref_logprobs, i + _U8, clamps, negative_clamps, registers)
        _lanes_store(kl, i, first)
        _lanes_store(kl, i + _U8, second)
        i += _U16
    return i


@_jit
def k3_rewards_lanes(
    logprobs, ref_logprobs, i, mask, has_mask, last, score, kl_coef, clamps, registers
):
    """The shaped rewards -kl_coef * k3 + (score at position ``last``, 0 elsewhere) of positions
    i .. i + 7, 0 where the mask is 0 (_numba_kernels._shape_rewards_rows' k3 form, lane by
    lane; clamps: (clamp lanes, -clamp lanes))."""
    reward = _lanes_mul(
        _lanes_splat(-kl_coef),
        k3_lanes_at(logprobs, ref_logprobs, i, clamps[0], clamps[1], registers),
    )
    addend = _lanes_splat(0.0)
    if i <= last < i + _U8:
        addend = _with_lane(addend, last - i, score)
    reward = _lanes_add(reward, addend)
    return _lanes_where_valid(mask, i, reward) if has_mask else reward
