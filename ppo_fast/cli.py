"""The command line: ``ppo-fast trace`` prints every intermediate quantity of the pipeline.

    ppo-fast trace                 the worked example of shared/seeds/000 (score 0.7, beta 0.2)
    ppo-fast trace --json FILE     a small batch given as JSON ('-' reads standard input)

The JSON object holds ``logprobs``, ``ref_logprobs`` and ``values`` as lists of rows (rows may
have different lengths), ``scores`` (one per row), and optionally ``kl_coef``, ``gamma``,
``lam``, ``estimator``, ``clamp`` and ``bootstrap``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import numpy as np

from . import _backend
from .gae import gae
from .rewards import ESTIMATORS, kl_penalty, shape_rewards
from .whiten import whiten

# shared/seeds/000_6f9e75577438e6f5.txt: "The answer is", scored 0.7.
SEED_BATCH = {
    "scores": [0.7],
    "logprobs": [[-0.9, -1.4, -0.6]],
    "ref_logprobs": [[-1.2, -0.8, -0.7]],
    "values": [[0.3, 0.5, 0.6]],
    "kl_coef": 0.2,
    "gamma": 1.0,
    "lam": 0.95,
}

PIPELINE_COLUMNS = (
    "row",
    "t",
    "logprob",
    "ref_logprob",
    "KL",
    "reward",
    "value",
    "delta",
    "advantage",
    "return",
    "normalised",
)


def _padded(rows: list, name: str) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
        raise ValueError(f"{name} must be a list of rows, each a list of numbers")
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    out = np.zeros((len(rows), int(lengths.max(initial=0))))
    for b, row in enumerate(rows):
        out[b, : len(row)] = row
    return out, lengths


def _table(columns: Sequence[str], rows: list[list]) -> str:
    cells = [
        [c if isinstance(c, str) else f"{c:.4f}" if isinstance(c, float) else str(c) for c in row]
        for row in rows
    ]
    widths = [
        max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(columns)
    ]
    lines = ["  ".join(h.rjust(w) for h, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def trace_pipeline(batch: dict, backend: str | None = None) -> str:
    """The table of every intermediate quantity for `batch` (see the module docstring)."""
    logprobs, lengths = _padded(batch["logprobs"], "logprobs")
    ref_logprobs, ref_lengths = _padded(batch["ref_logprobs"], "ref_logprobs")
    values, value_lengths = _padded(batch["values"], "values")
    if not (np.array_equal(lengths, ref_lengths) and np.array_equal(lengths, value_lengths)):
        raise ValueError("logprobs, ref_logprobs and values must have rows of the same lengths")
    estimator = batch.get("estimator", "k1")
    gamma, lam = batch.get("gamma", 1.0), batch.get("lam", 0.95)
    layout = {"lengths": lengths}
    kl = kl_penalty(logprobs, ref_logprobs, estimator, batch.get("clamp"), backend=backend)
    rewards = shape_rewards(
        batch["scores"],
        logprobs,
        ref_logprobs,
        kl_coef=batch.get("kl_coef", 0.1),
        estimator=estimator,
        clamp=batch.get("clamp"),
        **layout,
        backend=backend,
    )
    bootstrap = batch.get("bootstrap")
    result = gae(
        rewards, values, gamma=gamma, lam=lam, bootstrap=bootstrap, **layout, backend=backend
    )
    # With lam = 0, GAE's advantages are the one-step TD errors.
    deltas = gae(
        rewards, values, gamma=gamma, lam=0.0, bootstrap=bootstrap, **layout, backend=backend
    ).advantages
    normalised = whiten(result.advantages, **layout, backend=backend)
    table = []
    for b, length in enumerate(lengths):
        for t in range(length):
            table.append(
                [b, t + 1]
                + [
                    float(a[b, t])
                    for a in (
                        logprobs,
                        ref_logprobs,
                        kl,
                        rewards,
                        values,
                        deltas,
                        result.advantages,
                        result.returns,
                        normalised,
                    )
                ]
            )
    header = (
        f"KL-shaped rewards, GAE and whitening: estimator={estimator}, "
        f"kl_coef={batch.get('kl_coef', 0.1)}, gamma={gamma}, lam={lam}, "
        f"backend={_backend.get_backend(backend)}"
    )
    return header + "\n" + _table(PIPELINE_COLUMNS, table)


def _load_batch(path: str | None) -> dict:
    if path is None:
        return SEED_BATCH
    text = sys.stdin.read() if path == "-" else open(path).read()
    batch = json.loads(text)
    missing = [k for k in ("scores", "logprobs", "ref_logprobs", "values") if k not in batch]
    if missing:
        raise ValueError(f"the JSON batch lacks {', '.join(missing)}")
    return batch


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ppo-fast", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    trace = commands.add_parser("trace", help="print every intermediate quantity of PPO")
    trace.add_argument("--json", metavar="FILE", help="a batch as JSON ('-' for stdin)")
    trace.add_argument("--estimator", choices=ESTIMATORS, help="override the KL estimator")
    trace.add_argument("--backend", choices=("auto", *_backend.BACKENDS), default=None)
    args = parser.parse_args(argv)
    try:
        batch = dict(_load_batch(args.json))
        if args.estimator:
            batch["estimator"] = args.estimator
        print(trace_pipeline(batch, args.backend))
    except (ValueError, TypeError, KeyError, OSError, json.JSONDecodeError) as error:
        print(f"ppo-fast trace: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
