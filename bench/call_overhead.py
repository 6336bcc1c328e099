"""What a public call costs beyond its kernel: the public call's time over the kernel's, in the
same calls.

    python bench/call_overhead.py                         the default kernels, 1024x4096, 1 thread
    python bench/call_overhead.py --threads 2             on two threads
    python bench/call_overhead.py --kernels gae,whiten    some of them
    python bench/call_overhead.py --backend cython        another backend

Each kernel of ``ppo_fast.bench``'s registry is called as ``ppo-fast bench`` calls it: the
default backend's row (fresh results, which since 0.8.23 reuse freed memory:
``ppo_fast.set_result_cache``) and the ``ppo_fast out=`` row (preallocated results). While it
runs, the backend's entries (``_backend.run``, and the compiled entries that ``_backend.common``
and ``_backend.table_kernel`` hand the fast paths) are wrapped so that the time spent inside
them is summed: the **kernel's** time, measured within the very calls the public time is. The
ratio public / kernel is what validation, conversions and allocation add (the issue's target:
within 1.5x, and within 1.1x with ``out=``). The wrapper's own cost (a perf_counter pair, about
0.1 us) is in the public time, not in the kernel's.

Medians of several samples, the two rows' samples taken in turn. The VM this runs on moves
within seconds; compare the columns of one run.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from ppo_fast import _backend, set_backend
from ppo_fast.bench import registry
from ppo_fast.bench.batch import Batch, parse_shape
from ppo_fast.bench.report import environment
from ppo_fast.bench.timing import quiet_openmp, set_threads

DEFAULT_KERNELS = (
    "kl_penalty,shape_rewards,gae,whiten,gae+whiten,discounted_returns,reinforce++,"
    "clipped_surrogate,value_loss,reinforce,cispo,sapo,gspo,geo_mean,dppo,kl_cov"
)


class KernelClock:
    """Sums the seconds spent inside the backend's entries while installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._originals = (_backend.run, _backend.common, _backend.table_kernel)

    def _timed(self, entry):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return entry(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed

    def __enter__(self) -> KernelClock:
        run, common, table_kernel = self._originals
        _backend.run = self._timed(run)
        _backend.common = lambda *a, **k: self._timed(common(*a, **k))
        _backend.table_kernel = lambda *a, **k: self._timed(table_kernel(*a, **k))
        return self

    def __exit__(self, *exc: object) -> None:
        _backend.run, _backend.common, _backend.table_kernel = self._originals


def measure(kernel: registry.Kernel, batch: Batch, threads: int, samples: int):
    """[(median seconds of the public call, median seconds inside the kernel)] of the default
    backend's row and of the ``ppo_fast out=`` row (which calls the default backend), where the
    kernel has it (gae+whiten has none)."""
    names = {i.name for i in kernel.implementations}
    rows = tuple(r for r in (f"ppo_fast[{_backend.get_backend()}]", "ppo_fast out=") if r in names)
    runs = {}
    for row in rows:
        run = kernel.implementation(row).prepare(batch, threads)
        run()  # compile, touch
        run()
        runs[row] = run
    public: dict[str, list[float]] = {row: [] for row in rows}
    inside: dict[str, list[float]] = {row: [] for row in rows}
    with KernelClock() as clock:
        for sample in range(samples):
            for row in rows if sample % 2 == 0 else rows[::-1]:
                clock.seconds = 0.0
                start = time.perf_counter()
                result = runs[row]()
                public[row].append(time.perf_counter() - start)
                inside[row].append(clock.seconds)
                del result
    return [(float(np.median(public[row])), float(np.median(inside[row]))) for row in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", default=DEFAULT_KERNELS)
    parser.add_argument("--shape", default="1024x4096")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--samples", type=int, default=15)
    parser.add_argument("--backend", default=None, help="default: the default backend")
    args = parser.parse_args()
    quiet_openmp()
    set_threads(args.threads)
    set_backend(args.backend)
    batch = Batch(parse_shape(args.shape))
    machine = environment()
    print(
        f"{machine['cpu']} ({machine['cores']} cores), ppo_fast "
        f"{machine['versions']['ppo_fast']}; {args.shape} float32, {args.threads} thread(s), "
        f"backend {_backend.get_backend()}; medians of {args.samples} calls a row\n"
    )
    print("| kernel | public call | its kernel | ratio | with out= | its kernel | ratio |")
    print("|---|---|---|---|---|---|---|")
    for name in args.kernels.split(","):
        times = measure(registry.KERNELS[name], batch, args.threads, args.samples)
        cells = []
        for public, inside in times:
            ratio = f"{public / inside:.2f}x" if inside > 0 else "-"
            cells += [f"{public * 1e3:.2f} ms", f"{inside * 1e3:.2f} ms", ratio]
        cells += ["-"] * (6 - len(cells))  # no out= row
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
