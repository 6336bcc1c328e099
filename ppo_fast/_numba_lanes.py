"""Eight float64 lanes as one LLVM vector for the numba backend's block scans (GAE's and the
returns' blocks of 8 positions, the geometric mean's sums in the C twin's lanes): the type and
its operations, each an intrinsic that is its scalar operation lane by lane, so that the lanes
give the same bits as scalar code. Shared pieces of the backend are in ``_numba_core.py``."""

from __future__ import annotations

from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic, models, register_model

from ._numba_core import _jit


class _LanesType(types.Type):
    """Eight float64 lanes held as one LLVM vector (<8 x double>): a loop-carried value of this
    type stays in vector registers. numba runs no SLP vectorizer (its SLP_VECTORIZE is off), so
    eight scalar lanes written out stay eight scalar chains, and a tuple converted to a vector in
    each step costs more in shuffles than the lanes gain. Each operation is its scalar one lane
    by lane (llvm.fma.v8f64 is eight fma), so the lanes give the same bits as scalar code."""

    def __init__(self):
        super().__init__(name="Lanes(float64 x 8)")


_LANES = _LanesType()
_F64X8 = ir.VectorType(ir.DoubleType(), 8)
_I32 = ir.IntType(32)


@register_model(_LanesType)
class _LanesModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _F64X8)


def _vector_intrinsic(builder, name, arguments):
    try:
        function = builder.module.get_global(name)
    except KeyError:
        function = ir.Function(
            builder.module, ir.FunctionType(_F64X8, [_F64X8] * len(arguments)), name
        )
    return builder.call(function, arguments)


def _fma_lanes(builder, a, b, c):
    return _vector_intrinsic(builder, "llvm.fma.v8f64", [a, b, c])


def _splat_lanes(builder, x):
    vector = builder.insert_element(ir.Constant(_F64X8, ir.Undefined), x, ir.Constant(_I32, 0))
    zeros = ir.Constant(ir.VectorType(_I32, 8), [0] * 8)
    return builder.shuffle_vector(vector, ir.Constant(_F64X8, ir.Undefined), zeros)


