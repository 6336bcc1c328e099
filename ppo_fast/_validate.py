"""The only input boundary of ppo_fast.

Every public stage calls in here before it dispatches to a backend, so the kernels can trust
what they get: C-contiguous float32/float64 token arrays of one shape and dtype, and a `Rows`
description of the batch. Every error names the argument and says how to fix it.

The three public layouts (a mask, lengths, or packed cu_seqlens; or none) become ``Rows``
(``_rows``, the batch model of DESIGN.md section 2), which may also carry groups
(``_groups.with_groups``). The outcome estimators take per-row data (``row_data``: one score per
row) and broadcast their results onto a layout that comes without token arrays (``row_layout``:
its shape is read from the mask, from lengths and ``padded_length``, or from cu_seqlens).

Scalars follow one rule (``scalar``): a real number is a Python int or float, a NumPy integer or
floating scalar, or a 0-d real array (a 0-d tensor in ``ppo_fast.torch``); bool, str, bytes,
complex, None and anything else are a TypeError naming the argument. NaN is a ValueError, and so
is an infinity unless the call site allows it (``allow_inf=True``: a bound that may be absent,
such as ``clip_high`` or ``dual_clip``). Per-row hyperparameters (``per_row``) follow the same
rule element by element; per-row *data* (scores, bootstrap values) may hold NaN and inf, which
propagate as data do (DESIGN.md section 3).
"""

from __future__ import annotations

import contextvars
import math
import operator
from typing import Any

import numpy as np

from . import _loops, _threads
from ._rows import EMPTY_MASK, Rows, constant_rows, padded_layout

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_FLOAT32, _FLOAT64 = FLOAT_DTYPES
_FLOAT16 = np.dtype(np.float16)
_NDARRAY = np.ndarray
_BOOL, _UINT8 = np.dtype(np.bool_), np.dtype(np.uint8)
_INT64_MAX = np.iinfo(np.int64).max

# Set by ppo_fast.torch around its calls: the fix-it hints then speak torch, not NumPy.
_TORCH_HINTS: contextvars.ContextVar[bool] = contextvars.ContextVar("torch_hints", default=False)


class torch_hints:  # lower case: called as the function it was
    """Phrase the fix-it hints of the errors raised inside for tensors (``x.float()``).

    A class rather than ``contextlib.contextmanager``, whose generator costs about a microsecond
    on every ``ppo_fast.torch`` call."""

    __slots__ = ("_token",)

    def __enter__(self) -> None:
        self._token = _TORCH_HINTS.set(True)

    def __exit__(self, *exception: object) -> None:
        _TORCH_HINTS.reset(self._token)


def _cast_hint(name: str, dtype: str) -> str:
    """How to cast ``name`` to ``dtype`` ("float32", "float64" or "int64"), in the caller's API."""
    if _TORCH_HINTS.get():
        method = {"float32": "float", "float64": "double", "int64": "long"}[dtype]
        return f"cast it with {name}.{method}() or {name}.to(torch.{dtype})"
    return f"cast it with {name}.astype(np.{dtype})"


def _describe(x: Any) -> str:
    return f"{type(x).__module__}.{type(x).__qualname__}"


def _is_tensor(value: Any) -> bool:
    return hasattr(value, "__torch_function__") and not isinstance(value, np.ndarray)


def tensor_array(name: str, tensor: Any) -> np.ndarray:
    """A torch tensor as a NumPy array: a view of a CPU tensor's memory (no copy), a host copy of
    a tensor on another device, float32 for bfloat16 and float16. Duck-typed: torch is never
    imported here."""
    if tensor.is_cpu:
        # The common case in one call (a third of the time of the way below, which gives the
        # same array): what NumPy can view. Conjugate and negative views and the dtypes NumPy
        # lacks raise, and float16 goes to float32: those go the way below.
        try:
            array = (tensor.detach() if tensor.requires_grad else tensor).numpy()
        except (TypeError, RuntimeError):
            pass
        else:
            if array.dtype is not _FLOAT16:
                return array
    tensor = tensor.detach()
    device = tensor.device.type
    if device == "meta":
        raise ValueError(
            f"{name} is a meta tensor: it has a shape but no data to compute on; "
            "materialise it on the CPU or an accelerator first"
        )
    dtype = str(tensor.dtype).removeprefix("torch.")
    if device != "cpu":
        tensor = tensor.cpu()
    if dtype in ("bfloat16", "float16"):
        tensor = tensor.float()
    elif dtype.startswith("float8") or dtype.startswith("float4"):
        raise TypeError(
            f"{name} has dtype torch.{dtype}, which ppo_fast does not compute in: "
            f"cast it with {name}.float() or {name}.to(torch.float32)"
        )
    try:
        return tensor.resolve_conj().resolve_neg().numpy()
    except (TypeError, RuntimeError) as error:
        raise TypeError(
            f"{name} (torch.{dtype} on {tensor.device}, layout {tensor.layout}) cannot be read "
            f"as an array ({error}): pass a dense tensor, cast with {name}.float() or "
            f"{name}.to(torch.float32)"
        ) from None


