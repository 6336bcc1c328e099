"""Eight lanes as one LLVM vector for the numba backend: float64 lanes for the block scans (GAE's
and the returns' blocks of 8 positions) and for sums in the C twin's lanes, and lanes of the
input dtype with masks of 8 lanes, so that the per-token loss kernels run as their C twins do
(src/lanes.h: ppo_vec, ppo_mask, ppo_f64x8): the type and its operations, each an intrinsic that
is its scalar operation lane by lane, so that the lanes give the same bits as scalar code.
Shared pieces of the backend are in ``_numba_core.py``."""

from __future__ import annotations

from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic, models, register_model

from ._numba_core import _AVX512, _U1, _U8, _jit


class _LanesType(types.Type):
    """Eight lanes of a float type held as one LLVM vector (<8 x double>, <8 x float>): a
    loop-carried value of this type stays in vector registers. numba runs no SLP vectorizer (its
    SLP_VECTORIZE is off), so eight scalar lanes written out stay eight scalar chains, and a tuple
    converted to a vector in each step costs more in shuffles than the lanes gain. Each operation
    is its scalar one lane by lane (llvm.fma.v8f64 is eight fma), so the lanes give the same bits
    as scalar code."""

    def __init__(self, dtype):
        self.dtype = dtype
        super().__init__(name=f"Lanes({dtype} x 8)")


class _ValidType(types.Type):
    """Eight booleans, one a lane (<8 x i1>): a comparison's result, a mask's bytes."""

    def __init__(self):
        super().__init__(name="Valid(x 8)")


_LANES = _LanesType(types.float64)
_LANES_OF = {types.float64: _LANES, types.float32: _LanesType(types.float32)}
_VALID = _ValidType()
_F64X8 = ir.VectorType(ir.DoubleType(), 8)
_I1X8 = ir.VectorType(ir.IntType(1), 8)
_I32 = ir.IntType(32)


@register_model(_LanesType)
class _LanesModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        item = ir.DoubleType() if fe_type.dtype == types.float64 else ir.FloatType()
        super().__init__(dmm, fe_type, ir.VectorType(item, 8))


@register_model(_ValidType)
class _ValidModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _I1X8)


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
    vector_type = ir.VectorType(x.type, 8)
    vector = builder.insert_element(ir.Constant(vector_type, ir.Undefined), x, ir.Constant(_I32, 0))
    zeros = ir.Constant(ir.VectorType(_I32, 8), [0] * 8)
    return builder.shuffle_vector(vector, ir.Constant(vector_type, ir.Undefined), zeros)


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
    """Eight lanes of x (float32 or float64)."""
    if x not in _LANES_OF:
        return None

    def codegen(context, builder, sig, args):
        return _splat_lanes(builder, args[0])

    return _LANES_OF[x](x), codegen


def _lanes_binary(operation):
    @intrinsic
    def binary(typingctx, a, b):
        if not isinstance(a, _LanesType) or a != b:
            return None

        def codegen(context, builder, sig, args):
            return getattr(builder, operation)(args[0], args[1])

        return a(a, b), codegen

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


# -- lanes of the input dtype and their masks: the loss kernels' blocks of 8 tokens ---------------
# The twins of src/lanes.h's ppo_vec (PPO_V), ppo_mask (PPO_M) and their counts (PPO_C), operation
# for operation, so that a numba loss kernel written in them is its C twin's code: one vector
# operation a step, sums in float64 lanes added up in the C twin's tree (_lane_total), every bit
# the same. LLVM's loop vectorizer gave the same loops 1.4-1.9 times the C twin's time (REINFORCE,
# the value loss: a run-time check that the outputs do not overlap the inputs at every block, the
# terms stored to scratch rows for their sums, 8 tokens a step at most).


def _item_pointer(context, builder, array_type, array, index, item_type):
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [index]), ir.VectorType(item_type, 8).as_pointer())


