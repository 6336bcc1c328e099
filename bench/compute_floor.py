"""How far arithmetic alone keeps each kernel from the memory floor: the compute floor.

    python bench/compute_floor.py                          the losses, GAE and whiten (~2 min)
    python bench/compute_floor.py --kernels gae,gspo       some of them
    python bench/compute_floor.py --backends cython        one backend
    python bench/compute_floor.py --two-threads            and a table for two threads

The memory floor (DESIGN.md section 7, ``ppo-fast bench``'s ``x floor``) assumes a kernel waits
only on memory. A kernel can also be bound by its instructions. This script measures that bound
on this machine: each kernel of ``ppo_fast.bench``'s registry, as ``ppo-fast bench`` calls it
(the public function, one thread), on a small batch whose arrays stay in the caches
(``--small``, 32x2048 float32 by default: about 1.1 MiB for a loss, in the L2 and L3), called
many times in a row, so that no byte comes from memory. Smaller batches measure the call's
fixed cost more than the arithmetic (the clipped surrogate at 8x1024: 1.4x the time per token
at 32x2048). Its time per valid token, times the valid tokens of the large batch
(``--shape``, 1024x4096), is the large batch's **compute floor**: what the kernel would take if
memory were free. Both batches draw lengths uniform in [T/2, T], as the bench's, so they have the
same share of padding. The row then shows the memory floor (at the copy bandwidth measured around
the large batch's timing, as the bench measures it around each table's rows: the best of 10
copies, 5 just before and 5 just after), the compute floor in multiples of it, and the large
batch's measured time in multiples of it. Where the compute floor is above a target
(``x floor``), fewer instructions per token, not fewer bytes, is what can reach it. Per-call
overheads (validation, allocation) are in both times: at 32x2048 they are a few microseconds
against hundreds.

With ``--two-threads`` a second table holds the two-thread target: the large batch's memory floor
at the copy bandwidth of two threads, the compute floor halved (the arithmetic split evenly over
two cores, with no cost for the split: the least two threads can take) in multiples of it, and
the large batch measured on two threads. Where the halved compute floor is above 1.2x, no
schedule of today's instructions reaches the target on two threads.

Timing as the bench's: medians of several samples, the backends' samples taken in turn. The VM
this runs on moves within seconds; compare the columns of one run.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from ppo_fast.bench import registry
from ppo_fast.bench.batch import Batch, parse_shape
from ppo_fast.bench.report import environment
from ppo_fast.bench.roofline import copies_around, floor_seconds
from ppo_fast.bench.timing import quiet_openmp, set_threads

DEFAULT_KERNELS = "gae,whiten,clipped_surrogate,value_loss,reinforce,cispo,sapo,gspo,geo_mean,dppo"


def _call(kernel: registry.Kernel, backend: str, batch: Batch):
    implementation = kernel.implementation(f"ppo_fast[{backend}]")
    run = implementation.prepare(batch, 1)
    run()  # compile, touch
    run()
    return run


def _medians(runs: dict[str, object], repeat: int, samples: int) -> dict[str, float]:
    """The median seconds of one call of each run (``repeat`` calls a sample), in turn."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for sample in range(samples):
        order = list(runs) if sample % 2 == 0 else list(runs)[::-1]
        for name in order:
            run = runs[name]
            start = time.perf_counter()
            for _ in range(repeat):
                run()
            times[name].append((time.perf_counter() - start) / repeat)
    return {name: float(np.median(t)) for name, t in times.items()}