def _as_array(name: str, value: Any) -> np.ndarray:
    """``np.asarray(value)``, with an error that names the argument when it is not an array."""
    if _is_tensor(value):
        return tensor_array(name, value)
    try:
        return np.asarray(value)
    except (ValueError, TypeError, OverflowError) as error:
        reason = str(error).split("\n")[0]
        raise ValueError(
            f"{name} cannot be read as an array ({reason}): pass a rectangular array; rows of "
            "different lengths go padded to (B, T) with a mask or lengths, or packed to (N,) "
            "with cu_seqlens"
        ) from None


def _float_hint(name: str, dtype: np.dtype) -> str:
    if dtype.kind == "f" and not dtype.isnative:
        native = dtype.newbyteorder("=")
        if native in FLOAT_DTYPES:
            return f"convert it to native byte order with {name}.astype('={native.str[1:]}')"
    if dtype.kind in "biu" or (dtype.kind == "f" and dtype.itemsize < 4):
        return _cast_hint(name, "float32")
    if dtype.kind == "f":
        return _cast_hint(name, "float64")
    return "pass real floating-point numbers"


def token_arrays(elementwise: bool = False, **arrays: Any) -> tuple[np.ndarray, ...]:
    """Per-token arrays: same shape, one float dtype (float32 or float64), 1-D or 2-D
    (any number of dimensions when `elementwise`).

    Returns C-contiguous arrays; a non-contiguous input is copied, never modified.
    """
    out = []
    first_name = first = None
    for name, value in arrays.items():
        if value is None:
            raise TypeError(f"{name} is required: pass a float32 or float64 array")
        if _is_tensor(value):
            raise TypeError(
                f"{name} is a torch tensor: use ppo_fast.torch, which takes tensors, "
                f"or pass {name}.numpy()"
            )
        array = _as_array(name, value)
        if array.dtype not in FLOAT_DTYPES or not array.dtype.isnative:
            hint = _float_hint(name, array.dtype)
            raise TypeError(f"{name} must be float32 or float64, got dtype {array.dtype}: {hint}")
        if not elementwise and array.ndim not in (1, 2):
            raise ValueError(
                f"{name} must be 2-D (B, T) padded or 1-D (N,) packed, got shape {array.shape}"
            )
        if first is None:
            first_name, first = name, array
        else:
            if array.shape != first.shape:
                raise ValueError(
                    f"{name} has shape {array.shape} but {first_name} has shape {first.shape}: "
                    "every per-token array must have the same shape"
                )
            if array.dtype != first.dtype:
                raise TypeError(
                    f"{name} is {array.dtype} but {first_name} is {first.dtype}: "
                    f"pass one dtype: {_cast_hint(name, str(first.dtype))}"
                )
        out.append(array if array.flags.carray else kernel_array(array))
    return tuple(out)


class _WriteableAlias:
    """The ``__array_interface__`` of a read-only array with its data flagged writeable, holding
    the array (so that its memory outlives the alias)."""

    __slots__ = ("__array_interface__", "array")

    def __init__(self, array: np.ndarray) -> None:
        interface = dict(array.__array_interface__)
        interface["data"] = (interface["data"][0], False)
        self.__array_interface__ = interface
        self.array = array