@intrinsic
def _lanes_of(typingctx, array, i):
    """Items i .. i + 7 of a float32 or float64 array, in its dtype (twin: PPO_V(load))."""
    if not _is_token_array(array) or not isinstance(i, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        item = context.get_value_type(sig.args[0].dtype)
        pointer = _item_pointer(context, builder, sig.args[0], args[0], args[1], item)
        return builder.load(pointer, align=sig.args[0].dtype.bitwidth // 8)

    return _LANES_OF[array.dtype](array, i), codegen


@intrinsic
def _lanes_put(typingctx, array, i, lanes):
    """Stores lanes of the array's dtype at items i .. i + 7 (twin: PPO_V(store))."""
    if not _is_token_array(array) or lanes != _LANES_OF[array.dtype]:
        return None

    def codegen(context, builder, sig, args):
        item = context.get_value_type(sig.args[0].dtype)
        pointer = _item_pointer(context, builder, sig.args[0], args[0], args[1], item)
        builder.store(args[2], pointer, align=sig.args[0].dtype.bitwidth // 8)
        return context.get_dummy_value()

    return types.none(array, i, lanes), codegen


def _first_lanes(builder, count, count_type, context):
    """<8 x i1>: lane j is j < count (a signed count)."""
    n = context.cast(builder, count, count_type, types.int64)
    lanes = ir.Constant(ir.VectorType(ir.IntType(64), 8), list(range(8)))
    return builder.icmp_signed("<", lanes, _splat_lanes(builder, n))


def _masked_memory(builder, operation, vector_type, pointer):
    """llvm.masked.load or llvm.masked.store of ``vector_type`` at ``pointer``: lanes outside
    the mask are neither read nor written, so they may lie past the end of the array."""
    i32 = ir.IntType(32)
    if operation == "load":
        function_type = ir.FunctionType(vector_type, [pointer.type, i32, _I1X8, vector_type])
    else:
        function_type = ir.FunctionType(ir.VoidType(), [vector_type, pointer.type, i32, _I1X8])
    names = {ir.DoubleType: "f64", ir.FloatType: "f32"}
    vector_name = f"v8{names.get(type(vector_type.element), 'i8')}"
    # typed pointers (LLVM 14, llvmlite < 0.45) name the pointee, opaque ones do not
    pointer_name = "p0" if getattr(pointer.type, "is_opaque", False) else f"p0{vector_name}"
    full_name = f"llvm.masked.{operation}.{vector_name}.{pointer_name}"
    try:
        return builder.module.get_global(full_name)
    except KeyError:
        return ir.Function(builder.module, function_type, full_name)


@intrinsic
def _lanes_of_first(typingctx, array, i, count):
    """Items i .. i + count - 1 of a float32 or float64 array in the first ``count`` lanes (0 <=
    count <= 8), 0 in the others, without reading past them: a row's last partial block in
    zero-padded lanes (twin: src/rows.h ppo_tail_fill's copy), one masked load instead of a
    copy an item at a time, whose scalar stores the block's vector loads then waited for."""
    if not _is_token_array(array) or not isinstance(i, types.Integer):
        return None
    if not isinstance(count, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        item = context.get_value_type(sig.args[0].dtype)
        vector_type = ir.VectorType(item, 8)
        pointer = _item_pointer(context, builder, sig.args[0], args[0], args[1], item)
        load = _masked_memory(builder, "load", vector_type, pointer)
        align = ir.Constant(ir.IntType(32), sig.args[0].dtype.bitwidth // 8)
        first = _first_lanes(builder, args[2], sig.args[2], context)
        return builder.call(load, [pointer, align, first, vector_type(None)])

    return _LANES_OF[array.dtype](array, i, count), codegen


@intrinsic
def _lanes_put_first(typingctx, array, i, lanes, count):
    """Stores the first ``count`` lanes (0 <= count <= 8) at items i .. i + count - 1, and
    nothing past them: a partial block's gradient back into its row."""
    if not _is_token_array(array) or lanes != _LANES_OF[array.dtype]:
        return None
    if not isinstance(i, types.Integer) or not isinstance(count, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        item = context.get_value_type(sig.args[0].dtype)
        pointer = _item_pointer(context, builder, sig.args[0], args[0], args[1], item)
        store = _masked_memory(builder, "store", ir.VectorType(item, 8), pointer)
        align = ir.Constant(ir.IntType(32), sig.args[0].dtype.bitwidth // 8)
        first = _first_lanes(builder, args[3], sig.args[3], context)
        builder.call(store, [args[2], pointer, align, first])
        return context.get_dummy_value()

    return types.none(array, i, lanes, count), codegen


@intrinsic
def _lanes_f64(typingctx, lanes):
    """The lanes in float64: exact (twin: PPO_V(to_f64))."""
    if not isinstance(lanes, _LanesType):
        return None

    def codegen(context, builder, sig, args):
        if sig.args[0].dtype == types.float64:
            return args[0]
        return builder.fpext(args[0], _F64X8)

    return _LANES(lanes), codegen


@intrinsic
def _lanes_f64_where(typingctx, valid, lanes):
    """The lanes in float64 where valid, +0.0 elsewhere (twin: PPO_V(to_f64_where)): a valid
    lane's term of a float64 sum, an invalid one's nothing, whatever is stored there."""
    if valid != _VALID or not isinstance(lanes, _LanesType):
        return None

    def codegen(context, builder, sig, args):
        wide = args[1] if sig.args[1].dtype == types.float64 else builder.fpext(args[1], _F64X8)
        return builder.select(args[0], wide, ir.Constant(_F64X8, [0.0] * 8))

    return _LANES(valid, lanes), codegen


@intrinsic
def _lanes_rounded(typingctx, lanes, like):
    """float64 lanes rounded to the dtype of the lanes ``like`` (twin: PPO_V(from_f64)), as a
    scalar store rounds."""
    if lanes != _LANES or not isinstance(like, _LanesType):
        return None

    def codegen(context, builder, sig, args):
        if sig.args[1].dtype == types.float64:
            return args[0]
        return builder.fptrunc(args[0], ir.VectorType(ir.FloatType(), 8))

    return like(lanes, like), codegen


@intrinsic
def _lanes_negative(typingctx, lanes):
    """-lanes: a sign flip, NaN's included (twin: PPO_V(negative))."""
    if not isinstance(lanes, _LanesType):
        return None

    def codegen(context, builder, sig, args):
        return builder.fneg(args[0])

    return lanes(lanes), codegen


@intrinsic
def _lanes_abs(typingctx, lanes):
    """|lanes|: the sign bit cleared (llvm.fabs), |-0| = +0 and a NaN's sign too, as numba's
    abs (twin: PPO_V(abs))."""
    if not isinstance(lanes, _LanesType):
        return None

    def codegen(context, builder, sig, args):
        vector_type = args[0].type
        name = f"llvm.fabs.v8f{64 if sig.args[0].dtype == types.float64 else 32}"
        try:
            function = builder.module.get_global(name)
        except KeyError:
            function = ir.Function(
                builder.module, ir.FunctionType(vector_type, [vector_type]), name
            )
        return builder.call(function, [args[0]])

    return lanes(lanes), codegen


def _lanes_comparison(operator):
    @intrinsic
    def comparison(typingctx, a, b):
        if not isinstance(a, _LanesType) or a != b:
            return None

        def codegen(context, builder, sig, args):
            return builder.fcmp_ordered(operator, args[0], args[1])

        return _VALID(a, b), codegen

    return comparison


# Ordered comparisons: false where a lane is NaN, as scalar <, >, == (twins: PPO_V(lt), ...).
_lanes_lt = _lanes_comparison("<")
_lanes_gt = _lanes_comparison(">")
_lanes_le = _lanes_comparison("<=")
_lanes_eq = _lanes_comparison("==")


@intrinsic
def _lanes_where(typingctx, valid, a, b):
    """Lanes j: a[j] where valid[j], else b[j] (twin: PPO_V(select))."""
    if valid != _VALID or not isinstance(a, _LanesType) or a != b:
        return None

    def codegen(context, builder, sig, args):
        return builder.select(args[0], args[1], args[2])

    return a(valid, a, b), codegen


@intrinsic
def _lanes_clip(typingctx, x, low, high):
    """min(high, max(low, x)) with the twins' min and max (a < b ? a : b, a > b ? a : b): a NaN
    lane stays NaN (twin: src/rows.h ppo_clip)."""
    if not isinstance(x, _LanesType) or not x == low == high:
        return None

    def codegen(context, builder, sig, args):
        x, low, high = args
        above_low = builder.select(builder.fcmp_ordered(">", low, x), low, x)
        return builder.select(builder.fcmp_ordered("<", high, above_low), high, above_low)

    return x(x, low, high), codegen


def _valid_binary(operation):
    @intrinsic
    def binary(typingctx, a, b):
        if a != _VALID or b != _VALID:
            return None

        def codegen(context, builder, sig, args):
            first, second = args
            if operation == "and_not":
                return builder.and_(first, builder.not_(second))
            return getattr(builder, operation)(first, second)

        return _VALID(_VALID, _VALID), codegen

    return binary


_valid_and = _valid_binary("and_")  # twins: PPO_M(and), PPO_M(or), PPO_M(and_not) (a and not b)
_valid_or = _valid_binary("or_")
_valid_and_not = _valid_binary("and_not")


@intrinsic
def _valid_all(typingctx):
    """Every lane valid (twin: PPO_M(all))."""

    def codegen(context, builder, sig, args):
        return ir.Constant(_I1X8, [1] * 8)

    return _VALID(), codegen


@intrinsic
def _valid_bytes(typingctx, mask, i):
    """Lane j: mask[i + j] != 0, a uint8 mask (twin: PPO_M(from_bytes)).

    Without AVX-512 the bytes are widened to 32-bit lanes first, behind an empty inline asm
    (LLVM would fold the widening away and compare the bytes): the comparison is then one of 8
    32-bit lanes, the form a float32 select and a count (movmskps) take, as the C twin's AVX2
    mask; compared as bytes, LLVM held the lanes as 8 16-bit ones and widened them again for
    each use, six instructions a block more than the twin in the value loss (numba 1.17-1.20x the
    twin's time there, 0.93-0.99x so; float32 32x2048 in cache, one thread, AMD EPYC)."""
    if not (isinstance(mask, types.Array) and mask.dtype == types.uint8):
        return None

    def codegen(context, builder, sig, args):
        byte_vector = ir.VectorType(ir.IntType(8), 8)
        pointer = _item_pointer(context, builder, sig.args[0], args[0], args[1], ir.IntType(8))
        if _AVX512:  # a byte compare writes a mask register at once (vptestmb)
            return builder.icmp_unsigned("!=", builder.load(pointer, align=1), byte_vector(None))
        word_vector = ir.VectorType(_I32, 8)
        words = builder.zext(builder.load(pointer, align=1), word_vector)
        words = builder.asm(ir.FunctionType(word_vector, [word_vector]), "", "=x,0", [words], False)
        return builder.icmp_unsigned("!=", words, word_vector(None))

    return _VALID(mask, i), codegen


@intrinsic
def _valid_first(typingctx, count):
    """Lane j: j < count, a signed count (twin: PPO_M(first))."""
    if not isinstance(count, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return _first_lanes(builder, args[0], sig.args[0], context)

    return _VALID(count), codegen


@intrinsic
def _valid_bytes_first(typingctx, mask, i, count):
    """Lane j: j < count and mask[i + j] != 0, without reading the mask past the first
    ``count`` bytes (0 <= count <= 8): a partial block's mask."""
    if not (isinstance(mask, types.Array) and mask.dtype == types.uint8):
        return None
    if not isinstance(i, types.Integer) or not isinstance(count, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        byte_vector = ir.VectorType(ir.IntType(8), 8)
        pointer = _item_pointer(context, builder, sig.args[0], args[0], args[1], ir.IntType(8))
        load = _masked_memory(builder, "load", byte_vector, pointer)
        first = _first_lanes(builder, args[2], sig.args[2], context)
        one = ir.Constant(ir.IntType(32), 1)
        data = builder.call(load, [pointer, one, first, byte_vector(None)])
        return builder.icmp_unsigned("!=", data, byte_vector(None))

    return _VALID(mask, i, count), codegen


@intrinsic
def _valid_put(typingctx, mask, i, valid):
    """Stores the lanes as bytes 1 (valid) and 0 at mask[i] .. mask[i + 7] (a uint8 array)."""
    if not (isinstance(mask, types.Array) and mask.dtype == types.uint8) or valid != _VALID:
        return None

    def codegen(context, builder, sig, args):
        byte_vector = ir.VectorType(ir.IntType(8), 8)
        pointer = _item_pointer(context, builder, sig.args[0], args[0], args[1], ir.IntType(8))
        builder.store(builder.zext(args[2], byte_vector), pointer, align=1)
        return context.get_dummy_value()

    return types.none(mask, i, valid), codegen


@intrinsic
def _count_valid_lanes(typingctx, valid):
    """How many lanes are valid (twin: PPO_C(add) of one block)."""
    if valid != _VALID:
        return None

    def codegen(context, builder, sig, args):
        bits = builder.bitcast(args[0], ir.IntType(8))
        count = builder.ctpop(bits)
        return builder.zext(count, ir.IntType(64))

    return types.int64(valid), codegen


@_jit
def _zeros_backwards(a, b, first, end):
    """Twin: src/rows.h ppo_zeros_backwards (which says why). Zeros at positions first .. end-1
    of a and of b (empty: none), from the last down, a block of 8 at a time."""
    zeros = _lanes_splat(0.0)
    has_b = b.shape[0] > 0
    k = end  # first <= end, as unsigned as the callers' positions
    while k - first >= _U8:
        k -= _U8
        _lanes_store(a, k, zeros)
        if has_b:
            _lanes_store(b, k, zeros)
    while k > first:
        k -= _U1
        a[k] = 0.0
        if has_b:
            b[k] = 0.0


@_jit
def _tail_fill(tail, tail_mask, a, b, c, d, has_d, mask, has_mask, i, count):
    """Twin: src/rows.h ppo_tail_fill. A row's last partial block, the ``count`` < 8 tokens from
    position i of three token arrays and a fourth where ``has_d``, into rows 0-3 of ``tail`` (row
    4 takes the block's gradient), and their mask (1 without one) into ``tail_mask``, in
    zero-padded lanes: one masked load and one store a row of ``tail`` (``_lanes_of_first``).
    Inlined into its callers' numba IR. Called by address once or twice a row, it took the
    arrays' fields one by one, and it copied an item at a time; on rows with a partial last block
    (lengths not a multiple of 8) numba's kernels took up to twice the twins' time (float32
    1024 x 8, one thread: GSPO 1.7x, the geometric mean 1.9x, the clipped surrogate 1.5x)."""
    _lanes_put(tail[0], 0, _lanes_of_first(a, i, count))
    _lanes_put(tail[1], 0, _lanes_of_first(b, i, count))
    _lanes_put(tail[2], 0, _lanes_of_first(c, i, count))
    nothing = _lanes_of_first(a, i, 0)  # zeros of the dtype
    if has_d:
        _lanes_put(tail[3], 0, _lanes_of_first(d, i, count))
    else:
        _lanes_put(tail[3], 0, nothing)
    _lanes_put(tail[4], 0, nothing)
    if has_mask:
        _valid_put(tail_mask, 0, _valid_bytes_first(mask, i, count))
    else:
        _valid_put(tail_mask, 0, _valid_first(count))
