"""The benchmark harness behind ``ppo-fast bench`` and the pytest-benchmark suites in bench/.

One comparison table (``KERNELS``) drives every benchmark. The modules, one job each:

- ``batch``     the synthetic batch every row runs on, and the shapes of a run;
- ``registry``  the table: kernels, our implementations, the peers (the verbatim, fingerprinted
                copies of their released code in ``ppo_fast._peers``) and their adapters, what
                runs here (``why_not``) and the check of every output against ours;
- ``roofline``  the memory floor: compulsory bytes at the copy bandwidth (1.0x);
- ``timing``    the timing engine, ``Plan`` and ``run``;
- ``probes``    fresh-process probes: peak memory, import time, first calls;
- ``report``    the tables (rich), the summary and the plot;
- ``cli``       the options of ``ppo-fast bench`` and the command.

Importing this package imports numpy and ppo_fast only: torch, scipy, torchrl, rich and
matplotlib load when a row, a table or a plot needs them.
"""

from __future__ import annotations

from .batch import ALL_SHAPES, DEFAULT_SHAPES, Batch, parse_shape, scaling_shape, shape_name
from .checks import BENCH_EXTRA, CHECK_RTOL, compare, unavailable, why_not
from .cli import add_arguments, plan_from, run_command
from .probes import (
    FIRST_CALL_KERNELS,
    IMPORTS,
    MALLOC_ENV,
    first_call_modes,
    first_call_probe,
    import_seconds,
    import_unavailable,
    measure_memory,
    measure_startup,
    memory_probe,
    run_probe,
)
from .registry import (
    FLOOR,
    KERNELS,
    OURS,
    PEER,
    PYTHON_MAX_TOKENS,
    TABLE_KERNELS,
    Implementation,
    Kernel,
    table_entry,
)
from .report import (
    environment,
    format_memory,
    format_report,
    format_seconds,
    plot,
    print_report,
    render,
    report_items,
)
from .roofline import (
    COPY_BYTES,
    COPY_REPEATS,
    Copy,
    Evict,
    copies_around,
    copy_bandwidth,
    copy_times,
    evict_bytes,
    floor_seconds,
    largest_cache_bytes,
)
from .timing import (
    COLD_MAX_REPEATS,
    DEFAULT_THREADS,
    SAMPLE_SECONDS,
    Plan,
    Progress,
    add_ratios,
    check,
    exponents,
    fit_exponent,
    floor_row,
    make_row,
    measure,
    quiet_openmp,
    reference_outputs,
    run,
    set_threads,
    set_threads_default,
    start_torch_threads,
    time_calls,
    time_interleaved,
    time_ours,
)

__all__ = [
    "ALL_SHAPES",
    "BENCH_EXTRA",
    "CHECK_RTOL",
    "COLD_MAX_REPEATS",
    "COPY_BYTES",
    "COPY_REPEATS",
    "DEFAULT_SHAPES",
    "DEFAULT_THREADS",
    "FIRST_CALL_KERNELS",
    "FLOOR",
    "IMPORTS",
    "KERNELS",
    "MALLOC_ENV",
    "OURS",
    "PEER",
    "PYTHON_MAX_TOKENS",
    "SAMPLE_SECONDS",
    "TABLE_KERNELS",
    "Batch",
    "Copy",
    "Evict",
    "Implementation",
    "Kernel",
    "Plan",
    "Progress",
    "add_arguments",
    "add_ratios",
    "check",
    "compare",
    "copies_around",
    "copy_bandwidth",
    "copy_times",
    "environment",
    "evict_bytes",
    "exponents",
    "first_call_modes",
    "first_call_probe",
    "fit_exponent",
    "floor_row",
    "floor_seconds",
    "format_memory",
    "format_report",
    "format_seconds",
    "import_seconds",
    "import_unavailable",
    "largest_cache_bytes",
    "make_row",
    "measure",
    "measure_memory",
    "measure_startup",
    "memory_probe",
    "parse_shape",
    "plan_from",
    "plot",
    "print_report",
    "quiet_openmp",
    "reference_outputs",
    "render",
    "report_items",
    "run",
    "run_command",
    "run_probe",
    "scaling_shape",
    "set_threads",
    "set_threads_default",
    "shape_name",
    "start_torch_threads",
    "table_entry",
    "time_calls",
    "time_interleaved",
    "time_ours",
    "unavailable",
    "why_not",
]