def kernel_array(array: np.ndarray) -> np.ndarray:
    """``array`` as the compiled kernels read it: C-contiguous, aligned and writeable, without a
    copy where it is only read-only.

    numba types a read-only array apart from a writeable one, so a read-only input (a view of an
    Arrow buffer, a memory map, ``flags.writeable = False``) would compile every kernel it reaches
    once more (0.5-10 s each, per combination of read-only inputs): a read-only array is passed as
    a writeable alias of the same memory. Kernels never write their inputs (the tests check every
    input after every call); outputs are always ppo_fast's own arrays or a checked ``out=``. A
    non-contiguous or misaligned array is copied (not np.ascontiguousarray: it turns a 0-d array
    into shape (1,), and keeps a misaligned one misaligned).
    """
    flags = array.flags
    if flags.carray:
        return array
    if flags.c_contiguous and flags.aligned:
        return np.asarray(_WriteableAlias(array))
    return np.array(array, order="C")


def out_array(
    name: str,
    out: Any,
    shape: tuple[int, ...],
    dtype: np.dtype,
    inputs: dict[str, Any],
    in_place: str | None = None,
) -> np.ndarray:
    """A preallocated output ``out`` for a result of ``shape`` and ``dtype``, checked.

    It must be a NumPy array of exactly that shape and dtype, C-contiguous and writeable, and share
    no memory with any of ``inputs`` (name -> the value given, or the array checked from it): the
    kernels write every position of it, and inputs are never modified. The one exception is the
    input named ``in_place``, for a stage whose kernel reads each position of that input only to
    write the same position of ``out`` (``whiten``): ``out`` may be that input's very elements
    (the same array, or a view of all of it), which the caller then asked to overwrite.
    """
    fix = f"pass np.empty({shape}, dtype=np.{dtype})"
    if not isinstance(out, np.ndarray):
        raise TypeError(f"{name} must be a NumPy array, got {_describe(out)}: {fix}")
    if out.dtype != dtype:
        raise TypeError(f"{name} has dtype {out.dtype} but the result is {dtype}: {fix}")
    if out.shape != shape:
        raise ValueError(f"{name} has shape {out.shape} but the result has shape {shape}: {fix}")
    if not out.flags.c_contiguous:
        raise ValueError(f"{name} is not C-contiguous: {fix}, or np.ascontiguousarray({name})")
    if not out.flags.writeable:
        raise ValueError(f"{name} is read-only: {fix}")
    apart(name, out, inputs, fix, in_place)
    return out


def apart(
    name: str,
    out: Any,
    inputs: dict[str, Any],
    fix: str = "pass another array, or none",
    in_place: str | None = None,
) -> None:
    """Checks that the output ``out`` shares no memory with any array of ``inputs`` (name -> the
    value given; what is not a NumPy array is not one of the caller's buffers), but for the
    input named ``in_place`` when ``out`` is its very elements (``out_array``); ``fix`` ends the
    message."""
    if not isinstance(out, np.ndarray):
        return
    for input_name, value in inputs.items():
        # may_share_memory compares bounds (cheap); shares_memory settles a possible overlap.
        if (
            isinstance(value, np.ndarray)
            and np.may_share_memory(out, value)
            and np.shares_memory(out, value)
        ):
            if input_name == in_place:
                if _same_elements(out, value):
                    continue
                raise ValueError(
                    f"{name} overlaps {input_name} without being it: pass {input_name} itself "
                    f"to write the result in place, or {fix}"
                )
            raise ValueError(
                f"{name} shares memory with {input_name}: the results would overwrite it; {fix}"
            )


def _same_elements(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays are the same elements of the same memory, in the same order."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.strides == b.strides
        and a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
    )


def out_arrays(
    results: tuple[str, ...],
    out: Any,
    like: np.ndarray,
    inputs: dict[str, Any],
    in_place: str | None = None,
) -> tuple[np.ndarray, ...]:
    """``out`` for several results shaped like ``like``: one array, or a tuple of them in the
    order of ``results``, each checked by ``out_array`` (and sharing no memory with another;
    ``in_place`` as there).

    Only the values the caller gave need checking: every array checked from one is that array,
    a view of it, or a fresh copy.
    """
    if len(results) == 1:
        outs = (out,)
    elif not isinstance(out, tuple | list) or len(out) != len(results):
        raise TypeError(
            f"out must be a tuple ({', '.join(results)}) of {len(results)} arrays, "
            f"got {_describe(out)}: pass a tuple of np.empty({like.shape}, dtype=np.{like.dtype})"
        )
    else:
        outs = tuple(out)
    checked: list[np.ndarray] = []
    inputs = dict(inputs)
    for index, value in enumerate(outs):
        name = "out" if len(results) == 1 else f"out[{index}] ({results[index]})"
        array = out_array(name, value, like.shape, like.dtype, inputs, in_place)
        inputs[name] = array  # the next outputs must not share memory with this one either
        checked.append(array)
    return tuple(checked)