def _load_lanes(context, builder, array_type, array, index):
    """Eight consecutive items of a float32 or float64 array from ``index`` on, as float64."""
    item = context.get_value_type(array_type.dtype)
    data = context.make_array(array_type)(context, builder, array).data
    pointer = builder.bitcast(builder.gep(data, [index]), ir.VectorType(item, 8).as_pointer())
    x = builder.load(pointer, align=array_type.dtype.bitwidth // 8)
    return x if isinstance(item, ir.DoubleType) else builder.fpext(x, _F64X8)


@intrinsic
def _td_errors(typingctx, rewards, values, i, gamma):
    """Lanes j = 0..7: fma(gamma, values[i + j + 1], rewards[i + j]) - values[i + j], in float64
    (GAE's TD errors of 8 consecutive positions, each from the value at the next position)."""
    if not all(
        isinstance(a, types.Array) and a.dtype in (types.float32, types.float64)
        for a in (rewards, values)
    ) or not isinstance(i, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        reward_array, value_array, index, gamma = args
        next_index = builder.add(index, ir.Constant(index.type, 1))
        rewards = _load_lanes(context, builder, sig.args[0], reward_array, index)
        values = _load_lanes(context, builder, sig.args[1], value_array, index)
        next_values = _load_lanes(context, builder, sig.args[1], value_array, next_index)
        fused = _fma_lanes(builder, _splat_lanes(builder, gamma), next_values, rewards)
        return builder.fsub(fused, values)

    return _LANES(rewards, values, i, types.float64), codegen


@intrinsic
def _lanes_fma(typingctx, factor, lanes, addend):
    """Lanes j: fma(factor, lanes[j], addend[j])."""
    if lanes != _LANES or addend != _LANES:
        return None

    def codegen(context, builder, sig, args):
        return _fma_lanes(builder, _splat_lanes(builder, args[0]), args[1], args[2])

    return _LANES(types.float64, _LANES, _LANES), codegen


@intrinsic
def _lane(typingctx, lanes, j):
    """Lane j (an integer constant or value) of the lanes."""
    if lanes != _LANES or not isinstance(j, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.extract_element(args[0], args[1])

    return types.float64(_LANES, j), codegen


@intrinsic
def _with_lane(typingctx, lanes, j, x):
    """The lanes with lane j replaced by x."""
    if lanes != _LANES or not isinstance(j, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.insert_element(args[0], args[2], args[1])

    return _LANES(_LANES, j, types.float64), codegen


def _is_token_array(a):
    return isinstance(a, types.Array) and a.dtype in (types.float32, types.float64)


@intrinsic
def _lanes_load(typingctx, array, i):
    """Eight consecutive items of a float32 or float64 array from ``i`` on, as float64 lanes."""
    if not _is_token_array(array) or not isinstance(i, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return _load_lanes(context, builder, sig.args[0], args[0], args[1])

    return _LANES(array, i), codegen


@intrinsic
def _lanes_store(typingctx, array, i, lanes):
    """Stores the lanes at items i .. i + 7 of a float32 or float64 array (rounded to float32
    there, as a scalar store rounds)."""
    if not _is_token_array(array) or not isinstance(i, types.Integer) or lanes != _LANES:
        return None

    def codegen(context, builder, sig, args):
        array_type = sig.args[0]
        item = context.get_value_type(array_type.dtype)
        data = context.make_array(array_type)(context, builder, args[0]).data
        pointer = builder.bitcast(builder.gep(data, [args[1]]), ir.VectorType(item, 8).as_pointer())
        x = (
            args[2]
            if isinstance(item, ir.DoubleType)
            else builder.fptrunc(args[2], ir.VectorType(item, 8))
        )
        builder.store(x, pointer, align=array_type.dtype.bitwidth // 8)
        return context.get_dummy_value()

    return types.none(array, i, _LANES), codegen


@intrinsic
def _lanes_splat(typingctx, x):
    """Eight lanes of x."""
    if x != types.float64:
        return None

    def codegen(context, builder, sig, args):
        return _splat_lanes(builder, args[0])

    return _LANES(types.float64), codegen


def _lanes_binary(operation):
    @intrinsic
    def binary(typingctx, a, b):
        if a != _LANES or b != _LANES:
            return None

        def codegen(context, builder, sig, args):
            return getattr(builder, operation)(args[0], args[1])

        return _LANES(_LANES, _LANES), codegen

    return binary


_lanes_add = _lanes_binary("fadd")  # lane by lane, as scalar +, - and *
_lanes_sub = _lanes_binary("fsub")
_lanes_mul = _lanes_binary("fmul")


@intrinsic
def _lanes_where_valid(typingctx, mask, i, lanes):
    """Lanes j: lanes[j] where mask[i + j] != 0, else +0.0 (a uint8 mask; added to a sum that
    starts at +0.0, the +0.0 leaves it unchanged, NaN and inf included)."""
    if not (isinstance(mask, types.Array) and mask.dtype == types.uint8) or lanes != _LANES:
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        byte_vector = ir.VectorType(ir.IntType(8), 8)
        pointer = builder.bitcast(builder.gep(data, [args[1]]), byte_vector.as_pointer())
        valid = builder.icmp_unsigned("!=", builder.load(pointer, align=1), byte_vector(None))
        return builder.select(valid, args[2], ir.Constant(_F64X8, [0.0] * 8))

    return _LANES(mask, i, _LANES), codegen


@intrinsic
def _lanes_any_at_least(typingctx, lanes, x):
    """Whether any lane is >= x (False for a NaN lane)."""
    if lanes != _LANES or x != types.float64:
        return None

    def codegen(context, builder, sig, args):
        at_least = builder.fcmp_ordered(">=", args[0], _splat_lanes(builder, args[1]))
        bits = builder.bitcast(at_least, ir.IntType(8))
        return builder.icmp_unsigned("!=", bits, ir.Constant(ir.IntType(8), 0))

    return types.boolean(_LANES, types.float64), codegen


@intrinsic
def _lanes_fma_by(typingctx, factors, x, addend):
    """Lanes j: fma(factors[j], x, addend[j])."""
    if factors != _LANES or x != types.float64 or addend != _LANES:
        return None

    def codegen(context, builder, sig, args):
        return _fma_lanes(builder, args[0], _splat_lanes(builder, args[1]), args[2])

    return _LANES(_LANES, types.float64, _LANES), codegen


def _lanes_down(k, filled):
    """Lanes moved down by k (lane j takes lane j + k): the top k lanes take the scalar
    argument (filled) or 0. Twins: src/lanes.h ppo_f64x8_down1_fill, down2, down4."""
    order = ir.Constant(ir.VectorType(_I32, 8), list(range(k, k + 8)))

    def codegen(context, builder, sig, args):
        fill = _splat_lanes(builder, args[1]) if filled else ir.Constant(_F64X8, [0.0] * 8)
        return builder.shuffle_vector(args[0], fill, order)

    if filled:

        @intrinsic
        def down_fill(typingctx, lanes, last):
            if lanes != _LANES or last != types.float64:
                return None
            return _LANES(_LANES, types.float64), codegen

        return down_fill

    @intrinsic
    def down(typingctx, lanes):
        if lanes != _LANES:
            return None
        return _LANES(_LANES), codegen

    return down


_lanes_down1_fill = _lanes_down(1, filled=True)
_lanes_down2 = _lanes_down(2, filled=False)
_lanes_down4 = _lanes_down(4, filled=False)


@intrinsic
def _lanes_bounded(typingctx, lanes, bound):
    """Whether every lane is within [-bound, bound] (False where one is NaN)."""
    if lanes != _LANES or bound != types.float64:
        return None

    def codegen(context, builder, sig, args):
        magnitudes = _vector_intrinsic(builder, "llvm.fabs.v8f64", [args[0]])
        within = builder.fcmp_ordered("<=", magnitudes, _splat_lanes(builder, args[1]))
        bits = builder.bitcast(within, ir.IntType(8))
        return builder.icmp_unsigned("==", bits, ir.Constant(ir.IntType(8), 0xFF))

    return types.boolean(_LANES, types.float64), codegen


@_jit
def _lane_total(lanes):
    """The 8 lanes of a sum (lane k: the terms of positions k, k + 8, ... in order) added up in
    the fixed tree of src/lanes.h ppo_f64x8_total."""
    return ((_lane(lanes, 0) + _lane(lanes, 1)) + (_lane(lanes, 2) + _lane(lanes, 3))) + (
        (_lane(lanes, 4) + _lane(lanes, 5)) + (_lane(lanes, 6) + _lane(lanes, 7))
    )


@_jit
def _add_lanes(lanes, terms, n):
    """The lanes plus the n terms of a chunk, term j in lane j % 8 (n a multiple of 8), as one
    vector add per 8 terms: numba runs no SLP vectorizer, and eight scalar lanes written out
    stayed eight scalar additions (the loss ran 1.3x slower than its C twin)."""
    for j in range(0, n, 8):
        lanes = _lanes_add(lanes, _lanes_load(terms, j))
    return lanes
