"""The command line: ``ppo-fast trace`` prints every intermediate quantity of the pipeline.

    ppo-fast trace                 the worked example of shared/seeds/000 (score 0.7, beta 0.2)
    ppo-fast trace --json FILE     a small batch given as JSON ('-' reads standard input)
    ppo-fast trace --groups        the group estimators (GRPO and relatives) on a small batch
    ppo-fast trace --dataset [FILE]  the dataset path (ppo_fast.data) on a tiny example table
    ppo-fast bench                 time the kernels against the peers (ppo_fast.bench)
    ppo-fast advantages IN -o OUT  advantages and returns of a rollout dataset (ppo_fast.data)

The JSON object holds ``logprobs``, ``ref_logprobs`` and ``values`` as lists of rows (rows may
have different lengths), ``scores`` (one per row), and optionally ``kl_coef``, ``gamma``,
``lam``, ``estimator``, ``clamp``, ``bootstrap``, and ``new_logprobs`` (the policy after an
update: adds the clipped-surrogate table per token, with ``clip_low``, ``clip_high`` and
``dual_clip``). Both forms also print the clipped surrogate on the cases of shared/seeds/003.

``--groups`` traces the critic-free outcome estimators instead: a batch of ``scores`` (one per
row) and ``groups`` (one label per row, a string or an integer), the built-in one (three prompts,
uneven, interleaved, one of them sampled once) or ``--json FILE`` with those two keys: each
group's statistics, then every row's advantage under each estimator.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import signal
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _backend, outcome
from ._groups import factorize
from .gae import gae
from .loss import clipped_surrogate
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

# Three prompts sampled 4, 3 and 1 times, their rows interleaved as a shuffled batch leaves them;
# the scores are pass/fail rewards plus one partial credit.
GROUP_BATCH = {
    "groups": ["q-17", "q-4", "q-17", "q-4", "q-17", "q-9", "q-4", "q-17"],
    "scores": [1.0, 0.0, 0.0, 0.5, 1.0, 1.0, 1.0, 1.0],
}
GROUP_COLUMNS = ("group", "label", "rows", "n", "mean", "std", "max", "second max")
GROUP_ROW_COLUMNS = (
    "row",
    "label",
    "group",
    "score",
    "GRPO",
    "Dr.GRPO",
    "GRPO batch std",
    "RLOO",
    "GPG",
    "pass@k",
)

# shared/seeds/003_548ffc3288f9bb9e.txt (epsilon 0.2), and step 7 of seeds/000.
LOSS_CASES = [
    ("003 #1 good token, inside the band", 2.0, 1.15),
    ("003 #2 good token, too eager", 2.0, 1.6),
    ("003 #3 good token, backed off", 2.0, 0.7),
    ("003 #4 bad token, already dropped", -3.0, 0.5),
    ("003 #5 bad token, more eager", -3.0, 1.4),
    ("003 #6a zero advantage", 0.0, 1.9),
    ("003 #6b ratio exactly one", 2.0, 1.0),
    ("003 #8a same ratio, good token", 2.0, 1.5),
    ("003 #8b same ratio, bad token", -2.0, 1.5),
    ("000 step 7, token 1", 1.10, float(np.exp(0.05))),
]

LOSS_COLUMNS = (
    "case",
    "A",
    "ratio",
    "clip(ratio)",
    "ratio*A",
    "clip*A",
    "objective",
    "d loss/d logp",
    "branch",
)
POLICY_COLUMNS = (
    "row",
    "t",
    "new_logprob",
    "old_logprob",
    "advantage",
    "ratio",
    "objective",
    "d loss/d logp",
    "branch",
)

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
    # + 0.0 turns -0.0 into 0.0: a sign on zero only confuses a reader.
    cells = [
        [
            c if isinstance(c, str) else f"{c + 0.0:.4f}" if isinstance(c, float) else str(c)
            for c in row
        ]
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
    layout: dict[str, Any] = {"lengths": lengths}
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
    out = header + "\n" + _table(PIPELINE_COLUMNS, table)
    if "new_logprobs" in batch:
        out += "\n\n" + trace_policy(batch, normalised, lengths, backend)
    return out


def trace_groups(batch: dict) -> str:
    """Each group's statistics and each row's advantage under the outcome estimators."""
    scores = np.asarray(batch["scores"], dtype=np.float64)
    labels = batch["groups"]
    if len(labels) != scores.shape[0]:
        raise ValueError(
            f"groups has {len(labels)} labels and scores {scores.shape[0]} scores: "
            "give one group label per score"
        )
    groups = factorize(labels, scores.shape[0])
    ids = groups.ids
    stats = []
    for g in range(groups.n_groups):
        members = np.flatnonzero(ids == g)
        group_scores = np.sort(scores[members])[::-1]
        stats.append(
            [
                g,
                str(groups.labels[g]),
                ",".join(map(str, members)),
                len(members),
                float(group_scores.mean()),
                float(group_scores.std(ddof=1)) if len(members) > 1 else "-",
                float(group_scores[0]),
                float(group_scores[1]) if len(members) > 1 else "-",
            ]
        )
    estimates = {
        "GRPO": outcome.grpo(scores, groups),
        "Dr.GRPO": outcome.grpo(scores, groups, std=None),
        "GRPO batch std": outcome.grpo(scores, groups, std="batch"),
        "RLOO": outcome.rloo(scores, groups),
        "GPG": outcome.gpg(scores, groups),
        "pass@k": outcome.pass_at_k(scores, groups, singleton="zero"),
    }
    rows = [
        [b, str(labels[b]), int(ids[b]), float(scores[b])]
        + [float(advantages[b]) for advantages in estimates.values()]
        for b in range(scores.shape[0])
    ]
    return (
        "Groups: labels numbered in first-seen order; std with ddof=1\n"
        + _table(GROUP_COLUMNS, stats)
        + "\n\nAdvantages per row, float64 (a group of one: baseline 0 and std 1; pass@k 0)\n"
        "  GRPO = (score - mean) / (std + 1e-6); Dr.GRPO = score - mean; batch std: over all "
        "scores\n"
        "  RLOO = score - mean of the group's other scores; GPG = alpha (score - mean), "
        "alpha = B / #nonzero\n"
        "  pass@k: the group's best row gets (max - second max) / (std + 1e-6)\n"
        + _table(GROUP_ROW_COLUMNS, rows)
    )


def _branch(clipped: bool, dual: bool) -> str:
    return "dual clip (flat)" if dual else "clipped (flat)" if clipped else "unclipped"


def trace_loss_cases(backend: str | None = None, clip: float = 0.2) -> str:
    """The clipped surrogate of a one-token batch for each seed case."""
    table = []
    for case, advantage, ratio in LOSS_CASES:
        result = clipped_surrogate(
            np.array([[np.log(ratio)]]),
            np.zeros((1, 1)),
            np.array([[advantage]]),
            clip_low=clip,
            backend=backend,
        )
        clipped_ratio = min(max(ratio, 1 - clip), 1 + clip)
        table.append(
            [
                case,
                advantage,
                ratio,
                clipped_ratio,
                ratio * advantage,
                clipped_ratio * advantage,
                -result.loss,
                float(result.grad[0, 0]),
                _branch(result.clipfrac > 0, False),
            ]
        )
    header = (
        f"Clipped surrogate L = min(ratio*A, clip(ratio, {1 - clip:g}, {1 + clip:g})*A); "
        "the loss of a one-token batch is -L"
    )
    return header + "\n" + _table(LOSS_COLUMNS, table)


def trace_policy(
    batch: dict, advantages: np.ndarray, lengths: np.ndarray, backend: str | None = None
) -> str:
    """The clipped surrogate per token of `batch` after an update to ``new_logprobs``."""
    new, new_lengths = _padded(batch["new_logprobs"], "new_logprobs")
    old, _ = _padded(batch["logprobs"], "logprobs")
    if not np.array_equal(new_lengths, lengths):
        raise ValueError("new_logprobs must have rows of the same lengths as logprobs")
    options = {k: batch[k] for k in ("clip_low", "clip_high", "dual_clip") if k in batch}
    result = clipped_surrogate(new, old, advantages, lengths=lengths, **options, backend=backend)
    table = []
    for b, length in enumerate(lengths):
        for t in range(length):
            # Each token alone, to show its branch; the batch loss is their token-mean.
            one = clipped_surrogate(
                new[b : b + 1, t : t + 1],
                old[b : b + 1, t : t + 1],
                advantages[b : b + 1, t : t + 1],
                **options,
                backend=backend,
            )
            table.append(
                [
                    b,
                    t + 1,
                    float(new[b, t]),
                    float(old[b, t]),
                    float(advantages[b, t]),
                    float(np.exp(new[b, t] - old[b, t])),
                    -one.loss,
                    float(result.grad[b, t]),
                    _branch(one.clipfrac > 0, one.clipfrac_lower > 0),
                ]
            )
    header = (
        f"Policy loss on the normalised advantages: loss={result.loss:.4f} "
        f"clipfrac={result.clipfrac:.4f} approx_kl={result.approx_kl:.4f}"
    )
    return header + "\n" + _table(POLICY_COLUMNS, table)


# The keys of a JSON batch: lists of rows of numbers; numbers, or lists of numbers (one per
# row), True where null (the default) is allowed; a name.
ROW_KEYS = ("logprobs", "ref_logprobs", "values", "new_logprobs")
REQUIRED_KEYS = ("scores", "logprobs", "ref_logprobs", "values")
NUMBER_KEYS = {
    "scores": False,
    "bootstrap": True,
    "kl_coef": False,
    "gamma": False,
    "lam": False,
    "clamp": True,
    "clip_low": False,
    "clip_high": True,
    "dual_clip": True,
}
KEYS = tuple(dict.fromkeys((*REQUIRED_KEYS, *ROW_KEYS, *NUMBER_KEYS, "estimator")))


class InputError(ValueError):
    """Input the command line refuses; its message says what is wrong and how to fix it."""


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"a string ({value[:20]!r})"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    text = repr(value)
    return f"the number {text if len(text) <= 24 else text[:20] + '...'}"


def _check_number(value: Any, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{where} is {_describe(value)}; it must be a number")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        finite = False
    if not finite:
        raise InputError(f"{where} is not a finite float; give a number such as -0.5")


def _check_numbers(values: Any, where: str, what: str) -> None:
    if not isinstance(values, list):
        raise InputError(f"{where} is {_describe(values)}; it must be {what}")
    for index, value in enumerate(values):
        _check_number(value, f"{where}[{index}]")


def check_batch(batch: Any) -> dict:
    """``batch`` (parsed JSON) if it is a batch ``trace_pipeline`` takes, else an InputError
    that names the key (and the row and position) at fault."""
    if not isinstance(batch, dict):
        raise InputError(
            f"the top level is {_describe(batch)}; it must be an object such as "
            '{"scores": [...], "logprobs": [[...]], "ref_logprobs": [[...]], "values": [[...]]}'
        )
    for key in batch:
        if key not in KEYS:
            close = difflib.get_close_matches(key, KEYS, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"the keys are {', '.join(KEYS)}"
            raise InputError(f"unknown key {key!r} ({hint})")
    missing = [key for key in REQUIRED_KEYS if key not in batch]
    if missing:
        raise InputError(f"the JSON batch lacks {', '.join(missing)}")
    for key in ROW_KEYS:
        if key in batch:
            rows = batch[key]
            if not isinstance(rows, list):
                raise InputError(
                    f"{key} is {_describe(rows)}; it must be a list of rows, each a list of numbers"
                )
            for index, row in enumerate(rows):
                _check_numbers(row, f"{key}[{index}]", "a row: a list of numbers")
    for key, nullable in NUMBER_KEYS.items():
        value = batch.get(key)
        if key not in batch or (value is None and nullable):
            continue
        if isinstance(value, list):
            _check_numbers(value, key, "a list of numbers, one per row")
        else:
            per_row = "a list of numbers, one per row" if key == "scores" else "a number"
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InputError(f"{key} is {_describe(value)}; it must be {per_row}")
            _check_number(value, key)
    if "estimator" in batch and not isinstance(batch["estimator"], str):
        given, choices = _describe(batch["estimator"]), ", ".join(ESTIMATORS)
        raise InputError(f"estimator is {given}; it must be one of {choices}")
    return batch


GROUP_KEYS = ("scores", "groups")


def check_group_batch(batch: Any) -> dict:
    """``batch`` (parsed JSON) if it is a batch ``trace_groups`` takes, else an InputError."""
    if not isinstance(batch, dict):
        raise InputError(
            f"the top level is {_describe(batch)}; it must be an object such as "
            '{"scores": [1.0, 0.0, ...], "groups": ["q-1", "q-1", ...]}'
        )
    for key in batch:
        if key not in GROUP_KEYS:
            close = difflib.get_close_matches(key, GROUP_KEYS, n=1)
            hint = f"did you mean {close[0]!r}?" if close else "the keys are scores and groups"
            raise InputError(f"unknown key {key!r} ({hint})")
    missing = [key for key in GROUP_KEYS if key not in batch]
    if missing:
        raise InputError(f"the JSON batch lacks {', '.join(missing)}")
    _check_numbers(batch["scores"], "scores", "a list of numbers, one per row")
    labels = batch["groups"]
    if not isinstance(labels, list):
        raise InputError(f"groups is {_describe(labels)}; it must be a list of labels, one per row")
    for index, label in enumerate(labels):
        if isinstance(label, bool) or not isinstance(label, str | int):
            raise InputError(
                f"groups[{index}] is {_describe(label)}; a group label is a string or an integer"
            )
    if len(labels) != len(batch["scores"]):
        raise InputError(
            f"groups has {len(labels)} labels and scores {len(batch['scores'])}: "
            "give one group label per score"
        )
    return batch


def _not_json(constant: str) -> float:
    raise InputError(f"{constant} is not JSON; give a finite number")


def _load_batch(path: str | None, groups: bool = False) -> dict:
    if path is None:
        return GROUP_BATCH if groups else SEED_BATCH
    try:
        if path == "-":
            text = sys.stdin.read()
        else:
            with open(path, encoding="utf-8") as file:
                text = file.read()
    except OSError as error:
        raise InputError(f"cannot read it: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise InputError("is not UTF-8 text; give a JSON file") from None
    try:
        batch = json.loads(text, parse_constant=_not_json)
    except json.JSONDecodeError as error:
        raise InputError(f"not valid JSON: {error}") from None
    except RecursionError:
        raise InputError("nested too deeply; a batch is an object of lists of rows") from None
    return check_group_batch(batch) if groups else check_batch(batch)


class Terminated(BaseException):
    """SIGTERM, raised in the main thread while ``main`` runs (a BaseException, as
    KeyboardInterrupt is, so that no ``except Exception`` of a run swallows it)."""


class UsageError(Exception):
    """A bad command line, as argparse finds it: the message is the whole line to print."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints the usage too: one line is enough
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def one_line(error: BaseException | str) -> str:
    return " ".join(str(error).split())