def _index_array(value: Any, name: str) -> np.ndarray:
    array = _as_array(name, value)
    if array.dtype.kind not in "iu" and not (array.size == 0 and array.dtype.kind == "f"):
        raise TypeError(
            f"{name} must hold integers, got dtype {array.dtype}: {_cast_hint(name, 'int64')}"
        )
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {array.shape}")
    if array.dtype.kind == "u" and array.dtype.itemsize == 8 and np.any(array > _INT64_MAX):
        # int64 would wrap them to negative numbers: report the value given.
        b = int(np.argmax(array > _INT64_MAX))
        raise ValueError(f"{name}[{b}]={array[b]} is out of range: it must be below 2**63")
    return array.astype(np.int64)


# Masks of numbers converted by the compiled loop (the dtypes numba takes, native byte order);
# others (float16, a byte-swapped array) go NumPy's way, with the same result.
_LOOP_MASK_DTYPES = frozenset(
    np.dtype(f"{kind}{bits}") for kind in ("int", "uint") for bits in (8, 16, 32, 64)
) | frozenset(FLOAT_DTYPES)


def _mask_array(mask: Any, shape: tuple[int, ...]) -> np.ndarray:
    mask = _as_array("mask", mask)
    if mask.shape != shape:
        raise ValueError(
            f"mask has shape {mask.shape} but the token arrays have shape {shape}: "
            "pass a 0/1 mask of the same (B, T) shape"
        )
    if mask.dtype == np.bool_:
        return kernel_array(mask.reshape(-1)).view(np.uint8)
    if mask.dtype.kind not in "biuf":
        raise TypeError(f"mask must be bool or 0/1 numbers, got dtype {mask.dtype}")
    flat = mask.reshape(-1)
    if mask.dtype in _LOOP_MASK_DTYPES:
        valid = np.empty(flat.shape[0], dtype=np.uint8)
        n_threads = _threads.threads_for(flat.shape[0], flat.shape[0])
        if _loops.convert_mask(kernel_array(flat), valid, n_threads):
            return valid
    is_one = flat == 1
    if not np.all(is_one | (flat == 0)):
        bad = flat[~(is_one | (flat == 0))][0]
        raise ValueError(
            f"mask must hold only 0 and 1, found {bad!r}: pass (mask > 0) for a boolean mask"
        )
    return is_one.view(np.uint8)


_FAST_REALS = frozenset((int, np.float64, np.float32, np.int64, np.int32))


def fast_real(value: Any) -> Any:
    """``value`` as the float ``scalar`` makes of it (float(value): its bits) where it is an int
    (not a bool) or a NumPy float or int scalar that a float64 holds, for a stage's fast path,
    whose test is ``type(value) is float`` (``gamma=1`` went the general way before 0.8.21: 3x
    the time at 8 x 128); anything else unchanged, for the general way and its errors. Callers
    test ``type(value) is not float`` first, so that a float costs no call."""
    if type(value) in _FAST_REALS:
        try:
            return float(value)
        except OverflowError:  # an int past float64: the general way says so
            return value
    return value


# The fast paths' tests of their common case (in C where ppo_fast._checks is built), re-exported:
# the stages call them as _validate.common_case, common_packed, common_outputs and (through
# converted_mask) lengths_mask.
from ._common_case import LENGTHS_AS_MASK_POSITIONS as LENGTHS_AS_MASK_POSITIONS  # noqa: E402
from ._common_case import common_case as common_case  # noqa: E402
from ._common_case import common_outputs as common_outputs  # noqa: E402
from ._common_case import common_packed as common_packed  # noqa: E402
from ._common_case import lengths_mask as lengths_mask  # noqa: E402
from ._common_case import python_common_case as python_common_case  # noqa: E402
from ._common_case import python_common_outputs as python_common_outputs  # noqa: E402
from ._common_case import python_common_packed as python_common_packed  # noqa: E402
from ._common_case import python_lengths_mask as python_lengths_mask  # noqa: E402


