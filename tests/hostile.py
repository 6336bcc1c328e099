"""A hostile-input generator (bottleneck's ``slow/`` tests have one): every public function, and
through its public stage every kernel of the table, on inputs a caller should not send.

A ``Target`` is one public function (the NumPy API, ``ppo_fast.torch``, the compat modules' main
functions) with a small valid call: B=3 rows of T=5 tokens, a 0/1 mask with a hole and a masked
row end, NaN and inf stored at the masked positions. ``cases(target)`` yields ``Case``s, each a
description, the argument it attacks and a mutation of the call's keyword arguments:

- dtypes: integers, bool, float16, complex, object, big-endian, float8 / bfloat16 / float16 /
  integer / meta tensors in the torch APIs;
- layouts: non-contiguous, F-order, read-only, 0-d, 3-D, empty, transposed, nested lists, ragged
  lists;
- masks: bytes other than 0/1 behind a bool dtype (``np.array([[2, 2, 0]], np.uint8).view(bool)``),
  values other than 0/1, all-zero, wrong shape, wrong dtype;
- lengths and cu_seqlens: out of range, non-monotone, wrong dtype, uint64 above 2**63;
- values: NaN, inf and huge numbers at valid positions and at masked ones;
- hyperparameters: NaN, inf, bool, str, bytes, complex, None, huge, tiny and negative numbers,
  arrays; beside float32 arrays, numbers that float32 rounds to inf, 0 or a subnormal;
- group labels (the outcome estimators; the optimal token baseline's as a per-row argument): too
  few or too many, 2-D, None, NaN, non-integral floats, bool, unhashable, complex, a single
  string, a factorised ``Groups`` of another batch, and the legal ones a caller may send (mixed
  types, UUIDs, 10**12 and -1, beyond 64 bits, all alone);
- options that are not numbers (strings, flags, ddof): unknown strings, None, numbers, bytes;
- flags (True or False) of the token-level estimators: numbers, None, strings, arrays.

What a case must give (``check``): exactly one of the oracle's result (the same call on
backend="python", NaN and inf pattern included; for a case that only changes the memory layout or
the mask's bytes, the oracle's result on the plain call) or a ValueError or TypeError whose message
names the argument; never another exception, never a crash, never a change to any input. The
compat functions reproduce their peers, whose own torch code raises what torch raises (a
RuntimeError for tensors of mismatched shapes, an AssertionError for a bad ``dual_clip``): there,
and only there, those are the peer's answer too (``Target.peer_errors``).
"""

from __future__ import annotations

import copy
import math
import pathlib
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import ppo_fast
from ppo_fast._groups import Groups

B, T = 3, 5
# Row 0 full, row 1 with a hole, row 2 ends early: the masked positions hold junk.
MASK = np.array(
    [[1, 1, 1, 1, 1], [1, 0, 1, 1, 1], [1, 1, 1, 0, 0]],
    dtype=bool,
)
LENGTHS = np.array([5, 4, 3])
CU_SEQLENS = np.array([0, 5, 9, 12])
JUNK = (np.nan, np.inf, -np.inf)


@dataclass(frozen=True)
class Target:
    """One public function and a small valid call of it."""

    name: str
    call: Callable[..., Any]
    build: Callable[[np.random.Generator], dict[str, Any]]  # NumPy arguments of a valid call
    tokens: tuple[str, ...]  # per-token (B, T) arrays, the first being the main one
    mask: str | None = None  # the name of the mask argument, if any
    layouts: bool = False  # takes lengths= and cu_seqlens= too
    scalars: dict[str, Any] = field(default_factory=dict)  # hyperparameter -> a legal value
    per_row: tuple[str, ...] = ()  # (B,) arguments
    torch: bool = False  # tensors in: the NumPy arrays of a case are sent as tensors
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)  # other names in errors
    peer_errors: tuple[type[BaseException], ...] = ()
    padded_length: bool = False  # lengths= comes with padded_length=T (no token array gives T)
    groups: bool = False  # takes one group label per row (groups=, or ``group_argument``)
    group_argument: str = "groups"  # its name: the compat functions take verl's ``index``
    options: tuple[str, ...] = ()  # options that are not numbers (strings, flags, ddof)
    flags: tuple[str, ...] = ()  # arguments that are True or False

    def names(self, argument: str) -> tuple[str, ...]:
        """What an error about ``argument`` may call it: its name, its name in ppo_fast, and for
        a per-token array whose shape the layout contradicts, the token arrays together."""
        token = ("token arrays",) if argument in self.tokens else ()
        return (argument, *self.aliases.get(argument, ()), *token)


@dataclass(frozen=True)
class Case:
    description: str
    argument: str
    mutate: Callable[[dict[str, Any]], dict[str, Any]]
    # The plain call whose oracle result this case must equal (layout-only and mask-byte cases),
    # or None: the oracle on the same call.
    same_as: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    torch_only: bool = False
    numpy_only: bool = False
    float32: bool = False  # the call's float arrays in float32 (tests/test_hostile.py groups it)

    def id(self, target: Target) -> str:
        prefix = "" if self.description.startswith(self.argument) else f"{self.argument}-"
        return f"{target.name}:{prefix}{self.description}"


class TorchDtype:
    """A NumPy array to be sent as a tensor of a torch-only dtype (bfloat16, float8, meta)."""

    def __init__(self, array: np.ndarray, dtype: str, device: str = "cpu"):
        self.array, self.dtype, self.device = array, dtype, device


def _replace(name: str, transform: Callable[[Any], Any]) -> Callable[[dict], dict]:
    def mutate(kwargs: dict) -> dict:
        return {**kwargs, name: transform(kwargs[name])}

    return mutate


def _set(name: str, value: Any) -> Callable[[dict], dict]:
    def mutate(kwargs: dict) -> dict:
        return {**kwargs, name: copy.deepcopy(value)}

    return mutate


def _plain(kwargs: dict) -> dict:
    return kwargs


def _non_contiguous(a: np.ndarray) -> np.ndarray:
    wide = np.repeat(a, 2, axis=-1)
    return wide[..., ::2]


def _f_order(a: np.ndarray) -> np.ndarray:
    return np.asfortranarray(a)


def _read_only(a: np.ndarray) -> np.ndarray:
    a = a.copy()
    a.flags.writeable = False
    return a


