"""``ppo-fast bench``: its options, the plan they make, and the command."""

from __future__ import annotations

import json
import sys
import time

from .batch import ALL_SHAPES, DEFAULT_SHAPES, parse_shape, shape_name
from .probes import IMPORTS, measure_memory, measure_startup
from .registry import KERNELS
from .report import environment, plot, print_report, report_items
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
        raise ValueError(
            f"unknown kernel(s) {', '.join(unknown)}; choose from {', '.join(KERNELS)}"
        )
    dtypes = tuple(_csv(args.dtype))
    for dtype in dtypes:
        if dtype not in ("float32", "float64"):
            raise ValueError(f"--dtype takes float32 and/or float64, got {dtype!r}")
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
    if args.budget <= 0 or args.repeats < 1:
        raise ValueError("--budget must be > 0 and --repeats >= 1")
    return Plan(
        kernels=kernels,
        shapes=tuple(parse_shape(s) for s in _csv(args.shapes)),
        dtypes=dtypes,
        threads=threads,
        budget=args.budget,
        min_repeats=args.repeats,
        scaling_tokens=scaling,
    )


def run_command(args) -> int:
    """``ppo-fast bench``: measure, print the tables, write the JSON and the plot."""
    quiet_openmp()  # before anything loads libgomp
    try:
        plan = plan_from(args)
    except ValueError as error:
        print(f"ppo-fast bench: {error}", file=sys.stderr)
        return 2
    if not plan.shapes or not plan.dtypes or not plan.kernels:
        print("ppo-fast bench: nothing to measure", file=sys.stderr)
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
            },
            "rows": rows,
            "exponents": exponents(rows),
            "memory": memory,
            "startup": startup,
        }
        with open(args.json, "w") as f:
            json.dump(document, f, indent=1)
    if args.plot:
        try:
            plot(rows, args.plot)
        except RuntimeError as error:
            print(f"ppo-fast bench: {error}", file=sys.stderr)
            return 2
    failed = [r for r in rows if r["status"] in ("mismatch", "error")]
    return 1 if failed else 0
