"""``warmup``: compile every kernel of the table ahead of its first call.

It sits above the stages and the backends: it calls each kernel of ``_spec.KERNELS`` directly,
with arguments built from the table (``_examples``), so a kernel added to the table is warmed up
without an edit here.
"""

from __future__ import annotations

import numpy as np

from . import _backend, _examples, _groups, _threads, _validate, outcome
from ._spec import KERNELS


def warmup(backend: str | None = None, dtypes: tuple[str, ...] = ("float32", "float64")) -> None:
    """Compile every kernel of ``backend`` for ``dtypes`` now rather than at first use.

    Runs each kernel on a small batch and, when more than one thread is in use, on one large
    enough to take the parallel build; every build of a specialised kernel (each KL estimator);
    the common-case entry of each kernel that has one (``_backend.common``); and, for a kernel
    whose long rows run in chunks (GAE), a row that long too.
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
        for kernel in KERNELS.values():
            if kernel.common:  # numba's entries also compile the totals of the row outputs
                named = _examples.common_arguments(kernel, sizes[0], dtype, rng)
                entry = _backend.common(kernel.name, name, 1)
                entry(*(named[argument] for argument in kernel.common_arguments[:-1]), 1)


def _warm_group_estimators(dtypes: tuple[str, ...]) -> None:
    n_rows = _groups.MIN_LABELS_TO_HASH  # the hash table's first size
    ids = np.arange(n_rows) // 2
    mask = np.ones((n_rows, 2), dtype=bool)
    for dtype in dtypes:
        scores = np.zeros(n_rows, dtype=dtype)
        outcome.grpo(scores, ids, mask=mask)
        outcome.grpo(scores, _groups.factorize(ids, n_rows), lengths=ids % 3, padded_length=2)