def common_layout(arrays: tuple[Any, ...], mask: Any, lengths: Any, cu_seqlens: Any) -> Any:
    """The layout a stage's fast path hands its entry where the token ``arrays`` (a tuple) and
    their layout are a common case: None (no mask) or the bool ``mask`` (``common_case``), the
    bool mask of a 0/1 mask of numbers or of ``lengths`` (``converted_mask``), or packed rows'
    (starts, spans) (``common_packed``); else False: the general way, with its errors."""
    if cu_seqlens is not None:
        return (mask is None and lengths is None and common_packed(arrays, cu_seqlens)) or False
    if lengths is None and common_case(arrays, mask):
        return mask
    return converted_mask(arrays, mask, lengths)


def converted_mask(arrays: tuple[Any, ...], mask: Any, lengths: Any = None) -> Any:
    """For the stages' fast paths, where ``common_case(arrays, mask)`` is false or ``lengths``
    is given: beside token ``arrays`` of the common case, the bool mask of the valid positions
    of a 0/1 ``mask`` of numbers (verl's int64 or float ``response_mask``: an exact, C-contiguous
    NumPy array of a dtype the compiled loop takes, of the arrays' shape; converted as
    ``_mask_array`` converts it, in one compiled pass) or of ``lengths`` with no mask (an int64
    or int32 (B,) NumPy array in [0, T], for at most LENGTHS_AS_MASK_POSITIONS positions:
    t < lengths[b], the lengths layout's bits); else False (a mask value other than 0 and 1 or a
    length out of range included): the general way, with its errors. Before 0.8.21 such masks
    and lengths went the general way: 3-4x the time of a call at 8 x 128."""
    if lengths is not None:
        return False if mask is not None else lengths_mask(arrays, lengths)
    if (
        type(mask) is not _NDARRAY
        or mask.dtype not in _LOOP_MASK_DTYPES
        or not mask.flags.carray
        or not common_case(arrays, None)
        or mask.shape != arrays[0].shape
    ):
        return False
    valid = np.empty(mask.shape, dtype=np.uint8)
    n_threads = _threads.threads_for(mask.size, mask.size)
    if not _loops.convert_mask(mask.reshape(-1), valid.reshape(-1), n_threads):
        return False  # a value other than 0 and 1, or no numba
    return valid.view(_BOOL)


def common_padded(arrays: tuple[Any, ...], mask: Any) -> Rows | None:
    """The rows of the common case (``common_case``), or None when it is not."""
    if not common_case(arrays, mask):
        return None
    shape = arrays[0].shape
    starts, spans = padded_layout(*shape)
    flat_mask = EMPTY_MASK if mask is None else mask.ravel().view(_UINT8)
    return Rows(shape, starts, spans, spans, flat_mask, False)


def batch(
    arrays: dict[str, Any],
    *,
    mask: Any = None,
    lengths: Any = None,
    cu_seqlens: Any = None,
) -> tuple[tuple[np.ndarray, ...], Rows]:
    """``token_arrays(**arrays)`` and the ``rows`` of their shape, in one call.

    The common case (``common_padded``) is recognised first and costs about a microsecond; any
    other input takes the general way, with its checks and its error messages.
    """
    if lengths is None and cu_seqlens is None:
        values = tuple(arrays.values())
        fast = common_padded(values, mask)
        if fast is not None:
            return values, fast
    checked = token_arrays(**arrays)
    return checked, rows(checked[0].shape, mask=mask, lengths=lengths, cu_seqlens=cu_seqlens)


def _at_most_one_layout(mask: Any, lengths: Any, cu_seqlens: Any) -> None:
    given = [
        n
        for n, v in (("mask", mask), ("lengths", lengths), ("cu_seqlens", cu_seqlens))
        if v is not None
    ]
    if len(given) > 1:
        raise ValueError(
            f"pass at most one of mask, lengths and cu_seqlens, got {' and '.join(given)}: "
            "they are three ways of saying which positions are valid"
        )