def _stop(signum: int, frame: Any) -> None:
    # One signal stops the run; more, while it unwinds (kills probes, removes temporary
    # files), are ignored: the handlers are put back when main returns.
    for caught in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(caught) is _stop:
            signal.signal(caught, signal.SIG_IGN)
    raise KeyboardInterrupt if signum == signal.SIGINT else Terminated


def _catch_signals() -> dict[int, Any]:
    """Make SIGINT and SIGTERM raise (where they have their default handling); the handlers
    that were in place, to put back."""
    defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    previous = {}
    for signum, default in defaults.items():
        try:
            if signal.getsignal(signum) is default:
                previous[signum] = signal.signal(signum, _stop)
        except ValueError:  # not the main thread: leave the signals alone
            break
    return previous


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ppo-fast", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    trace = commands.add_parser("trace", help="print every intermediate quantity of PPO")
    trace.add_argument("--json", metavar="FILE", help="a batch as JSON ('-' for stdin)")
    trace.add_argument("--estimator", choices=ESTIMATORS, help="override the KL estimator")
    trace.add_argument(
        "--groups",
        action="store_true",
        help="trace the group estimators (GRPO, RLOO, ...) on scores and group labels",
    )
    trace.add_argument(
        "--dataset",
        nargs="?",
        const="",
        metavar="FILE",
        help="trace the dataset path (ppo_fast.data) on the example table or a small FILE",
    )
    trace.add_argument("--backend", choices=("auto", *_backend.BACKENDS), default=None)
    # numpy only: torch, scipy and matplotlib load when a row or the plot needs them.
    from . import bench as benchmark

    bench = commands.add_parser(
        "bench", help="time the kernels against the peers and the memory floor"
    )
    benchmark.add_arguments(bench)
    # The data command's options import no pyarrow: the command does, when it runs.
    from .data import cli as data_cli

    advantages = commands.add_parser(
        "advantages",
        help="advantages and returns of a rollout dataset (Parquet, Arrow IPC, JSON lines)",
        description="The advantages and returns of a rollout dataset (ppo_fast.data).",
    )
    data_cli.add_arguments(advantages)
    return parser


