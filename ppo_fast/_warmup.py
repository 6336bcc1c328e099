"""``warmup``: compile every kernel of the table ahead of its first call.

It sits above the stages and the backends: it calls each kernel of ``_spec.KERNELS`` directly,
with arguments built from the table (``_examples``), so a kernel added to the table is warmed up
without an edit here.
"""

from __future__ import annotations

import numpy as np

from . import _backend, _examples, _groups, _threads, _validate
from ._spec import KERNELS


def warmup(backend: str | None = None, dtypes: tuple[str, ...] = ("float32", "float64")) -> None:
    """Compile every kernel of ``backend`` for ``dtypes`` now rather than at first use.

    Runs each kernel on a small batch and, when more than one thread is in use, on one large
    enough to take the parallel build; every build of a specialised kernel (each KL estimator).
    For cython and python this only loads the backend. Whatever the backend, it also compiles
    the hash table that numbers many integer group ids (``_groups``).
    """
    _groups.factorize(np.arange(_groups.MIN_LABELS_TO_HASH), _groups.MIN_LABELS_TO_HASH)
    name = _backend.get_backend(backend)
    sizes = [(2, 8)]
    if _threads.get_num_threads() > 1:
        sizes.append((2, _threads.MIN_POSITIONS_PER_THREAD))
    rng = np.random.default_rng(0)
    for dtype in dtypes:
        for shape in sizes:
            rows = _validate.rows(shape)
            for kernel in KERNELS.values():
                for scalars in _examples.codes(kernel):
                    arguments = _examples.arguments(kernel, rows, dtype, rng, scalars=scalars)
                    _backend.run(kernel.name, name, **arguments)