def rows(
    shape: tuple[int, ...],
    *,
    mask: Any = None,
    lengths: Any = None,
    cu_seqlens: Any = None,
) -> Rows:
    """Describe the batch of `shape` given at most one of mask / lengths / cu_seqlens."""
    _at_most_one_layout(mask, lengths, cu_seqlens)
    if cu_seqlens is not None:
        if len(shape) != 1:
            raise ValueError(
                f"cu_seqlens describes packed 1-D arrays, but the token arrays have shape {shape}: "
                "flatten the valid tokens into 1-D arrays, or use mask/lengths for (B, T) arrays"
            )
        cu = _index_array(cu_seqlens, "cu_seqlens")
        n = shape[0]
        if cu.shape[0] < 1:
            raise ValueError("cu_seqlens must have B+1 entries starting at 0, got an empty array")
        if cu[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0, got {cu[0]}")
        spans = np.diff(cu)
        if np.any(spans < 0):
            b = int(np.argmax(spans < 0))
            raise ValueError(
                f"cu_seqlens must be non-decreasing, but cu_seqlens[{b + 1}]={cu[b + 1]} "
                f"< cu_seqlens[{b}]={cu[b]}"
            )
        if cu[-1] != n:
            raise ValueError(f"cu_seqlens must end at the number of tokens N={n}, got {cu[-1]}")
        return Rows(shape, cu[:-1].copy(), spans, spans, EMPTY_MASK, True)

    if len(shape) != 2:
        raise ValueError(
            f"the token arrays are 1-D with shape {shape}: pass cu_seqlens for packed rows "
            "(cu_seqlens=[0, N] for one row), or reshape them to (B, T)"
        )
    n_rows, width = shape
    starts, spans = padded_layout(n_rows, width)
    if lengths is not None:
        lens = _index_array(lengths, "lengths")
        if lens.shape[0] != n_rows:
            raise ValueError(f"lengths must have shape ({n_rows},), got {lens.shape}")
        if np.any((lens < 0) | (lens > width)):
            b = int(np.argmax((lens < 0) | (lens > width)))
            raise ValueError(f"lengths must lie in [0, T={width}], got lengths[{b}]={lens[b]}")
        return Rows(shape, starts, spans, lens, EMPTY_MASK, False)
    flat_mask = EMPTY_MASK if mask is None else _mask_array(mask, shape)
    return Rows(shape, starts, spans, spans, flat_mask, False)


# np.full(n_rows, value, dtype) by (value, the sign of a zero, n_rows, dtype): a scalar
# hyperparameter is the same on every call. Shared by every call; nothing writes into them (the
# kernels read row inputs only).
def per_row(
    name: str,
    value: Any,
    n_rows: int,
    *,
    lo: float = -math.inf,
    hi: float = math.inf,
    allow_inf: bool = False,
    allow_nan: bool = False,
    rows_only: bool = False,
) -> np.ndarray:
    """A scalar or (B,) real hyperparameter or per-row value, as float64 (B,), within [lo, hi].

    The rule of ``scalar``, element by element; per-row data (scores, bootstrap values) pass
    ``allow_inf=True, allow_nan=True`` so that non-finite values propagate as data, and
    ``rows_only=True`` where one value for every row would be a mistake.
    """
    if (
        type(value) is float
        and lo <= value <= hi
        and (allow_inf or -math.inf < value < math.inf)
        and not rows_only
    ):
        # The commonest case, a float in range (NaN fails the comparisons): nothing to check.
        return constant_rows(value, n_rows)
    if isinstance(value, int | float) and not isinstance(value, bool) and not rows_only:
        # The common case, a plain scalar: checked without building arrays (per-call overhead).
        number = scalar(name, value, lo=lo, hi=hi, allow_inf=allow_inf, allow_nan=allow_nan)
        return constant_rows(number, n_rows)
    array = _as_array(name, value)
    if array.dtype.kind not in "iuf":
        raise TypeError(
            f"{name} must be a real number or a (B,) array of real numbers, got dtype "
            f"{array.dtype}" + (": a bool is not a number here" if array.dtype.kind == "b" else "")
        )
    if array.ndim == 0:
        if rows_only:
            raise ValueError(f"{name} must have shape ({n_rows},), one value per row")
        number = scalar(name, array, lo=lo, hi=hi, allow_inf=allow_inf, allow_nan=allow_nan)
        return np.full(n_rows, number)
    if array.shape != (n_rows,):
        raise ValueError(
            f"{name} must {'' if rows_only else 'be a scalar or '}have shape ({n_rows},), one "
            f"value per row, got shape {array.shape}"
        )
    with np.errstate(over="ignore"):  # a float128 beyond float64 becomes inf, refused below
        array = array.astype(np.float64)
    if not (allow_nan and allow_inf) or lo > -math.inf or hi < math.inf:
        finite = np.isfinite(array)
        nan = np.isnan(array)
        bad = (nan & (not allow_nan)) | (~finite & ~nan & (not allow_inf))
        bad |= ~nan & ((array < lo) | (array > hi))
        if np.any(bad):
            b = int(np.argmax(bad))
            _check_number(name, float(array[b]), lo, hi, False, allow_inf, allow_nan, f"[{b}]")
    return array


def _check_number(
    name: str,
    number: float,
    lo: float,
    hi: float,
    open_lo: bool,
    allow_inf: bool,
    allow_nan: bool,
    where: str = "",
) -> float:
    if math.isnan(number):
        if allow_nan:
            return number
        raise ValueError(f"{name}{where} must be a number, got nan")
    if math.isinf(number) and not allow_inf:
        raise ValueError(f"{name}{where} must be finite, got {number!r}")
    if (number <= lo if open_lo else number < lo) or number > hi:
        # an infinite bound is open unless infinities are allowed: "(0, inf)", not "(0, inf]"
        left = "(" if open_lo or (math.isinf(lo) and not allow_inf) else "["
        right = ")" if math.isinf(hi) and not allow_inf else "]"
        raise ValueError(f"{name}{where} must lie in {left}{lo:g}, {hi:g}{right}, got {number!r}")
    return number


def scalar(
    name: str,
    value: Any,
    *,
    lo: float = -math.inf,
    hi: float = math.inf,
    open_lo: bool = False,
    allow_inf: bool = False,
    allow_nan: bool = False,
) -> float:
    """A real hyperparameter within [lo, hi] (or (lo, hi] with open_lo), as a float.

    Real numbers are Python ints and floats, NumPy integer and floating scalars and 0-d real
    arrays (and 0-d real tensors); anything else, bool included, is a TypeError naming the
    argument. NaN is a ValueError unless ``allow_nan``, an infinity unless ``allow_inf``, and
    so is an integer too large for a float64.
    """
    if isinstance(value, float):
        number = value
    elif isinstance(value, int | np.integer) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:
            raise ValueError(
                f"{name} is too large for a float64, got an integer of "
                f"{len(str(abs(int(value))))} digits"
            ) from None
    elif isinstance(value, np.floating):
        with np.errstate(over="ignore"):  # a float128 beyond float64 becomes inf
            number = float(value)
    elif isinstance(value, np.ndarray) or _is_tensor(value):
        array = _as_array(name, value)
        if array.ndim != 0 or array.dtype.kind not in "iuf":
            raise TypeError(
                f"{name} must be a real number, got an array of shape {array.shape} and dtype "
                f"{array.dtype}"
            )
        return scalar(
            name,
            array[()],
            lo=lo,
            hi=hi,
            open_lo=open_lo,
            allow_inf=allow_inf,
            allow_nan=allow_nan,
        )
    else:
        what = "a bool" if isinstance(value, bool | np.bool_) else _describe(value)
        raise TypeError(f"{name} must be a real number (int or float), got {what}")
    return _check_number(name, number, lo, hi, open_lo, allow_inf, allow_nan)


def normaliser(name: str, value: Any, dtype: Any) -> float:
    """A loss's normaliser (``num_tokens``, ``num_seqs`` or ``loss_scale``): a real > 0 whose
    reciprocal, the scale of the loss's rows, is finite in the loss's ``dtype`` (float32 or
    float64). An infinite scale is no loss: the kernels' gradient at masked positions, their 0 in
    the dtype made as scale - scale, would be NaN where the oracle writes 0."""
    number = scalar(name, value, lo=0.0, open_lo=True)
    dtype = np.dtype(dtype)
    largest = _LARGEST_SCALE[dtype]
    if 1.0 / number > largest:
        raise ValueError(
            f"{name} must be at least {1.0 / largest:.4g} for {dtype} inputs, got {value!r}: the "
            f"loss's scale, 1/{name}, overflows {dtype} (pass the count or length it stands for)"
        )
    return number


_LARGEST_SCALE = {dtype: float(np.finfo(dtype).max) for dtype in FLOAT_DTYPES}


def choice(name: str, value: Any, options: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in options:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, options))}, got {value!r}")
    return value