def _at_valid(value: float, mask: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    def put(a: np.ndarray) -> np.ndarray:
        a = a.copy()
        a[1, 2] = value  # valid in MASK, in LENGTHS and in every elementwise call
        if mask is None or mask[0, 4]:
            a[0, 4] = -value if not math.isnan(value) else value
        return a

    return put


def _array_cases(target: Target, name: str) -> Iterator[Case]:
    """Dtypes, layouts and values of one per-token array."""
    same = _plain  # the layout cases must equal the plain call
    yield Case("int64", name, _replace(name, lambda a: np.nan_to_num(a).astype(np.int64)))
    yield Case("int32", name, _replace(name, lambda a: np.round(np.nan_to_num(a)).astype(np.int32)))
    yield Case("bool", name, _replace(name, lambda a: a > 0))
    yield Case("uint8", name, _replace(name, lambda a: (a > 0).astype(np.uint8)))
    yield Case("complex", name, _replace(name, lambda a: a.astype(np.complex128)))
    yield Case("object", name, _replace(name, lambda a: a.astype(object)), numpy_only=True)
    yield Case("float16", name, _replace(name, lambda a: a.astype(np.float16)), numpy_only=True)
    yield Case("longdouble", name, _replace(name, lambda a: a.astype(np.longdouble)))
    yield Case("big-endian", name, _replace(name, lambda a: a.astype(">f8")), numpy_only=True)
    yield Case("big-endian-f4", name, _replace(name, lambda a: a.astype(">f4")), numpy_only=True)
    for dtype in ("bfloat16", "float16", "float8_e4m3fn", "int64"):
        yield Case(
            f"tensor-{dtype}",
            name,
            _replace(name, lambda a, d=dtype: TorchDtype(a, d)),
            torch_only=True,
        )
    yield Case(
        "meta-tensor",
        name,
        _replace(name, lambda a: TorchDtype(a, "float32", "meta")),
        torch_only=True,
    )
    yield Case("non-contiguous", name, _replace(name, _non_contiguous), same)
    yield Case("F-order", name, _replace(name, _f_order), same)
    yield Case("read-only", name, _replace(name, _read_only), same, numpy_only=True)
    yield Case("0-d", name, _replace(name, lambda a: a[0, 0].copy()))
    yield Case("3-D", name, _replace(name, lambda a: a[..., None].copy()))
    yield Case("1-D", name, _replace(name, lambda a: a.reshape(-1).copy()))
    yield Case("empty", name, _replace(name, lambda a: a[:0].copy()))
    yield Case("transposed", name, _replace(name, lambda a: a.T.copy()))
    yield Case("nested-lists", name, _replace(name, lambda a: a.tolist()), numpy_only=True)
    yield Case(
        "ragged-lists",
        name,
        _replace(name, lambda a: [row[: 5 - b].tolist() for b, row in enumerate(a)]),
        numpy_only=True,
    )
    yield Case("none", name, _set(name, None))
    yield Case("string", name, _set(name, "logprobs"))
    mask = MASK if target.mask else None
    for value in (np.nan, np.inf, -np.inf, 1e200, 1e38, -745.0, 710.0):
        yield Case(f"{value:g}-at-valid", name, _replace(name, _at_valid(value, mask)))


def _mask_cases(target: Target) -> Iterator[Case]:
    name = target.mask
    clean = _set(name, MASK)

    def bytes_of(value: int) -> Callable[[np.ndarray], np.ndarray]:
        return lambda m: np.where(m, value, 0).astype(np.uint8).view(bool)

    for value in (2, 255):
        yield Case(f"mask-bool-bytes-{value}", name, _replace(name, bytes_of(value)), clean)
    yield Case("mask-int", name, _replace(name, lambda m: m.astype(np.int64)))
    yield Case("mask-float", name, _replace(name, lambda m: m.astype(np.float32)))
    yield Case("mask-value-2", name, _replace(name, lambda m: m.astype(np.int64) * 2))
    yield Case("mask-value-0.5", name, _replace(name, lambda m: m * 0.5))
    yield Case("mask-nan", name, _replace(name, lambda m: np.where(m, np.nan, 0.0)))
    yield Case("mask-all-zero", name, _replace(name, np.zeros_like))
    yield Case("mask-one-valid", name, _set(name, np.arange(B * T).reshape(B, T) == 0))
    yield Case("mask-shape", name, _replace(name, lambda m: m[:, :-1].copy()))
    yield Case("mask-3-D", name, _replace(name, lambda m: m[..., None].copy()))
    yield Case("mask-non-contiguous", name, _replace(name, _non_contiguous), clean)
    yield Case("mask-strings", name, _replace(name, lambda m: m.astype(str)), numpy_only=True)
    yield Case(
        "mask-complex", name, _replace(name, lambda m: m.astype(np.complex64)), numpy_only=True
    )


def _layout_cases(target: Target) -> Iterator[Case]:
    def with_lengths(lengths: Any) -> Callable[[dict], dict]:
        def mutate(kwargs: dict) -> dict:
            width = {"padded_length": T} if target.padded_length else {}
            return {**kwargs, "mask": None, "lengths": copy.deepcopy(lengths), **width}

        return mutate

    def packed(cu_seqlens: Any) -> Callable[[dict], dict]:
        def mutate(kwargs: dict) -> dict:
            flat = {
                n: v[MASK].copy()
                for n, v in kwargs.items()
                if isinstance(v, np.ndarray) and v.shape == MASK.shape and n != target.mask
            }
            return {**kwargs, **flat, "mask": None, "cu_seqlens": copy.deepcopy(cu_seqlens)}

        return mutate

    yield Case("lengths", "lengths", with_lengths(LENGTHS))
    for description, lengths in (
        ("negative", [5, -1, 3]),
        ("above-T", [5, 6, 3]),
        ("float", [5.0, 4.0, 3.0]),
        ("bool", [True, True, False]),
        ("uint64-huge", np.array([5, 2**64 - 1, 3], np.uint64)),
        ("uint64", np.array([5, 4, 3], np.uint64)),
        ("int8", np.array([5, 4, 3], np.int8)),
        ("short", [5, 4]),
        ("2-D", [[5, 4, 3]]),
        ("scalar", 5),
        ("ragged", [[5], [4, 3]]),
        ("strings", ["5", "4", "3"]),
    ):
        yield Case(f"lengths-{description}", "lengths", with_lengths(lengths))
    yield Case("cu_seqlens", "cu_seqlens", packed(CU_SEQLENS))
    for description, cu in (
        ("non-monotone", [0, 5, 4, 12]),
        ("not-from-0", [1, 5, 9, 12]),
        ("short-of-N", [0, 5, 9, 11]),
        ("beyond-N", [0, 5, 9, 13]),
        ("empty", np.zeros(0, np.int64)),
        ("float", [0.0, 5.0, 9.0, 12.0]),
        ("uint64-huge", np.array([0, 2**63, 9, 12], np.uint64)),
        ("int32", np.array(CU_SEQLENS, np.int32)),
        ("2-D", [CU_SEQLENS.tolist()]),
    ):
        yield Case(f"cu_seqlens-{description}", "cu_seqlens", packed(cu))

    def both(kwargs: dict) -> dict:
        return {**kwargs, "lengths": LENGTHS.copy()}

    yield Case("mask-and-lengths", "lengths", both)


HOSTILE_NUMBERS: tuple[tuple[str, Any], ...] = (
    ("nan", math.nan),
    ("inf", math.inf),
    ("-inf", -math.inf),
    ("True", True),
    ("np.bool_", np.True_),
    ("str", "0.5"),
    ("bytes", b"1"),
    ("complex", 0.5 + 0j),
    ("None", None),
    ("huge-int", 10**400),
    ("1e300", 1e300),
    # the smallest float64 above 0: its reciprocal overflows (a loss's normaliser, a divisor)
    ("5e-324", 5e-324),
    ("negative", -1.0),
    ("zero", 0),
    ("array", np.array([0.5, 0.5])),
    ("0-d-array", np.array(0.5)),
    ("np.float32", np.float32(0.5)),
    ("np.int64", np.int64(1)),
    ("list", [0.5]),
)


def _scalar_cases(target: Target) -> Iterator[Case]:
    for name in target.scalars:
        for description, value in HOSTILE_NUMBERS:
            yield Case(f"{name}={description}", name, _set(name, value))


# Hyperparameters beside float32 arrays that float64 holds and float32 does not: the kernels take
# them rounded to float32 (inf, 0, a float32 subnormal), as the oracle does. A SAPO tau of 1e39
# became inf, and numba's 0 made as tau - tau was NaN: the other tau for every token (0.8.41).
FLOAT32_NUMBERS = (("1e39", 1e39), ("1e-40", 1e-40), ("1e-46", 1e-46))


def _in_float32(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {
        name: value.astype(np.float32)
        if isinstance(value, np.ndarray) and value.dtype == np.float64
        else value
        for name, value in kwargs.items()
    }


def _float32_scalar_cases(target: Target) -> Iterator[Case]:
    for name in target.scalars:
        for description, value in FLOAT32_NUMBERS:
            mutate = _set(name, value)
            yield Case(
                f"{name}={description}-float32",
                name,
                lambda kwargs, mutate=mutate: _in_float32(mutate(kwargs)),
                float32=True,
            )


def _per_row_cases(target: Target) -> Iterator[Case]:
    for name in target.per_row:
        for description, value in (
            ("nan-row", np.array([0.5, np.nan, 0.5])),
            ("inf-row", np.array([0.5, np.inf, 0.5])),
            ("bool-rows", np.array([True, False, True])),
            ("int-rows", np.array([1, 0, 1])),
            ("float32-rows", np.array([0.5, 0.25, 1.0], np.float32)),
            ("wrong-length", np.ones(B + 1)),
            ("2-D", np.ones((B, 1))),
            ("strings", np.array(["0.5"] * B)),
            ("object", np.array([0.5, None, 1.0], dtype=object)),
            ("ragged", [[0.5], [0.5, 0.5], []]),
            ("huge-ints", [10**400, 1, 1]),
            ("complex", np.ones(B, np.complex128)),
        ):
            yield Case(f"{name}-{description}", name, _set(name, value))


def _objects(labels: list[Any]) -> np.ndarray:
    """An object array of the labels; np.array would read an array among them as a column."""
    array = np.empty(len(labels), dtype=object)
    for b, label in enumerate(labels):
        array[b] = label
    return array


def _group_cases(target: Target) -> Iterator[Case]:
    u, v = uuid.UUID(int=1), uuid.UUID(int=2)
    for description, labels in (
        ("mixed-types", [1, "q", 1]),
        ("uuids", [u, v, u]),
        ("huge-and-negative", [10**12, -1, 10**12]),
        ("beyond-64-bits", [2**70, 5, 2**70]),
        ("uint64-max", np.array([2**64 - 1, 0, 2**64 - 1], np.uint64)),
        ("integral-floats", np.array([1.0, 2.0, 1.0])),
        ("all-alone", [0, 1, 2]),
        ("factorised", ppo_fast._groups.factorize(["p", "q", "p"], B)),
        ("factorised-other-batch", ppo_fast._groups.factorize(["p", "q"], 2)),
        ("short", ["p", "q"]),
        ("long", ["p", "q", "p", "q"]),
        ("2-D", np.array([["p"], ["q"], ["p"]])),
        ("None-label", ["p", None, "p"]),
        ("nan-label", [0.0, math.nan, 0.0]),
        ("non-integral", np.array([0.5, 1.0, 0.5])),
        ("bool", np.array([True, False, True])),
        ("unhashable", ["p", ["q"], "p"]),
        ("array-label", _objects(["p", np.zeros(2), "p"])),
        ("complex", np.array([1 + 0j, 2, 1])),
        ("string", "pqp"),
        ("scalar", 7),
        ("none", None),
    ):
        argument = target.group_argument
        yield Case(f"{argument}-{description}", argument, _set(argument, labels))


def _option_cases(target: Target) -> Iterator[Case]:
    for name in target.options:
        for description, value in (
            ("unknown", "bogus"),
            ("None", None),
            ("int", 1),
            ("float", 0.5),
            ("bytes", b"raw"),
            ("list", ["raw"]),
        ):
            yield Case(f"{name}={description}", name, _set(name, value))


def _flag_cases(target: Target) -> Iterator[Case]:
    for name in target.flags:
        for description, value in (
            ("1", 1),
            ("0.0", 0.0),
            ("None", None),
            ("str", "yes"),
            ("np.bool_", np.False_),
            ("0-d-array", np.array(True)),
            ("list", [True]),
        ):
            yield Case(f"{name}={description}", name, _set(name, value))


def cases(target: Target) -> list[Case]:
    """Every hostile case of ``target``."""
    out: list[Case] = []
    for name in target.tokens:
        out.extend(_array_cases(target, name))
    if target.mask:
        out.extend(_mask_cases(target))
    if target.layouts:
        out.extend(_layout_cases(target))
    out.extend(_scalar_cases(target))
    out.extend(_float32_scalar_cases(target))
    out.extend(_per_row_cases(target))
    if target.groups:
        out.extend(_group_cases(target))
    out.extend(_option_cases(target))
    out.extend(_flag_cases(target))
    return [
        c
        for c in out
        if not (c.torch_only and not target.torch) and not (c.numpy_only and target.torch)
    ]


# ---- running a case -----------------------------------------------------------------------------


def to_call(target: Target, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The NumPy arguments of a case as the target takes them (tensors for the torch APIs)."""
    if not target.torch:
        return kwargs
    import torch

    def convert(value: Any) -> Any:
        if isinstance(value, TorchDtype):
            tensor = torch.from_numpy(np.ascontiguousarray(value.array, np.float32))
            return tensor.to(device=value.device, dtype=getattr(torch, value.dtype))
        if isinstance(value, np.ndarray) and value.dtype.kind in "biufc" and value.ndim:
            try:
                return torch.from_numpy(value)
            except (TypeError, ValueError):
                return value
        return value

    return {name: convert(value) for name, value in kwargs.items()}


def snapshot(value: Any) -> Any:
    if hasattr(value, "clone") and hasattr(value, "device") and value.device.type != "meta":
        return value.detach().clone()
    return copy.deepcopy(value)


def unchanged(before: Any, after: Any) -> bool:
    if isinstance(after, Groups):  # compared by identity: compare what it holds
        return unchanged(before.ids, after.ids) and unchanged(before.labels, after.labels)
    if hasattr(after, "device") and hasattr(after, "clone"):
        if after.device.type == "meta":
            return True
        if after.dtype != before.dtype or after.shape != before.shape:
            return False
        if after.is_floating_point() or after.is_complex():
            return bool((after.eq(before) | (after.isnan() & before.isnan())).all())
        return bool(after.eq(before).all())
    if isinstance(after, np.ndarray) and after.dtype.kind == "O":
        return repr(after) == repr(before)
    if isinstance(after, np.ndarray):
        return (
            after.dtype == before.dtype
            and after.shape == before.shape
            and np.array_equal(after, before, equal_nan=after.dtype.kind in "fc")
        )
    try:
        return bool(after == before) or after is before
    except Exception:  # a list of NaN, an object array: equal when the reprs are
        return repr(after) == repr(before)


def flatten(result: Any) -> list[np.ndarray]:
    """Every number a result holds, as float64 arrays in a fixed order."""
    if result is None:
        return []
    if hasattr(result, "detach"):
        return [result.detach().double().cpu().numpy()]
    if isinstance(result, ppo_fast.Moments):
        return [np.array([result.count, result.sum, result.sum_sq, result.shift])]
    if isinstance(result, dict):
        return [a for key in sorted(result) for a in flatten(result[key])]
    if isinstance(result, tuple | list):
        return [a for item in result for a in flatten(item)]
    return [np.asarray(result, dtype=np.float64)]


def run(target: Target, kwargs: dict[str, Any], backend: str) -> tuple[str, Any]:
    """("ok", numbers) or ("error", the ValueError or TypeError) of the call on ``backend``."""
    ppo_fast.set_backend(backend)
    try:
        return "ok", flatten(target.call(**kwargs))
    except (ValueError, TypeError) as error:
        return "error", error
    except target.peer_errors as error:
        return "peer-error", error
    finally:
        ppo_fast.set_backend(None)


def _close(actual: np.ndarray, expected: np.ndarray) -> str | None:
    """None when equal to the oracle (NaN and inf pattern, then 1e-5 relative), else why not."""
    if actual.shape != expected.shape:
        return f"shape {actual.shape} != oracle's {expected.shape}"
    if not np.array_equal(np.isnan(actual), np.isnan(expected)):
        return f"NaN pattern differs: {actual!r} vs oracle {expected!r}"
    infinite = np.isinf(expected)
    if not np.array_equal(np.isinf(actual), infinite) or np.any(
        actual[infinite] != expected[infinite]
    ):
        return f"inf pattern differs: {actual!r} vs oracle {expected!r}"
    finite = np.isfinite(expected)
    scale = max(1.0, float(np.abs(expected[finite]).max())) if finite.any() else 1.0
    if not np.allclose(actual[finite], expected[finite], rtol=1e-5, atol=1e-5 * scale):
        return f"values differ: {actual!r} vs oracle {expected!r}"
    return None


class _Later:
    """A failure message made when it is shown: ``check`` describes each case's arrays only if an
    assertion fails (made for every case, they were a twentieth of the hostile tests' time)."""

    def __init__(self, make):
        self.make = make

    def __str__(self) -> str:
        return self.make()

    __repr__ = __str__


def describe(target: Target, case: Case, kwargs: dict[str, Any]) -> str:
    """The whole case, for a failure message."""
    lines = [f"{target.name}, case {case.description!r} (argument {case.argument})"]
    for name, value in kwargs.items():
        if isinstance(value, np.ndarray):
            text = f"{value.dtype} {np.array2string(value, threshold=20, precision=6)}"
        else:
            text = repr(value)
        lines.append(f"  {name} = {' '.join(text.split())[:200]}")
    return "\n".join(lines)


def _raised_by_ppo_fast(error: BaseException) -> bool:
    """Whether ``error`` comes from ppo_fast itself, not from a peer's torch code in a compat
    module or the peer's own copied code that it runs (ppo_fast/_peers): those raise what the
    peer raises."""
    filename = pathlib.Path(traceback.extract_tb(error.__traceback__)[-1].filename).resolve()
    package = pathlib.Path(ppo_fast.__file__).resolve().parent
    # Parts below the package, not the whole path: a checkout in a folder named like "compat"
    # would otherwise pass every error as the peer's.
    if not filename.is_relative_to(package):
        return False
    parts = filename.relative_to(package).parts
    return "compat" not in parts and "_peers" not in parts


def expected_names(target: Target, kwargs: dict[str, Any]) -> list[tuple[str, ...]]:
    return [target.names(name) for name in kwargs]


def check(target: Target, case: Case, compiled: list[str]) -> str:
    """Run one case on the oracle and on each compiled backend; assert the contract of the module
    docstring and return the outcome ("result", "error" or "peer-error")."""
    kwargs = to_call(target, case.mutate(target.build(np.random.default_rng(0))))
    before = {name: snapshot(value) for name, value in kwargs.items()}
    what = _Later(
        lambda: describe(target, case, case.mutate(target.build(np.random.default_rng(0))))
    )
    backends = list(compiled)
    if case.same_as is None:
        expected = run(target, kwargs, "python")
    else:
        plain = case.same_as(target.build(np.random.default_rng(0)))
        expected = run(target, to_call(target, plain), "python")
        backends.insert(0, "python")
    if expected[0] == "error" and _raised_by_ppo_fast(expected[1]):
        message = str(expected[1])
        names = target.names(case.argument)
        if target.peer_errors:  # the compat functions promote dtypes across their arguments
            names = tuple(n for argument in expected_names(target, kwargs) for n in argument)
        assert any(name in message for name in names), (
            f"the error does not name {case.argument}: {type(expected[1]).__name__}: "
            f"{message}\n{what}"
        )
    for backend in backends:
        got = run(target, kwargs, backend)
        assert got[0] == expected[0], (
            f"{backend} gives {got[0]} ({got[1]!r:.300}) where the oracle gives "
            f"{expected[0]} ({expected[1]!r:.300})\n{what}"
        )
        if got[0] != "ok":
            assert type(got[1]) is type(expected[1]), f"{backend}: {got[1]!r}\n{what}"
            continue
        assert len(got[1]) == len(expected[1]), what
        for index, (actual, oracle) in enumerate(zip(got[1], expected[1], strict=True)):
            why = _close(actual, oracle)
            assert why is None, f"{backend}, output {index}: {why}\n{what}"
    for name, value in kwargs.items():
        assert unchanged(before[name], value), f"the call modified {name}\n{what}"
    return expected[0]


# ---- the targets --------------------------------------------------------------------------------


def _tokens(rng: np.random.Generator, *names: str, junk: bool = True, logp: bool = False):
    """(B, T) float64 arrays, junk (NaN, inf) at the masked positions."""
    out = {}
    for name in names:
        values = rng.normal(size=(B, T))
        if logp:
            values = -np.abs(values)
        if junk:
            values[~MASK] = rng.choice(JUNK, size=int((~MASK).sum()))
        out[name] = values
    return out


def _numpy_targets() -> list[Target]:
    def kl(rng):
        return {
            **_tokens(rng, "logprobs", "ref_logprobs", junk=False, logp=True),
            "estimator": "k3",
        }

    def shape(rng):
        return {
            "scores": rng.normal(size=B),
            **_tokens(rng, "logprobs", "ref_logprobs", logp=True),
            "kl_coef": 0.1,
            "estimator": "k3",
            "mask": MASK.copy(),
        }

    def gae(rng):
        return {
            **_tokens(rng, "rewards", "values"),
            "gamma": 0.99,
            "lam": 0.95,
            "bootstrap": rng.normal(size=B),
            "mask": MASK.copy(),
        }

    def returns(rng, **extra):
        return {
            **_tokens(rng, "rewards"),
            "gamma": 0.99,
            "bootstrap": rng.normal(size=B),
            "mask": MASK.copy(),
            **extra,
        }

    def optimal_token_baseline(rng):
        arrays = _tokens(rng, "rewards", "sum_pi_squared", "is_weights")
        arrays.update(_tokens(rng, "old_logprobs", logp=True))
        # Rows 0 and 2 are one group (row 2 is shorter: the zero tail), row 1 is alone.
        return {**arrays, "groups": np.array([7, 3, 7]), "eps": 1e-8, "mask": MASK.copy()}

    def moments(rng):
        return {**_tokens(rng, "x"), "shift": 0.5, "mask": MASK.copy()}

    def whiten(rng):
        return {**_tokens(rng, "x"), "eps": 1e-8, "mask": MASK.copy()}

    def policy(rng, agg="token-mean"):
        arrays = _tokens(rng, "logprobs", "old_logprobs", logp=True)
        arrays.update(_tokens(rng, "advantages", "weights"))
        arrays["weights"] = np.abs(arrays["weights"])
        return {**arrays, "dual_clip": 3.0, "agg": agg, "mask": MASK.copy()}

    def family(rng, **options):
        arrays = _tokens(rng, "logprobs", "old_logprobs", logp=True)
        arrays.update(_tokens(rng, "advantages", "weights"))
        arrays["weights"] = np.abs(arrays["weights"])
        return {**arrays, **options, "mask": MASK.copy()}

    def value(rng, agg="token-mean"):
        scale = {"loss_scale": 8.0} if agg == "seq-mean-token-sum-norm" else {}
        arrays = _tokens(rng, "values", "old_values", "returns")
        return {**arrays, "clip": 0.2, "agg": agg, **scale, "mask": MASK.copy()}

    rows = {"mask": "mask", "layouts": True}
    policy_scalars = {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": 3.0, "log_ratio_clamp": 20.0}
    return [
        Target(
            "kl_penalty",
            ppo_fast.kl_penalty,
            kl,
            ("logprobs", "ref_logprobs"),
            scalars={"clamp": 10.0},
        ),
        Target(
            "shape_rewards",
            ppo_fast.shape_rewards,
            shape,
            ("logprobs", "ref_logprobs"),
            scalars={"kl_coef": 0.1, "clamp": 10.0},
            per_row=("scores",),
            **rows,
        ),
        Target(
            "gae",
            ppo_fast.gae,
            gae,
            ("rewards", "values"),
            scalars={"gamma": 0.99, "lam": 0.95},
            per_row=("gamma", "lam", "bootstrap"),
            **rows,
        ),
        Target(
            "discounted_returns",
            ppo_fast.discounted_returns,
            returns,
            ("rewards",),
            scalars={"gamma": 0.99},
            per_row=("gamma", "bootstrap"),
            **rows,
        ),
        Target(
            "reinforce_plus_plus",
            ppo_fast.reinforce_plus_plus,
            lambda rng: returns(rng, eps=1e-8, unbiased=True),
            ("rewards",),
            scalars={"gamma": 0.99, "eps": 1e-8},
            per_row=("gamma", "bootstrap"),
            flags=("whiten", "unbiased"),
            **rows,
        ),
        Target(
            "remax",
            ppo_fast.remax,
            lambda rng: returns(rng, baselines=rng.normal(size=B)),
            ("rewards",),
            scalars={"gamma": 0.99},
            per_row=("baselines", "gamma", "bootstrap"),
            **rows,
        ),
        Target(
            "optimal_token_baseline",
            ppo_fast.optimal_token_baseline,
            optimal_token_baseline,
            ("rewards", "old_logprobs", "sum_pi_squared", "is_weights"),
            scalars={"eps": 1e-8, "gamma": 1.0},
            per_row=("groups", "gamma", "bootstrap"),
            flags=("zero_tail",),
            **rows,
        ),
        Target(
            "masked_moments",
            ppo_fast.masked_moments,
            moments,
            ("x",),
            scalars={"shift": 0.5},
            **rows,
        ),
        Target("whiten", ppo_fast.whiten, whiten, ("x",), scalars={"eps": 1e-8}, **rows),
        Target(
            "clipped_surrogate",
            ppo_fast.clipped_surrogate,
            policy,
            ("logprobs", "old_logprobs", "advantages", "weights"),
            scalars={**policy_scalars, "num_tokens": 10.0},
            **rows,
        ),
        Target(
            "clipped_surrogate[seq-mean-token-mean]",
            ppo_fast.clipped_surrogate,
            lambda rng: policy(rng, "seq-mean-token-mean"),
            ("logprobs", "advantages"),
            scalars={"num_seqs": 4.0},
            **rows,
        ),
        Target(
            "reinforce_loss",
            ppo_fast.reinforce_loss,
            lambda rng: family(rng, beta=0.5),
            ("logprobs", "old_logprobs", "advantages", "weights"),
            scalars={"beta": 0.5, "num_tokens": 10.0},
            **rows,
        ),
        Target(
            "cispo_loss",
            ppo_fast.cispo_loss,
            lambda rng: family(rng, clip_low=0.2, clip_high=0.28, log_ratio_clamp=20.0),
            ("logprobs", "old_logprobs", "advantages", "weights"),
            scalars={"clip_low": 0.2, "clip_high": 0.28, "log_ratio_clamp": 20.0},
            **rows,
        ),
        Target(
            "sapo_loss[seq-mean-token-mean]",
            ppo_fast.sapo_loss,
            lambda rng: family(rng, tau_pos=1.0, tau_neg=1.05, agg="seq-mean-token-mean"),
            ("logprobs", "old_logprobs", "advantages", "weights"),
            scalars={"tau_pos": 1.0, "tau_neg": 1.05, "num_seqs": 4.0},
            **rows,
        ),
        Target(
            "gspo_loss",
            ppo_fast.gspo_loss,
            lambda rng: family(rng, form="sequence", dual_clip=3.0, log_ratio_max=10.0),
            ("logprobs", "old_logprobs", "advantages", "weights"),
            scalars={"clip_low": 0.2, "dual_clip": 3.0, "log_ratio_max": 10.0, "num_tokens": 10.0},
            options=("form",),
            **rows,
        ),
        Target(
            "geo_mean_loss",
            ppo_fast.geo_mean_loss,
            lambda rng: family(rng, clip_low=0.2, clip_high=0.28),
            ("logprobs", "old_logprobs", "advantages", "weights"),
            scalars={"clip_low": 0.2, "clip_high": 0.28, "num_seqs": 4.0},
            **rows,
        ),
        Target(
            "dppo_loss[kl]",
            ppo_fast.dppo_loss,
            lambda rng: family(rng, divergence="kl", log_ratio_clamp=20.0),
            ("logprobs", "old_logprobs", "advantages", "weights"),
            scalars={
                "divergence_low": 0.05,
                "divergence_high": 0.1,
                "ratio_cap": 3.0,
                "log_ratio_clamp": 20.0,
                "num_tokens": 10.0,
            },
            options=("divergence",),
            **rows,
        ),
        Target(
            "kl_cov_loss",
            ppo_fast.kl_cov_loss,
            lambda rng: {**family(rng, coef=0.5), "selected": rng.random(MASK.shape) < 0.3},
            ("logprobs", "old_logprobs", "advantages", "weights"),
            scalars={"coef": 0.5, "num_tokens": 10.0},
            **rows,
        ),
        Target(
            "kl_cov_selection",
            ppo_fast.kl_cov_selection,
            lambda rng: {
                **_tokens(rng, "logprobs", logp=True),
                **_tokens(rng, "advantages"),
                "ratio": 0.3,
                "mask": MASK.copy(),
            },
            ("logprobs", "advantages"),
            scalars={"ratio": 0.3},
            **rows,
        ),
        Target(
            "value_loss",
            ppo_fast.value_loss,
            value,
            ("values", "old_values", "returns"),
            scalars={"clip": 0.2, "num_tokens": 10.0},
            **rows,
        ),
        Target(
            "value_loss[seq-mean-token-sum-norm]",
            ppo_fast.value_loss,
            lambda rng: value(rng, "seq-mean-token-sum-norm"),
            ("values",),
            scalars={"loss_scale": 8.0},
            **rows,
        ),
    ]


# The public stages that ppo_fast.torch has no twin of yet: no torch target for them.
NUMPY_ONLY = ("discounted_returns", "reinforce_plus_plus", "remax", "optimal_token_baseline")


def _torch_targets(numpy_targets: list[Target]) -> list[Target]:
    import ppo_fast.torch as pt

    out = []
    for target in numpy_targets:
        if target.name in NUMPY_ONLY:
            continue
        function = getattr(pt, target.call.__name__)
        out.append(
            Target(
                f"torch.{target.name}",
                function,
                target.build,
                target.tokens,
                target.mask,
                target.layouts,
                target.scalars,
                target.per_row,
                torch=True,
            )
        )
    return out


class VerlConfig(dict):
    """verl's ActorConfig as the policy loss reads it: attributes and ``get``."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _compat_targets() -> list[Target]:
    from ppo_fast.compat import openrlhf, trl, verl

    # What the peers' own torch code raises on what it cannot take (None.dtype, a 0-d tensor's
    # shape[1], a bad dual_clip's assert, a huge int times a tensor): the peer's answer too.
    peer = (RuntimeError, AssertionError, AttributeError, IndexError, OverflowError)

    def with_mask(name: str, arrays: dict, dtype=np.float32) -> dict:
        return {**arrays, name: MASK.astype(dtype)}

    def verl_gae(rng):
        return with_mask(
            "response_mask",
            {**_tokens(rng, "token_level_rewards", "values"), "gamma": 0.99, "lam": 0.95},
        )

    def verl_policy(rng):
        arrays = _tokens(rng, "old_log_prob", "log_prob", logp=True)
        arrays.update(_tokens(rng, "advantages"))
        config = VerlConfig(
            clip_ratio=0.2,
            clip_ratio_low=None,
            clip_ratio_high=0.28,
            clip_ratio_c=3.0,
            global_batch_info={},
        )
        return with_mask(
            "response_mask", {**arrays, "loss_agg_mode": "token-mean", "config": config}
        )

    def verl_value(rng):
        return with_mask(
            "response_mask", {**_tokens(rng, "vpreds", "returns", "values"), "cliprange_value": 0.5}
        )

    def verl_kl(rng):
        return {
            **_tokens(rng, "logprob", "ref_logprob", junk=False, logp=True),
            "kl_penalty": "low_var_kl",
        }

    def verl_agg(rng):
        return with_mask(
            "loss_mask", {**_tokens(rng, "loss_mat"), "loss_agg_mode": "seq-mean-token-mean"}
        )

    def orl_policy(rng):
        arrays = _tokens(rng, "log_probs", "old_log_probs", logp=True)
        arrays.update(_tokens(rng, "advantages"))
        return with_mask("action_mask", {**arrays, "dual_clip": 3.0})

    def orl_value(rng):
        return with_mask(
            "action_mask", {**_tokens(rng, "values", "old_values", "returns"), "clip_eps": 0.2}
        )

    def orl_gae(rng):
        return with_mask(
            "action_mask", {**_tokens(rng, "values", "rewards"), "gamma": 0.99, "lambd": 0.95}
        )

    def trl_rollout(rng):
        return {
            **_tokens(rng, "logprobs", "ref_logprobs", junk=False, logp=True),
            **_tokens(rng, "values", junk=False),
            "scores": rng.normal(size=B),
            "sequence_lengths": LENGTHS - 2,
            "kl_coef": 0.05,
            "gamma": 1.0,
            "lam": 0.95,
        }

    def trl_whiten(rng):
        return with_mask("mask", _tokens(rng, "values"), bool)

    def policy_loss(dual_clip=None, **kwargs):
        return openrlhf.PolicyLoss(dual_clip=dual_clip)(**kwargs)

    def gspo_policy_loss(dual_clip=None, **kwargs):
        return openrlhf.PolicyLoss(dual_clip=dual_clip, policy_loss_type="gspo")(**kwargs)

    def trl_grpo(rng):
        arrays = _tokens(rng, "per_token_logps", "old_per_token_logps", logp=True)
        arrays.update(_tokens(rng, "advantages"))
        options = {"loss_type": "grpo", "importance_sampling_level": "sequence", "delta": 2.0}
        return with_mask("completion_mask", {**arrays, **options})

    def value_loss(clip_eps=None, **kwargs):
        return openrlhf.ValueLoss(clip_eps=clip_eps)(**kwargs)

    common = {"torch": True, "peer_errors": peer}
    return [
        Target(
            "verl.compute_gae_advantage_return",
            verl.compute_gae_advantage_return,
            verl_gae,
            ("token_level_rewards", "values"),
            "response_mask",
            scalars={"gamma": 0.99, "lam": 0.95},
            aliases={"token_level_rewards": ("rewards",), "response_mask": ("mask",)},
            **common,
        ),
        Target(
            "verl.compute_policy_loss_vanilla",
            verl.compute_policy_loss_vanilla,
            verl_policy,
            ("old_log_prob", "log_prob", "advantages"),
            "response_mask",
            aliases={
                "old_log_prob": ("old_logprobs",),
                "log_prob": ("logprobs",),
                "response_mask": ("mask",),
            },
            **common,
        ),
        Target(
            "verl.compute_value_loss",
            verl.compute_value_loss,
            verl_value,
            ("vpreds", "returns", "values"),
            "response_mask",
            scalars={"cliprange_value": 0.5},
            aliases={
                "vpreds": ("values",),
                "values": ("old_values",),
                "cliprange_value": ("clip",),
                "response_mask": ("mask",),
            },
            **common,
        ),
        Target("verl.kl_penalty", verl.kl_penalty, verl_kl, ("logprob", "ref_logprob"), **common),
        Target("verl.agg_loss", verl.agg_loss, verl_agg, ("loss_mat",), "loss_mask", **common),
        Target(
            "openrlhf.PolicyLoss",
            policy_loss,
            orl_policy,
            ("log_probs", "old_log_probs", "advantages"),
            "action_mask",
            scalars={"dual_clip": 3.0},
            aliases={
                "log_probs": ("logprobs",),
                "old_log_probs": ("old_logprobs",),
                "action_mask": ("mask",),
            },
            **common,
        ),
        Target(
            "openrlhf.PolicyLoss[gspo]",
            gspo_policy_loss,
            orl_policy,
            ("log_probs", "old_log_probs", "advantages"),
            "action_mask",
            scalars={"dual_clip": 3.0},
            aliases={
                "log_probs": ("logprobs",),
                "old_log_probs": ("old_logprobs",),
                "action_mask": ("mask",),
            },
            **common,
        ),
        Target(
            "trl.grpo_loss",
            trl.grpo_loss,
            trl_grpo,
            ("per_token_logps", "old_per_token_logps", "advantages"),
            "completion_mask",
            scalars={"epsilon": 0.2, "delta": 2.0},
            aliases={
                "per_token_logps": ("logprobs",),
                "old_per_token_logps": ("old_logprobs",),
                "epsilon": ("clip_low",),
                "delta": ("dual_clip", "delta"),
                "completion_mask": ("mask",),
            },
            options=("loss_type", "importance_sampling_level"),
            **common,
        ),
        Target(
            "openrlhf.ValueLoss",
            value_loss,
            orl_value,
            ("values", "old_values", "returns"),
            "action_mask",
            scalars={"clip_eps": 0.2},
            aliases={"clip_eps": ("clip",), "action_mask": ("mask",)},
            **common,
        ),
        Target(
            "openrlhf.get_advantages_and_returns",
            openrlhf.get_advantages_and_returns,
            orl_gae,
            ("values", "rewards"),
            "action_mask",
            scalars={"gamma": 0.99, "lambd": 0.95},
            aliases={"lambd": ("lam",), "action_mask": ("mask",)},
            **common,
        ),
        Target(
            "trl.rollout_advantages",
            trl.rollout_advantages,
            trl_rollout,
            ("logprobs", "ref_logprobs", "values"),
            scalars={"kl_coef": 0.05, "gamma": 1.0, "lam": 0.95},
            per_row=("scores",),
            aliases={"values": ("rewards",)},  # the shaped rewards take the values' dtype
            **common,
        ),
        Target(
            "trl.masked_whiten",
            trl.masked_whiten,
            trl_whiten,
            ("values",),
            "mask",
            aliases={"values": ("x",)},
            **common,
        ),
    ]


def _outcome_targets() -> list[Target]:
    """The outcome estimators: per-row scores, group labels, a layout to broadcast onto."""

    def rows(rng, **options):
        return {
            "scores": rng.normal(size=B),
            "groups": ["p", "q", "p"],  # q is a group of one
            "mask": MASK.copy(),
            **options,
        }

    def keys(rng):
        return {**rows(rng), "scores": rng.normal(size=(B, 3)), "weights": np.array([1, 0.5, 2])}

    def per_row(rng):
        return {"per_row": rng.normal(size=B), "mask": MASK.copy()}

    def token_counts(rng):
        return {"scores": rng.normal(size=B), "groups": [4, 4, 9], "token_counts": LENGTHS.copy()}

    layout = {"mask": "mask", "layouts": True, "padded_length": True}
    grouped = {**layout, "groups": True}
    singleton_nan = ("singleton", "nan")
    grpo_options = ("std", "eps_in_sqrt", "ddof", *singleton_nan)
    whitening = ("whiten", "unbiased")
    return [
        Target(
            "grpo",
            ppo_fast.grpo,
            rows,
            (),
            scalars={"eps": 1e-6},
            per_row=("scores",),
            options=grpo_options,
            **grouped,
        ),
        Target(
            "rloo", ppo_fast.rloo, rows, (), per_row=("scores",), options=singleton_nan, **grouped
        ),
        Target(
            "opo", ppo_fast.opo, rows, (), per_row=("scores",), options=singleton_nan, **grouped
        ),
        Target(
            "opo[token_counts]",
            ppo_fast.opo,
            token_counts,
            (),
            per_row=("scores", "token_counts"),
            groups=True,
        ),
        Target(
            "gpg",
            ppo_fast.gpg,
            rows,
            (),
            scalars={"alpha": 2.0, "f_norm": 0.5},
            per_row=("scores",),
            options=singleton_nan,
            **grouped,
        ),
        Target(
            "pass_at_k",
            ppo_fast.pass_at_k,
            lambda rng: rows(rng, singleton="raw"),
            (),
            scalars={"eps": 1e-6},
            per_row=("scores",),
            options=("normalize", "ddof", *singleton_nan),
            **grouped,
        ),
        Target(
            "reinforce_plus_plus_baseline",
            ppo_fast.reinforce_plus_plus_baseline,
            rows,
            (),
            scalars={"whiten_eps": 1e-8},
            per_row=("scores",),
            options=(*whitening, *singleton_nan),
            **grouped,
        ),
        Target(
            "gdpo",
            ppo_fast.gdpo,
            keys,
            (),
            scalars={"eps": 1e-6, "whiten_eps": 1e-8},
            per_row=("scores", "weights"),
            options=(*whitening, *grpo_options),
            **grouped,
        ),
        Target(
            "broadcast_to_tokens",
            ppo_fast.broadcast_to_tokens,
            per_row,
            (),
            per_row=("per_row",),
            **layout,
        ),
    ]


def _compat_estimator_targets() -> list[Target]:
    """The compat modules' advantage estimators: verl's (token-level rewards summed into one
    score per row, grouped by an ``index`` of uids; the token-level ones), OpenRLHF's returns,
    TRL's GRPO and RLOO blocks."""
    from ppo_fast.compat import openrlhf, trl, verl

    peer = (RuntimeError, AssertionError, AttributeError, IndexError, OverflowError)

    def verl_rows(rng):
        return {
            **_tokens(rng, "token_level_rewards", junk=False),
            "response_mask": MASK.astype(np.int64),
            "index": _objects(["p", "q", "p"]),  # q is a group of one
            "epsilon": 1e-6,
        }

    def verl_tokens(rng):
        return {
            **_tokens(rng, "token_level_rewards"),
            "response_mask": MASK.astype(np.int64),
            "config": VerlConfig(gamma=0.9),
        }

    def verl_remax(rng):
        return {**verl_tokens(rng), "reward_baselines": rng.normal(size=B)}

    def verl_otb(rng):
        probabilities = rng.uniform(0.05, 0.95, size=(B, T))
        return {
            **_tokens(rng, "token_level_rewards"),
            "response_mask": MASK.astype(np.int64),
            "index": _objects(["p", "q", "p"]),
            "old_log_probs": np.log(probabilities),
            "sum_pi_squared": probabilities**2 + 0.1,
            "epsilon": 1e-8,
        }

    def orl_returns(rng):
        return {**_tokens(rng, "rewards"), "action_mask": MASK.copy(), "gamma": 0.9}

    def trl_rows(rng):
        return {
            **_tokens(rng, "rewards_per_func", junk=False),  # five reward functions
            "num_generations": 3,
            "scale_rewards": "group",
            "multi_objective_aggregation": "sum_then_normalize",
        }

    def trl_rloo(rng):
        return {
            **_tokens(rng, "rewards_per_func", junk=False),
            **_tokens(rng, "old_per_token_logps", "ref_per_token_logps", logp=True),
            "completion_mask": MASK.astype(np.int64),
            "num_generations": 3,
            "beta": 0.05,
        }

    verl_options = {
        "mask": "response_mask",
        "groups": True,
        "group_argument": "index",
        "scalars": {"epsilon": 1e-6},
        "aliases": {"epsilon": ("eps",), "response_mask": ("mask",)},
        "torch": True,
        "peer_errors": peer,
    }
    return [
        Target(
            "verl.compute_grpo_outcome_advantage",
            verl.compute_grpo_outcome_advantage,
            verl_rows,
            ("token_level_rewards",),
            **verl_options,
        ),
        Target(
            "verl.compute_grpo_vectorized_outcome_advantage",
            verl.compute_grpo_vectorized_outcome_advantage,
            verl_rows,
            ("token_level_rewards",),
            **verl_options,
        ),
        Target(
            "verl.compute_rloo_vectorized_outcome_advantage",
            verl.compute_rloo_vectorized_outcome_advantage,
            verl_rows,
            ("token_level_rewards",),
            **verl_options,
        ),
        Target(
            "verl.compute_reinforce_plus_plus_outcome_advantage",
            verl.compute_reinforce_plus_plus_outcome_advantage,
            verl_tokens,
            ("token_level_rewards",),
            "response_mask",
            aliases={"token_level_rewards": ("rewards",), "response_mask": ("mask",)},
            torch=True,
            peer_errors=peer,
        ),
        Target(
            "verl.compute_remax_outcome_advantage",
            verl.compute_remax_outcome_advantage,
            verl_remax,
            ("token_level_rewards",),
            "response_mask",
            per_row=("reward_baselines",),
            aliases={"token_level_rewards": ("rewards",), "response_mask": ("mask",)},
            torch=True,
            peer_errors=peer,
        ),
        *(
            Target(
                f"verl.{function.__name__}",
                function,
                verl_otb,
                ("token_level_rewards", "old_log_probs", "sum_pi_squared"),
                **{
                    **verl_options,
                    "aliases": {
                        "token_level_rewards": ("rewards",),
                        "old_log_probs": ("old_logprobs",),
                        "epsilon": ("eps",),
                        "response_mask": ("mask",),
                    },
                    "scalars": {"epsilon": 1e-8},
                },
            )
            for function in (
                verl.compute_optimal_token_baseline_advantage,
                verl.compute_multi_turn_optimal_token_baseline_advantage,
            )
        ),
        Target(
            "openrlhf.get_cumulative_returns",
            openrlhf.get_cumulative_returns,
            orl_returns,
            ("rewards",),
            "action_mask",
            scalars={"gamma": 0.9},
            aliases={"action_mask": ("mask",)},
            torch=True,
            peer_errors=peer,
        ),
        Target(
            "trl.grpo_advantages",
            trl.grpo_advantages,
            trl_rows,
            ("rewards_per_func",),
            scalars={"num_generations": 3},
            options=("scale_rewards", "multi_objective_aggregation"),
            torch=True,
            peer_errors=peer,
        ),
        Target(
            "trl.rloo_advantages",
            trl.rloo_advantages,
            trl_rloo,
            ("rewards_per_func", "old_per_token_logps", "ref_per_token_logps"),
            "completion_mask",
            scalars={"num_generations": 3, "beta": 0.05},
            torch=True,
            peer_errors=peer,
        ),
    ]


def targets() -> list[Target]:
    """Every target: the NumPy API, ppo_fast.torch, the compat modules' main functions and
    advantage estimators, and the outcome estimators."""
    numpy_targets = _numpy_targets()
    return [
        *numpy_targets,
        *_torch_targets(numpy_targets),
        *_compat_targets(),
        *_compat_estimator_targets(),
        *_outcome_targets(),
    ]
