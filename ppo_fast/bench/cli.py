"""``ppo-fast bench``: its options, the plan they make, and the command."""

from __future__ import annotations

import difflib
import json
import sys
import time

from .._atomic import atomic_write, output_problem
from .batch import ALL_SHAPES, DEFAULT_SHAPES, Batch, parse_shape, scaling_shape, shape_name
from .probes import IMPORTS, measure_memory, measure_startup
from .registry import KERNELS
from .report import environment, plot, plot_target, print_report, report_items
from .roofline import evict_bytes
from .timing import DEFAULT_THREADS, Plan, Progress, exponents, quiet_openmp, run


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def add_arguments(parser) -> None:
    """The options of ``ppo-fast bench``."""
    parser.add_argument(
        "--shapes",
        default=",".join(map(shape_name, DEFAULT_SHAPES)),
        help="comma-separated BxT batch shapes (default: %(default)s; the issue's full set is "
        + ",".join(map(shape_name, ALL_SHAPES))
        + ")",
    )
    parser.add_argument(
        "--threads", default=",".join(map(str, DEFAULT_THREADS)), help="thread counts (%(default)s)"
    )
    parser.add_argument(
        "--dtype", default="float32", help="float32, float64 or both, comma-separated"
    )
    parser.add_argument(
        "--kernels", default=",".join(KERNELS), help="comma-separated kernels (default: all)"
    )
    parser.add_argument(
        "--scaling",
        default="1e7",
        metavar="MAX_TOKENS",
        help="time our compiled kernels and the floor at 1e3, 1e4, ... up to this many tokens, "
        "at the largest thread count, and fit the exponent (default %(default)s; 0: no sweep)",
    )
    parser.add_argument(
        "--budget", type=float, default=0.08, help="seconds of timing per row (%(default)s)"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="minimum samples per row (%(default)s)"
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="time every call, and every copy of the floor, from memory: read a buffer of twice "
        "the largest CPU cache before each (one call a sample, at most 25 samples a row)",
    )
    parser.add_argument(
        "--memory", action="store_true", help="also measure the extra peak memory of each row"
    )
    parser.add_argument(
        "--startup", action="store_true", help="also measure import and first-call times"
    )
    parser.add_argument("--json", metavar="PATH", help="write the raw results as JSON")
    parser.add_argument("--plot", metavar="PATH.png", help="draw time against tokens (matplotlib)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def plan_from(args) -> Plan:
    kernels = tuple(_csv(args.kernels))
    unknown = [k for k in kernels if k not in KERNELS]
    if unknown:
        close = difflib.get_close_matches(unknown[0], KERNELS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ValueError(
            f"--kernels {args.kernels}: unknown kernel(s) {', '.join(unknown)}{hint}; "
            f"choose from {', '.join(KERNELS)}"
        )
    if not kernels:
        raise ValueError(f"--kernels {args.kernels!r}: no kernel; choose from {', '.join(KERNELS)}")
    dtypes = tuple(_csv(args.dtype))
    for dtype in dtypes:
        if dtype not in ("float32", "float64"):
            raise ValueError(f"--dtype takes float32 and/or float64, got {dtype!r}")
    if not dtypes:
        raise ValueError(f"--dtype {args.dtype!r}: no dtype; give float32 and/or float64")
    try:
        threads = tuple(int(t) for t in _csv(args.threads))
    except ValueError:
        raise ValueError(f"--threads takes integers, like 1,2; got {args.threads!r}") from None
    if not threads or min(threads) < 1:
        raise ValueError(f"--threads takes positive integers, got {args.threads!r}")
    try:
        largest = float(args.scaling)
    except ValueError:
        raise ValueError(f"--scaling takes a token count like 1e7, got {args.scaling!r}") from None
    scaling = tuple(10**k for k in range(3, 9) if 10**k <= largest)
    if not args.budget > 0:
        raise ValueError(f"--budget takes seconds > 0, like 0.08; got {args.budget}")
    if args.repeats < 1:
        raise ValueError(f"--repeats takes an integer >= 1, like 3; got {args.repeats}")
    try:
        shapes = tuple(parse_shape(s) for s in _csv(args.shapes))
    except ValueError as error:
        raise ValueError(f"--shapes {args.shapes}: {error}") from None
    if not shapes:
        raise ValueError(f"--shapes {args.shapes!r}: no shape; give BxT shapes like 8x128,256x1024")
    return Plan(
        kernels=kernels,
        shapes=shapes,
        dtypes=dtypes,
        threads=threads,
        budget=args.budget,
        min_repeats=args.repeats,
        scaling_tokens=scaling,
        cold=args.cold,
    )


def check_outputs(args) -> None:
    """ValueError, naming the option, where --json or --plot could not be written: checked
    before any work starts, so that a run is not lost at its end."""
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if path is None:
            continue
        try:
            problem = output_problem(path)  # a folder given as --plot is not a plot.png
            if problem is None and option == "--plot":
                problem = output_problem(plot_target(path)[0])
        except (RuntimeError, ValueError) as error:
            problem = str(error)
        if problem is not None:
            raise ValueError(f"{option} {path}: {problem}")


def available_memory() -> int | None:
    """Bytes of memory a run can have now: /proc/meminfo's MemAvailable, less where a cgroup
    (v2) limits this process to less; None where Linux does not say."""
    available = None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    try:
        with (
            open("/sys/fs/cgroup/memory.max") as limit,
            open("/sys/fs/cgroup/memory.current") as used,
        ):
            text = limit.read().strip()
            if text != "max" and available is not None:
                available = min(available, int(text) - int(used.read()))
    except (OSError, ValueError):
        pass
    return available


def batch_bytes(plan: Plan, shape: tuple[int, int], dtype: str) -> int:
    """The least memory a row at ``shape`` needs: the arrays of the batch the plan's kernels
    read, and two sets of outputs (ours, kept as the reference, and the row's)."""
    batch = Batch(shape, dtype)
    kernels = [KERNELS[name] for name in plan.kernels]
    read = sum(batch.nbytes(name) for name in {name for k in kernels for name in k.reads})
    written = max(kernel.writes for kernel in kernels) * batch.tokens * batch.dtype.itemsize
    return read + 2 * written


def _gib(size: float) -> str:
    return f"{size / 2**30:,.3g} GiB" if size < 2**50 else f"{size / 2**50:,.3g} PiB"


def check_memory(plan: Plan, args, available: int | None = None) -> None:
    """ValueError, naming --shapes or --scaling, for a batch larger than the memory available:
    refused before any work starts (and before an allocation that could wake the OOM killer)."""
    available = available_memory() if available is None else available
    if available is None:
        return
    batches = [("--shapes", s, d, "choose a smaller BxT") for s in plan.shapes for d in plan.dtypes]
    batches += [
        ("--scaling", scaling_shape(tokens), plan.dtypes[0], "choose a smaller --scaling")
        for tokens in plan.scaling_tokens
    ]
    evicted = evict_bytes() if plan.cold else 0
    for option, shape, dtype, fix in batches:
        need = batch_bytes(plan, shape, dtype) + evicted
        if evicted:
            fix += f" (the need includes --cold's buffer of {_gib(evicted)})"
        if need > available:
            given = args.shapes if option == "--shapes" else args.scaling
            raise ValueError(
                f"{option} {given}: the {shape_name(shape)} {dtype} batch needs at least "
                f"{_gib(need)} of memory, and {_gib(available)} is available here; {fix}"
            )


def run_command(args) -> int:
    """``ppo-fast bench``: measure, print the tables, write the JSON and the plot."""
    quiet_openmp()  # before anything loads libgomp
    try:  # every input error before any work starts
        plan = plan_from(args)
        check_outputs(args)
        check_memory(plan, args)
    except ValueError as error:
        print(f"ppo-fast bench: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    env = environment()
    total = len(plan.rows())
    if args.memory:
        total += sum(len(KERNELS[k].implementations) for k in plan.kernels)
    if args.startup:
        total += len(IMPORTS) + 4
    progress = Progress(total, enabled=not args.no_progress)
    seconds = {}
    memory = startup = None
    try:
        start = time.perf_counter()
        rows = run(plan, progress)
        seconds["timing"] = time.perf_counter() - start
        if args.memory:
            start = time.perf_counter()
            largest = max(plan.shapes, key=lambda s: s[0] * s[1])
            memory = measure_memory(plan, largest, progress)
            seconds["memory"] = time.perf_counter() - start
        if args.startup:
            start = time.perf_counter()
            startup = measure_startup(progress)
            seconds["startup"] = time.perf_counter() - start
    finally:
        progress.close()
    print_report(report_items(rows, env, memory, startup))
    if args.json:
        document = {
            "environment": env,
            "seconds": seconds,
            "plan": {
                "kernels": plan.kernels,
                "shapes": [list(s) for s in plan.shapes],
                "dtypes": plan.dtypes,
                "threads": plan.threads,
                "budget": plan.budget,
                "min_repeats": plan.min_repeats,
                "scaling_tokens": plan.scaling_tokens,
                "cold": plan.cold,
            },
            "rows": rows,
            "exponents": exponents(rows),
            "memory": memory,
            "startup": startup,
        }
        with atomic_write(args.json, "w") as f:
            json.dump(document, f, indent=1)
    if args.plot:
        try:
            plot(rows, args.plot)
        except RuntimeError as error:
            print(f"ppo-fast bench: {error}", file=sys.stderr)
            return 2
    failed = [r for r in rows if r["status"] in ("mismatch", "error")]
    return 1 if failed else 0