def row_data(name: str, value: Any, ndim: int = 1) -> np.ndarray:
    """Per-row data (the scores of the outcome estimators): a (B,) array, or (B, K) with
    ``ndim=2``, of real numbers. float32 and float64 keep their dtype; bool and integers are read
    as float64. NaN and inf are data: they propagate. Returns a C-contiguous array."""
    array = _as_array(name, value)
    kind = array.dtype.kind
    if kind in "biu":
        array = array.astype(np.float64)
    elif array.dtype not in FLOAT_DTYPES or not array.dtype.isnative:
        hint = _float_hint(name, array.dtype)
        raise TypeError(
            f"{name} must hold real numbers (float32, float64, integers or bool), got dtype "
            f"{array.dtype}: {hint}"
        )
    if array.ndim != ndim:
        what = "(B,), one value per row" if ndim == 1 else "(B, K), one column per reward key"
        raise ValueError(f"{name} must be {ndim}-D {what}, got shape {array.shape}")
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


def row_counts(name: str, value: Any, n_rows: int) -> np.ndarray:
    """A (B,) array of non-negative integers (the valid tokens of each row), as int64."""
    counts = _index_array(value, name)
    if counts.shape != (n_rows,):
        raise ValueError(
            f"{name} must have shape ({n_rows},), one count per row, got shape {counts.shape}"
        )
    if np.any(counts < 0):
        b = int(np.argmax(counts < 0))
        raise ValueError(f"{name}[{b}]={counts[b]} is negative: counts are >= 0")
    return counts


