"""ppo-fast trace: the seed's table by default, a JSON batch on request, clean errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ppo_fast import cli


def rows_of(output: str) -> list[list[str]]:
    """The rows of the first table."""
    table = output.split("\n\n")[0]
    return [line.split() for line in table.splitlines()[3:]]


def table_rows(output: str, index: int) -> list[list[str]]:
    """The rows of table `index` (0 = pipeline), split on two or more spaces."""
    table = output.split("\n\n")[index]
    return [[c for c in line.split("  ") if c.strip()] for line in table.splitlines()[3:]]


def test_trace_prints_the_seed_example(capsys):
    assert cli.main(["trace"]) == 0
    rows = rows_of(capsys.readouterr().out)
    assert [r[4] for r in rows] == ["0.3000", "-0.6000", "0.1000"]  # KL
    assert [r[5] for r in rows] == ["-0.0600", "0.1200", "0.6800"]  # shaped reward
    assert [r[7] for r in rows] == ["0.1400", "0.2200", "0.0800"]  # delta
    assert [r[8] for r in rows] == ["0.4212", "0.2960", "0.0800"]  # advantage
    assert [r[10] for r in rows] == ["1.1032", "0.2148", "-1.3179"]  # normalised


def test_trace_prints_the_clipped_surrogate_cases(capsys):
    assert cli.main(["trace"]) == 0
    cases = {
        row[0].strip(): [c.strip() for c in row[1:]]
        for row in table_rows(capsys.readouterr().out, 1)
    }
    # case: A, ratio, clip(ratio), ratio*A, clip*A, objective, gradient, branch
    assert cases["003 #2 good token, too eager"] == [
        "2.0000",
        "1.6000",
        "1.2000",
        "3.2000",
        "2.4000",
        "2.4000",
        "0.0000",
        "clipped (flat)",
    ]
    assert cases["003 #4 bad token, already dropped"][5:] == ["-2.4000", "0.0000", "clipped (flat)"]
    assert cases["003 #5 bad token, more eager"][5:] == ["-4.2000", "4.2000", "unclipped"]
    assert cases["003 #8b same ratio, bad token"][5:] == ["-3.0000", "3.0000", "unclipped"]
    assert cases["003 #6a zero advantage"][5:7] == ["0.0000", "0.0000"]
    assert cases["000 step 7, token 1"][1] == "1.0513"


def test_trace_prints_the_policy_loss_for_new_logprobs(capsys, tmp_path):
    batch = dict(cli.SEED_BATCH, new_logprobs=[[-0.85, -1.0, -0.9]], dual_clip=3.0)
    path = tmp_path / "batch.json"
    path.write_text(json.dumps(batch))
    assert cli.main(["trace", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out, 1)
    assert [r[-1].strip() for r in rows] == ["unclipped", "clipped (flat)", "clipped (flat)"]
    assert rows[0][5].strip() == "1.0513"  # exp(-0.85 + 0.9)
    assert "Policy loss on the normalised advantages" in out


def test_trace_reads_a_ragged_json_batch(tmp_path, capsys):
    batch = {
        "scores": [1.0, 0.0],
        "logprobs": [[-0.5, -0.5], [-1.0]],
        "ref_logprobs": [[-0.5, -0.5], [-1.0]],
        "values": [[0.0, 0.0], [0.0]],
        "kl_coef": 0.1,
        "gamma": 1.0,
        "lam": 1.0,
        "estimator": "k2",
    }
    path = tmp_path / "batch.json"
    path.write_text(json.dumps(batch))
    assert cli.main(["trace", "--json", str(path), "--backend", "python"]) == 0
    out = capsys.readouterr().out
    assert "estimator=k2" in out and "backend=python" in out
    rows = rows_of(out)
    assert [r[:2] for r in rows] == [["0", "1"], ["0", "2"], ["1", "1"]]
    assert [r[8] for r in rows] == ["1.0000", "1.0000", "0.0000"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"scores": [1]}', "lacks logprobs"),
        ("not json", "Expecting value"),
        (
            '{"scores": [1], "logprobs": [[0.0]], "ref_logprobs": [[0.0, 1.0]], "values": [[0.0]]}',
            "same lengths",
        ),
        (
            '{"scores": [1], "logprobs": [[0.0]], "ref_logprobs": [[0.0]], "values": [[0.0]], '
            '"gamma": 2}',
            "gamma must lie in",
        ),
    ],
)
def test_trace_reports_bad_batches_without_a_traceback(text, message):
    out = subprocess.run(
        [sys.executable, "-m", "ppo_fast.cli", "trace", "--json", "-"],
        input=text,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr


def test_console_script_is_installed():
    out = subprocess.run(["ppo-fast", "trace"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "0.4212" in out.stdout
