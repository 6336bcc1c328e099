"""``warmup``: compile every kernel of the table ahead of its first call.

It sits above the stages and the backends: it calls each kernel of ``_spec.KERNELS`` directly,
with arguments built from the table (``_examples``), so a kernel added to the table is warmed up
without an edit here.
"""

from __future__ import annotations

import numpy as np

from . import _backend, _examples, _groups, _loops, _threads, _validate, outcome
from ._spec import KERNELS


def warmup(backend: str | None = None, dtypes: tuple[str, ...] = ("float32", "float64")) -> None:
    """Compile every kernel of ``backend`` for ``dtypes`` now rather than at first use.

    Runs each kernel on a small batch and, when more than one thread is in use, on one large
    enough to take the parallel build; every build of a specialised kernel (each KL estimator),
    and its one-thread build that a fast path calls (``_backend.table_kernel``, 0.8.33);
    the common-case entry of each kernel that has one (``_backend.common``), without a mask and
    with a bool one, on each of those batches, and its entry for packed rows (0.8.28); for a
    kernel whose long rows run in chunks (GAE), a row that long too; and the conversion of a 0/1
    mask of int64, int32 or ``dtypes`` numbers that the stages' fast paths run
    (``_loops.convert_mask``). Before 0.8.24 the entries with a mask and the conversion compiled
    at the first call that used them; before 0.8.33, DPPO's entries, KL-Cov's common entry and
    the one-thread builds of kl_penalty and shape_rewards (each call's arguments are of the types
    warmup's are: tests/test_backend.py checks every stage's).
    For cython and python this only loads the backend. Whatever the backend, it also compiles
    the hash table that numbers many integer group ids (``_groups``) and the loops of the group
    estimators (``_loops``), for ``dtypes``, onto a mask and onto lengths.
    """
    _warm_group_estimators(dtypes)
    name = _backend.get_backend(backend)
    sizes = [(2, 8)]
    if _threads.get_num_threads() > 1:
        sizes.append((2, _threads.MIN_POSITIONS_PER_THREAD))
    rng = np.random.default_rng(0)
    for dtype in dtypes:
        for kernel in KERNELS.values():
            shapes = sizes
            if kernel.chunks is not None:  # and a row long enough to run in chunks
                shapes = [
                    *sizes,
                    *[(1, max(kernel.chunks.long_row + 1, s[0] * s[1])) for s in sizes],
                ]
            for shape in shapes:
                rows = _validate.rows(shape)
                for scalars in _examples.codes(kernel):
                    arguments = _examples.arguments(kernel, rows, dtype, rng, scalars=scalars)
                    _backend.run(kernel.name, name, **arguments)
                    # and its one-thread build, which a fast path calls on one thread (numba's
                    # serial_table of each KL estimator: compiled at the first such call of
                    # kl_penalty and shape_rewards until 0.8.33)
                    code = scalars[kernel.specialise] if kernel.specialise else None
                    one_thread = _backend.table_kernel(
                        kernel.name, name, 1, np.dtype(dtype), False, code
                    )
                    one_thread(*kernel.bind({**arguments, "n_threads": 1}))
        for kernel in KERNELS.values():
            if kernel.common:  # numba's entries also compile the totals of the row outputs
                for shape in sizes:
                    n_threads = _threads.threads_for(shape[0], shape[0] * shape[1])
                    for packed, arguments in common_calls(kernel, shape, dtype, rng):
                        entry = _backend.common(kernel.name, name, n_threads, None, False, packed)
                        entry(*arguments, n_threads)
    _warm_mask_conversion(dtypes, sizes)


def common_calls(kernel, shape: tuple[int, int], dtype: str, rng: np.random.Generator):
    """(packed?, the arguments but n_threads) of each call of ``kernel``'s common-case entry that
    warmup makes over (B, T) = ``shape``: without a mask and with a bool one (each compiles an
    overload), and the same rows packed (their starts and spans in the mask's place). Their
    types are those the public calls hand the entries (tests/test_backend.py holds them to it)."""
    named = _examples.common_arguments(kernel, shape, dtype, rng)
    for mask in (None, rng.random(shape) < 0.9):
        named["mask"] = mask
        yield False, [named[argument] for argument in kernel.common_arguments[:-1]]
    named = {k: _packed(v, shape) for k, v in named.items()}
    named["mask"] = (np.arange(shape[0]) * shape[1], np.full(shape[0], shape[1]))
    yield True, [named[argument] for argument in kernel.common_arguments[:-1]]


def _packed(value, shape: tuple[int, int]):
    """A (B, T) array of a common entry's arguments as packed (B * T,); anything else as is."""
    return value.reshape(-1) if isinstance(value, np.ndarray) and value.shape == shape else value


def _warm_mask_conversion(dtypes: tuple[str, ...], sizes: list[tuple[int, int]]) -> None:
    """The conversion of a 0/1 mask of numbers into the kernels' bool mask (``_loops``), which
    the fast paths run on such a mask: compiled once per mask dtype, for int64 and int32 (torch's
    long and int masks, verl's ``response_mask``) and for ``dtypes`` (a float mask), on each
    thread count ``sizes`` take."""
    for mask_dtype in dict.fromkeys(("int64", "int32", *dtypes)):
        for shape in sizes:
            mask = np.ones(shape[0] * shape[1], dtype=mask_dtype)
            out = np.empty(mask.size, dtype=np.uint8)
            _loops.convert_mask(mask, out, _threads.threads_for(mask.size, mask.size))


def _warm_group_estimators(dtypes: tuple[str, ...]) -> None:
    n_rows = _groups.MIN_LABELS_TO_HASH  # the hash table's first size
    ids = np.arange(n_rows) // 2
    mask = np.ones((n_rows, 2), dtype=bool)
    for dtype in dtypes:
        scores = np.zeros(n_rows, dtype=dtype)
        outcome.grpo(scores, ids, mask=mask)
        outcome.grpo(scores, _groups.factorize(ids, n_rows), lengths=ids % 3, padded_length=2)