def row_layout(
    n_rows: int,
    *,
    data: str = "scores",
    mask: Any = None,
    lengths: Any = None,
    cu_seqlens: Any = None,
    padded_length: Any = None,
) -> Rows | None:
    """The token layout that a per-row result of ``n_rows`` rows (the rows of the argument named
    ``data``) is broadcast onto, or None.

    There are no token arrays to take the shape from: a ``mask`` gives (B, T), ``lengths`` give
    (B, ``padded_length``) and ``cu_seqlens`` give (cu_seqlens[-1],). ``rows`` checks the rest.
    """
    if padded_length is not None and lengths is None:
        raise ValueError(
            "padded_length is the width T of the (B, T) result of lengths=: pass it with "
            "lengths only (a mask gives T itself, cu_seqlens give packed (N,) results)"
        )
    _at_most_one_layout(mask, lengths, cu_seqlens)
    if mask is None and lengths is None and cu_seqlens is None:
        return None
    if lengths is not None:
        if padded_length is None:
            raise ValueError(
                "lengths needs padded_length=T, the width of the (B, T) result: pass both"
            )
        try:
            width = operator.index(padded_length)
        except TypeError:
            width = None
        if width is None or isinstance(padded_length, bool | np.bool_):
            raise TypeError(
                f"padded_length must be an int, the width T of the result, got "
                f"{_describe(padded_length)}"
            )
        if width < 0:
            raise ValueError(f"padded_length must be >= 0, got {width}")
        shape: tuple[int, ...] = (n_rows, width)
    elif cu_seqlens is not None:
        cu = _index_array(cu_seqlens, "cu_seqlens")
        if cu.shape[0] != n_rows + 1:
            raise ValueError(
                f"cu_seqlens must have B+1 = {n_rows + 1} entries, one more than the {n_rows} "
                f"rows of {data}, got {cu.shape[0]}"
            )
        shape = (int(cu[-1]),)
    else:
        shape = _as_array("mask", mask).shape
        if len(shape) != 2 or shape[0] != n_rows:
            raise ValueError(
                f"mask must be 2-D (B, T) with B = {n_rows}, one row per row of {data}, got "
                f"shape {shape}"
            )
    return rows(shape, mask=mask, lengths=lengths, cu_seqlens=cu_seqlens)
