"""ppo-fast trace: the seed's table by default, a JSON batch on request, clean errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ppo_fast import cli


def rows_of(output: str) -> list[list[str]]:
    return [line.split() for line in output.splitlines()[3:]]


def test_trace_prints_the_seed_example(capsys):
    assert cli.main(["trace"]) == 0
    rows = rows_of(capsys.readouterr().out)
    assert [r[4] for r in rows] == ["0.3000", "-0.6000", "0.1000"]  # KL
    assert [r[5] for r in rows] == ["-0.0600", "0.1200", "0.6800"]  # shaped reward
    assert [r[7] for r in rows] == ["0.1400", "0.2200", "0.0800"]  # delta
    assert [r[8] for r in rows] == ["0.4212", "0.2960", "0.0800"]  # advantage
    assert [r[10] for r in rows] == ["1.1032", "0.2148", "-1.3179"]  # normalised


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