def _large_batch(
    kernel: registry.Kernel, large: Batch, runs: dict[str, object], threads: int, samples: int
) -> tuple[dict[str, float], float, str]:
    """The large batch's medians, its memory floor at the copy bandwidth measured around them
    on ``threads`` threads, and the floor's cell (the floor and that bandwidth)."""
    times: dict[str, float] = {}
    bandwidth = copies_around(threads, lambda: times.update(_medians(runs, 1, samples)))
    floor = floor_seconds(*kernel.traffic(large), bandwidth)
    return times, floor, f"{floor * 1e3:.2f} ms ({bandwidth / 1e9:.1f} GB/s)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", default=DEFAULT_KERNELS)
    parser.add_argument("--backends", default="cython,numba")
    parser.add_argument("--shape", default="1024x4096", help="the large batch (memory-bound)")
    parser.add_argument("--small", default="32x2048", help="the L2-resident batch")
    parser.add_argument("--samples", type=int, default=15)
    parser.add_argument(
        "--two-threads", action="store_true", help="also a table against two threads' floor"
    )
    args = parser.parse_args()
    quiet_openmp()
    set_threads(1)
    # glibc serves a large array from fresh pages (mmap: the kernel zeroes them on first touch)
    # until an array of that size has been freed, then from pages it keeps: GAE's two 16 MiB
    # outputs took 8.3 ms a call in a fresh process and 4.7 ms after that, its kernel the same.
    # Free one such array first (24 MiB: more than an output of the large batch), as a
    # long-running process has, so that the large batch's time is the kernel's reads and
    # writes, not the first touch of new pages.
    np.empty(24 << 20, dtype=np.uint8)  # freed at once
    large, small = Batch(parse_shape(args.shape)), Batch(parse_shape(args.small))
    large_tokens, small_tokens = int(large.lengths.sum()), int(small.lengths.sum())
    repeat = max(1, large_tokens // small_tokens // 2)  # a small sample lasts about as long
    backends = args.backends.split(",")
    machine = environment()
    print(
        f"{machine['date']}, {machine['cpu']} ({machine['cores']} cores), ppo_fast "
        f"{machine['versions']['ppo_fast']}: copy bandwidth around each kernel's large "
        f"batch; large {args.shape} float32 ({large_tokens} valid tokens), "
        f"small {args.small} ({small_tokens}, {repeat} calls a sample); one thread\n"
    )
    print(
        "| kernel | backend | memory floor | compute floor (small batch, scaled) "
        "| measured (large batch) | small batch, ns per valid token |"
    )
    print("|---|---|---|---|---|---|")
    computes = {}  # (kernel, backend): the compute floor, seconds
    for name in args.kernels.split(","):
        kernel = registry.KERNELS[name]
        small_runs = {b: _call(kernel, b, small) for b in backends}
        large_runs = {b: _call(kernel, b, large) for b in backends}
        small_times = _medians(small_runs, repeat, args.samples)
        large_times, floor, cell = _large_batch(kernel, large, large_runs, 1, args.samples)
        for backend in backends:
            compute = computes[name, backend] = small_times[backend] / small_tokens * large_tokens
            measured = large_times[backend]
            print(
                f"| {name} | {backend} | {cell} | {compute * 1e3:.2f} ms = "
                f"{compute / floor:.2f}x | {measured * 1e3:.2f} ms = {measured / floor:.2f}x | "
                f"{small_times[backend] / small_tokens * 1e9:.2f} |",
                flush=True,
            )
    if args.two_threads:
        _two_threads(args, backends, large, computes)


def _two_threads(args, backends, large: Batch, computes: dict) -> None:
    """The second table: the compute floors halved against two threads' memory floor."""
    set_threads(2)
    print("\ncopy bandwidth (2 threads) around each kernel's large batch; two threads\n")
    print(
        "| kernel | backend | memory floor, two threads | compute floor halved "
        "| measured (large batch, two threads) |"
    )
    print("|---|---|---|---|---|")
    for name in args.kernels.split(","):
        kernel = registry.KERNELS[name]
        large_runs = {b: _call(kernel, b, large) for b in backends}
        large_times, floor, cell = _large_batch(kernel, large, large_runs, 2, args.samples)
        for backend in backends:
            half = computes[name, backend] / 2
            measured = large_times[backend]
            print(
                f"| {name} | {backend} | {cell} | {half * 1e3:.2f} ms = "
                f"{half / floor:.2f}x | {measured * 1e3:.2f} ms = {measured / floor:.2f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()
