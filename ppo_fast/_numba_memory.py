"""Where numba's kernels keep their scratch without numba's reference counting (NRT): arrays in
the calling function's stack frame (``_stack_array``), as the C twins keep theirs, and, for the
one-thread common entries above 128 rows, malloc's memory given back by hand (``_heap_bytes``,
``_heap_free``). A function compiled with ``_nrt=False`` cannot allocate an array otherwise."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic
from numba.np.arrayobj import populate_array


@intrinsic(prefer_literal=True)
def _stack_array(typingctx, shape, dtype):
    """A C-contiguous array of the constant ``shape`` (a tuple of int literals) and ``dtype``
    (a NumPy dtype, as ``array.dtype``), uninitialised, in the calling function's stack frame
    (an alloca of its entry block, 64-byte aligned), with no reference-counted record: a
    kernel's scratch rows, as its C twin keeps them. It lives until the function returns, so
    it must not be returned or kept; the kernels pass it down to their row functions only.
    Allocated by NRT (np.empty), each cost a malloc, a free and two atomic instructions: the
    clipped surrogate's four scratch arrays were 0.15 us of its 0.2 us fixed cost a call."""
    if not (
        isinstance(shape, types.BaseTuple)
        and all(isinstance(n, types.IntegerLiteral) for n in shape)
        and isinstance(dtype, (types.DType, types.NumberClass))
    ):
        return None
    extents = [n.literal_value for n in shape]
    element = dtype.dtype
    array_type = types.Array(element, len(extents), "C")

    def codegen(context, builder, sig, args):
        data_type = context.get_data_type(element)
        itemsize = context.get_abi_sizeof(data_type)
        size = int(np.prod(extents))
        with builder.goto_entry_block():
            data = builder.alloca(data_type, size=ir.Constant(ir.IntType(64), max(size, 1)))
            data.align = 64
        strides = [itemsize * int(np.prod(extents[k + 1 :])) for k in range(len(extents))]
        array = context.make_array(array_type)(context, builder)
        intp = context.get_value_type(types.intp)
        populate_array(
            array,
            data=data,
            shape=[ir.Constant(intp, n) for n in extents],
            strides=[ir.Constant(intp, n) for n in strides],
            itemsize=ir.Constant(intp, itemsize),
            meminfo=None,
        )
        return array._getvalue()

    return array_type(shape, dtype), codegen


@intrinsic
def _heap_bytes(typingctx, n_bytes):
    """A (n_bytes,) uint8 array of malloc's memory, uninitialised and with no reference-counted
    record, for a function compiled without NRT (``_nrt=False``, which cannot allocate arrays):
    give it back with ``_heap_free`` before returning, and raise nothing in between. Raises
    MemoryError when malloc fails."""
    if not isinstance(n_bytes, types.Integer):
        return None
    array_type = types.Array(types.uint8, 1, "C")

    def codegen(context, builder, sig, args):
        size = context.cast(builder, args[0], sig.args[0], types.intp)
        bytes_pointer = ir.IntType(8).as_pointer()
        malloc = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(bytes_pointer, [size.type]), "malloc"
        )
        # malloc(0) may return NULL: ask for one byte at least
        data = builder.call(
            malloc,
            [builder.select(builder.icmp_signed(">", size, size.type(0)), size, size.type(1))],
        )
        with cgutils.if_unlikely(builder, cgutils.is_null(builder, data)):
            context.call_conv.return_user_exc(
                builder, MemoryError, ("ppo_fast: out of memory for the row arrays of a batch",)
            )
        array = context.make_array(array_type)(context, builder)
        intp = context.get_value_type(types.intp)
        populate_array(
            array,
            data=data,
            shape=[size],
            strides=[ir.Constant(intp, 1)],
            itemsize=ir.Constant(intp, 1),
            meminfo=None,
        )
        return array._getvalue()

    return array_type(n_bytes), codegen


@intrinsic
def _heap_free(typingctx, array):
    """Give back the memory of a ``_heap_bytes`` array."""
    if not (isinstance(array, types.Array) and array.dtype == types.uint8):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        free = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [data.type]), "free"
        )
        builder.call(free, [data])
        return context.get_dummy_value()

    return types.none(array), codegen