def _trace(args: argparse.Namespace) -> int:
    try:
        if args.backend is not None:
            _backend.get_backend(args.backend)
    except _backend.BackendUnavailableError as error:
        print(f"ppo-fast trace: --backend {args.backend}: {one_line(error)}", file=sys.stderr)
        return 2
    where = "" if args.json is None else f"--json {args.json}: "
    if args.dataset is not None:
        from .data import cli as data_cli

        try:
            print(data_cli.trace_dataset(args.dataset or None))
        except (ValueError, TypeError, KeyError, ImportError) as error:
            print(f"ppo-fast trace: --dataset: {one_line(error)}", file=sys.stderr)
            return 2
        return 0
    if args.groups:
        try:
            print(trace_groups(_load_batch(args.json, groups=True)))
        except (ValueError, TypeError) as error:
            print(f"ppo-fast trace: {where}{one_line(error)}", file=sys.stderr)
            return 2
        return 0
    try:
        batch = dict(_load_batch(args.json))
        if args.estimator:
            batch["estimator"] = args.estimator
        pipeline = trace_pipeline(batch, args.backend)
        cases = trace_loss_cases(args.backend)
    except (ValueError, TypeError) as error:  # InputError, and the library's validation
        print(f"ppo-fast trace: {where}{one_line(error)}", file=sys.stderr)
        return 2
    print(pipeline)
    print()
    print(cases)
    return 0


def _run(argv: Sequence[str] | None) -> int:
    try:
        args = _parser().parse_args(argv)
    except UsageError as error:
        print(one_line(error), file=sys.stderr)
        return 2
    if args.command == "bench":
        from . import bench as benchmark

        return benchmark.run_command(args)
    if args.command == "advantages":
        from .data import cli as data_cli

        return data_cli.run_command(args)
    return _trace(args)


def main(argv: Sequence[str] | None = None) -> int:
    """``ppo-fast``: the exit status is 0, 1 (a benchmark row failed), 2 (bad input: one line on
    stderr says which argument and how to fix it), 130 (SIGINT) or 143 (SIGTERM)."""
    previous = _catch_signals()
    try:
        return _run(argv)
    except KeyboardInterrupt:
        print("ppo-fast: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("ppo-fast: terminated", file=sys.stderr)
        return 143
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


if __name__ == "__main__":
    raise SystemExit(main())
