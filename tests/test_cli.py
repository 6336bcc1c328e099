"""ppo-fast trace: the seed's table by default, a JSON batch on request, clean errors."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from ppo_fast import cli
from ppo_fast._atomic import atomic_path, atomic_write


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


# shared/seeds/003's answers: L = min(ratio * A, clip(ratio, 0.8, 1.2) * A) of each case
SEED_003_ANSWERS = {
    "003 #1 good token, inside the band": (2.0, 1.15, 2.30),
    "003 #2 good token, too eager": (2.0, 1.6, 2.4),
    "003 #3 good token, backed off": (2.0, 0.7, 1.4),
    "003 #4 bad token, already dropped": (-3.0, 0.5, -2.4),
    "003 #5 bad token, more eager": (-3.0, 1.4, -4.2),
    "003 #6a zero advantage": (0.0, 1.9, 0.0),
    "003 #6b ratio exactly one": (2.0, 1.0, 2.0),
    "003 #8a same ratio, good token": (2.0, 1.5, 2.4),
    "003 #8b same ratio, bad token": (-2.0, 1.5, -3.0),
}


def test_trace_prints_every_seed_case_with_the_seeds_answer(capsys):
    assert cli.main(["trace"]) == 0
    loss_table = capsys.readouterr().out.split("\n\n")[1]
    assert loss_table.startswith(
        "Clipped surrogate L = min(ratio*A, clip(ratio, 0.8, 1.2)*A); "
        "the loss of a one-token batch is -L\n"
    )
    cases = {row[0].strip(): [c.strip() for c in row[1:]] for row in table_rows(loss_table, 0)}
    for case, (advantage, ratio, objective) in SEED_003_ANSWERS.items():
        assert cases[case][:2] == [f"{advantage:.4f}", f"{ratio:.4f}"], case
        assert cases[case][5] == f"{objective:.4f}", case


def test_trace_shows_a_dual_clipped_token_and_takes_null_bounds(capsys, tmp_path):
    # the third token: A < 0 (the whitened -1.3179) and a ratio of exp(1.2) = 3.32 > dual_clip
    new_logprobs = [[-0.85, -1.0, 0.6]]
    path = tmp_path / "batch.json"
    for bounds, branches in (
        ({"dual_clip": 3.0}, ["unclipped", "clipped (flat)", "dual clip (flat)"]),
        ({"dual_clip": None, "clip_high": None}, ["unclipped", "clipped (flat)", "unclipped"]),
    ):
        path.write_text(json.dumps(dict(cli.SEED_BATCH, new_logprobs=new_logprobs, **bounds)))
        assert cli.main(["trace", "--json", str(path)]) == 0, capsys.readouterr().err
        assert [r[-1].strip() for r in table_rows(capsys.readouterr().out, 1)] == branches


def test_json_values_are_described_whole_up_to_24_characters():
    assert cli._describe(123456789012345678901234) == "the number 123456789012345678901234"
    assert cli._describe(1234567890123456789012345) == "the number 12345678901234567890..."
    assert cli._describe("abcdefghijklmnopqrstuvwxyz") == "a string ('abcdefghijklmnopqrst')"


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
    """The ``ppo-fast`` script pip wrote next to this interpreter's (found there, not on PATH:
    under pyenv its shim appears only after a rehash), and ``python -m ppo_fast``."""
    script = os.path.join(sysconfig.get_path("scripts"), "ppo-fast")
    assert os.access(script, os.X_OK), f"{script}: reinstall with python -m pip install -e ."
    for command in ([script, "trace"], [sys.executable, "-m", "ppo_fast", "trace"]):
        out = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert "0.4212" in out.stdout


# The hardening issue: every input error is one line naming the argument and the fix, status 2;
# outputs are checked before work and written whole; SIGINT and SIGTERM stop cleanly.

GOOD_BATCH = '"scores": [1], "logprobs": [[0.0]], "ref_logprobs": [[0.0]], "values": [[0.0]]'


def one_error_line(capsys, status: int, prefix: str) -> str:
    captured = capsys.readouterr()
    assert status == 2, captured.err
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), captured.err
    assert captured.out == ""
    return lines[0].removeprefix(prefix)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("5", "the top level is the number 5; it must be an object"),
        ("null", "the top level is null; it must be an object"),
        ("[1, 2]", "the top level is a list; it must be an object"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ("{" + GOOD_BATCH + ', "gama": 0.9}', "unknown key 'gama' (did you mean 'gamma'?)"),
        ("{" + GOOD_BATCH + ', "foo": 1}', "unknown key 'foo' (the keys are scores, logprobs"),
        (
            '{"scores": [1], "logprobs": [[0.0, null]], "ref_logprobs": [[0.0, 0.0]], '
            '"values": [[0.0, 0.0]]}',
            "logprobs[0][1] is null; it must be a number",
        ),
        (
            '{"scores": [1], "logprobs": [[0.0]], "ref_logprobs": [["a"]], "values": [[0.0]]}',
            "ref_logprobs[0][0] is a string ('a'); it must be a number",
        ),
        (
            '{"scores": [1], "logprobs": [[[0.0]]], "ref_logprobs": [[0.0]], "values": [[0.0]]}',
            "logprobs[0][0] is a list; it must be a number",
        ),
        (
            '{"scores": [1], "logprobs": [0.0], "ref_logprobs": [[0.0]], "values": [[0.0]]}',
            "logprobs[0] is the number 0.0; it must be a row: a list of numbers",
        ),
        (
            '{"scores": [1], "logprobs": [[0.0]], "ref_logprobs": [[0.0]], "values": {}}',
            "values is an object; it must be a list of rows",
        ),
        (
            '{"scores": [true], "logprobs": [[0.0]], "ref_logprobs": [[0.0]], "values": [[0.0]]}',
            "scores[0] is true; it must be a number",
        ),
        (
            '{"scores": [1], "logprobs": [[NaN]], "ref_logprobs": [[0.0]], "values": [[0.0]]}',
            "NaN is not JSON",
        ),
        (
            '{"scores": [1], "logprobs": [[1e999]], "ref_logprobs": [[0.0]], "values": [[0.0]]}',
            "logprobs[0][0] is not a finite float",
        ),
        ("{" + GOOD_BATCH + ', "gamma": "high"}', "gamma is a string ('high'); it must be a"),
        ("{" + GOOD_BATCH + ', "kl_coef": null}', "kl_coef is null; it must be a number"),
        ("{" + GOOD_BATCH + ', "estimator": 1}', "estimator is the number 1; it must be one of"),
        # the library's own validation, shown the same way
        ("{" + GOOD_BATCH + ', "gamma": 2}', "gamma must lie in"),
        ('{"scores": [], "logprobs": [], "ref_logprobs": [], "values": []}', "no valid position"),
    ],
)
def test_trace_json_errors_are_one_line_naming_the_file(text, message, tmp_path, capsys):
    path = tmp_path / "batch.json"
    path.write_text(text)
    error = one_error_line(
        capsys, cli.main(["trace", "--json", str(path)]), f"ppo-fast trace: --json {path}: "
    )
    assert message in error


def test_trace_unknown_key_message_is_the_issues(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "batch.json").write_text("{" + GOOD_BATCH + ', "gama": 0.9}')
    assert cli.main(["trace", "--json", "batch.json"]) == 2
    assert capsys.readouterr().err == (
        "ppo-fast trace: --json batch.json: unknown key 'gama' (did you mean 'gamma'?)\n"
    )


def test_trace_json_from_stdin_and_a_missing_file(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("sys.stdin", io.StringIO("null"))
    error = one_error_line(capsys, cli.main(["trace", "--json", "-"]), "ppo-fast trace: --json -: ")
    assert error.startswith("the top level is null")
    missing = tmp_path / "nope.json"
    error = one_error_line(
        capsys, cli.main(["trace", "--json", str(missing)]), f"ppo-fast trace: --json {missing}: "
    )
    assert error == "cannot read it: No such file or directory"


@pytest.mark.parametrize(
    ("argv", "prefix", "message"),
    [
        (["trace", "--estimator", "k9"], "ppo-fast trace: ", "argument --estimator: invalid"),
        (["bench", "--budget", "soon"], "ppo-fast bench: ", "argument --budget: invalid float"),
        (["frobnicate"], "ppo-fast: ", "argument command: invalid choice"),
        ([], "ppo-fast: ", "the following arguments are required: command"),
    ],
)
def test_usage_errors_are_one_line(argv, prefix, message, capsys):
    error = one_error_line(capsys, cli.main(argv), prefix)
    assert error.startswith(message) and error.endswith("--help)")


def test_trace_output_is_unchanged_for_valid_input(capsys, tmp_path):
    """Validation adds nothing to a good batch's output: the file gives the seed's tables."""
    path = tmp_path / "seed.json"
    path.write_text(json.dumps(cli.SEED_BATCH))
    assert cli.main(["trace"]) == 0
    seed = capsys.readouterr()
    assert cli.main(["trace", "--json", str(path)]) == 0
    assert capsys.readouterr() == seed and seed.err == ""


# bench: the shapes, the output paths, before any work

TINY = ["--kernels", "gae", "--shapes", "4x16", "--threads", "1", "--scaling", "0"]
TINY += ["--budget", "0.001", "--repeats", "1", "--no-progress"]


def test_bench_refuses_a_batch_larger_than_memory_up_front(capsys):
    error = one_error_line(
        capsys,
        cli.main(["bench", *TINY, "--shapes", "10000000x10000000"]),
        "ppo-fast bench: --shapes 10000000x10000000: ",
    )
    assert "the 10000000x10000000 float32 batch needs at least" in error
    assert "PiB of memory" in error and "choose a smaller BxT" in error


def test_bench_memory_check_names_the_option(capsys, monkeypatch):
    from ppo_fast.bench import cli as bench_cli

    monkeypatch.setattr(bench_cli, "available_memory", lambda: 10**8)
    error = one_error_line(
        capsys,
        cli.main(["bench", *TINY, "--scaling", "1e7"]),
        "ppo-fast bench: --scaling 1e7: ",
    )
    assert "the 10000x1000 float32 batch needs at least" in error
    assert error.endswith("choose a smaller --scaling")


def test_bench_memory_check_counts_the_cold_runs_buffer(capsys, monkeypatch):
    """--cold reads a buffer of twice the largest cache before every sample: a batch that fits
    the memory without it may not with it, and the error says so."""
    from ppo_fast.bench import cli as bench_cli
    from ppo_fast.bench import roofline

    monkeypatch.setattr(bench_cli, "available_memory", lambda: 10**8)
    monkeypatch.setattr(bench_cli, "evict_bytes", lambda: 10**8)
    assert roofline.evict_bytes() >= roofline.EVICT_MIN_BYTES
    error = one_error_line(
        capsys, cli.main(["bench", *TINY, "--cold"]), "ppo-fast bench: --shapes 4x16: "
    )
    assert "the 4x16 float32 batch needs at least" in error
    assert error.endswith("(the need includes --cold's buffer of 0.0931 GiB)")


def test_bench_cold_runs_every_sample_from_memory_and_says_so(capsys, monkeypatch, tmp_path):
    from ppo_fast.bench import roofline

    monkeypatch.setattr(roofline, "evict_bytes", lambda: 1 << 20)  # a small buffer: fast
    path = tmp_path / "cold.json"
    argv = ["bench", *TINY, "--cold", "--json", str(path)]
    argv[argv.index("--repeats") + 1] = "2"
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "cold (--cold): every sample one call, and every copy, after a read of 1 MiB" in out
    document = json.loads(path.read_text())
    assert document["plan"]["cold"] is True
    timed = [row for row in document["rows"] if row["status"] == "ok"]
    assert timed and all(row["evicted_bytes"] == 1 << 20 for row in timed)
    assert all(row["number"] == 1 for row in timed if row["kind"] != "floor")


def test_batch_sizes_need_no_allocation():
    from ppo_fast.bench.batch import Batch

    huge = Batch((10**7, 10**7), "float64")
    assert huge.nbytes("values") == 8 * 10**14 and huge.nbytes("mask") == 10**14
    assert huge.nbytes("scores") == 8 * 10**7
    assert "values" not in vars(huge)  # nothing was built
    small = Batch((8, 128), "float32")
    for name in ("scores", "lengths", "mask", "logprobs", "returns"):
        assert small.nbytes(name) == getattr(small, name).nbytes


@pytest.mark.parametrize(
    ("option", "path", "message"),
    [
        ("--json", "{tmp}/missing/x.json", "the folder {tmp}/missing does not exist"),
        ("--json", "{tmp}", "is a folder; give a file name in it"),
        ("--json", "{tmp}/file.txt/x.json", "{tmp}/file.txt is not a folder"),
        ("--plot", "{tmp}/p.txt", "matplotlib cannot write .txt files; end the name with one of"),
        ("--plot", "{tmp}", "is a folder; give a file name in it"),
        ("--plot", "{tmp}/missing/p.png", "the folder {tmp}/missing does not exist"),
    ],
)
def test_bench_checks_output_paths_before_any_work(option, path, message, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    (tmp_path / "file.txt").write_text("")
    path = path.format(tmp=tmp_path)
    error = one_error_line(  # nothing printed on stdout: no run
        capsys, cli.main(["bench", *TINY, option, path]), f"ppo-fast bench: {option} {path}: "
    )
    assert message.format(tmp=tmp_path) in error
    assert sorted(os.listdir(tmp_path)) == ["file.txt"]


def test_bench_refuses_a_folder_it_cannot_write(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o555)

    def refuse(*args, **kwargs):  # what a read-only folder answers (root would write anyway)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    error = one_error_line(
        capsys,
        cli.main(["bench", *TINY, "--json", f"{folder}/x.json"]),
        f"ppo-fast bench: --json {folder}/x.json: ",
    )
    assert error.startswith(f"cannot write in {folder}")


# atomic writes


def test_atomic_write_renames_a_complete_file_into_place(tmp_path):
    target = tmp_path / "out.json"
    with atomic_write(target) as file:
        file.write("{}")
        assert not target.exists() and len(os.listdir(tmp_path)) == 1  # the temporary file
    assert target.read_text() == "{}" and os.listdir(tmp_path) == ["out.json"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask  # as open() gives
    with atomic_write(target, "wb") as file:
        file.write(b"[]")
    assert target.read_bytes() == b"[]"


@pytest.mark.parametrize("exception", [KeyboardInterrupt, ValueError])
def test_atomic_write_leaves_the_target_as_it_was_on_any_exception(exception, tmp_path):
    target = tmp_path / "out.json"
    target.write_text("the old results")
    with pytest.raises(exception), atomic_write(target) as file:
        file.write("half of the new")
        raise exception
    assert target.read_text() == "the old results" and os.listdir(tmp_path) == ["out.json"]


def test_atomic_path_gives_a_writer_a_path_and_renames_it_into_place(tmp_path):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    with atomic_path(target) as temporary:
        assert os.path.dirname(temporary) == str(tmp_path) and os.path.getsize(temporary) == 0
        with open(temporary, "wb") as file:  # opened by the writer itself (pyarrow does)
            file.write(b"new")
    assert target.read_bytes() == b"new" and os.listdir(tmp_path) == ["out.bin"]
    with pytest.raises(KeyboardInterrupt), atomic_path(target) as temporary:
        with open(temporary, "wb") as file:
            file.write(b"half")
        raise KeyboardInterrupt
    assert target.read_bytes() == b"new" and os.listdir(tmp_path) == ["out.bin"]


def test_an_interrupted_json_write_leaves_no_file(tmp_path, capsys, monkeypatch):
    from ppo_fast.bench import cli as bench_cli

    def interrupted_dump(document, file, **options):
        file.write('{"environment": ')
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_cli.json, "dump", interrupted_dump)
    try:
        status = cli.main(["bench", *TINY, "--json", str(tmp_path / "x.json")])
    except KeyboardInterrupt:  # not pytest's: the test fails, the session goes on
        pytest.fail("main let KeyboardInterrupt through")
    assert status == 130
    assert capsys.readouterr().err == "ppo-fast: interrupted\n"
    assert os.listdir(tmp_path) == []


# SIGINT and SIGTERM


def test_sigterm_in_process_ends_with_one_line_and_143(tmp_path, capsys, monkeypatch):
    from ppo_fast.bench import cli as bench_cli

    def terminated_run(plan, progress):
        # without main's handler, SIGTERM would end pytest itself
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)
        raise AssertionError("SIGTERM did not stop the run")

    monkeypatch.setattr(bench_cli, "run", terminated_run)
    # main takes the signals only where they have their default handling, and a library may have
    # put its own handler in this process before (Ray's SIGTERM handler, once a test in this
    # pytest worker started a local cluster), which would end the process: the defaults first.
    defaults = {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler}
    previous = {signum: signal.signal(signum, default) for signum, default in defaults.items()}
    try:
        assert cli.main(["bench", *TINY, "--json", str(tmp_path / "x.json")]) == 143
        captured = capsys.readouterr()
        assert captured.err == "ppo-fast: terminated\n" and captured.out == ""
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # put back
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert os.listdir(tmp_path) == []
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _children(pid: int) -> list[int]:
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat_file:
                    fields = stat_file.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                children.append(int(entry))
    return children


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat_file:
            return stat_file.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow  # installs, or runs fresh processes: the fast lane (-m "not slow") skips it
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the probes through /proc")
@pytest.mark.parametrize(
    ("signum", "status", "line"),
    [(signal.SIGINT, 130, "ppo-fast: interrupted"), (signal.SIGTERM, 143, "ppo-fast: terminated")],
)
def test_a_signal_stops_bench_cleanly_with_its_probes(signum, status, line, tmp_path):
    """The signal reaches ``ppo-fast bench`` while a --startup probe (a fresh python) runs: one
    line, the status, no output file nor temporary file, and the probe is gone too."""
    command = [sys.executable, "-m", "ppo_fast.cli", "bench", *TINY, "--startup"]
    command += ["--json", str(tmp_path / "x.json"), "--plot", str(tmp_path / "x.png")]
    bench = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # as from a shell: SIGINT not ignored, even where pytest runs in the background
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 240
        probes: list[int] = []
        while not probes and bench.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
            probes = _children(bench.pid)
        assert probes, "no probe started"
        bench.send_signal(signum)
        out, err = bench.communicate(timeout=60)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.communicate()
    assert bench.returncode == status, err
    assert err.splitlines() == [line] and out == ""
    assert os.listdir(tmp_path) == []
    assert not any(_alive(pid) for pid in probes)


def test_trace_an_unavailable_backend_is_one_line(capsys, monkeypatch):
    def unavailable(name=None):
        raise cli._backend.BackendUnavailableError("the cython backend is not built:\n  rebuild")

    monkeypatch.setattr(cli._backend, "get_backend", unavailable)
    error = one_error_line(
        capsys, cli.main(["trace", "--backend", "cython"]), "ppo-fast trace: --backend cython: "
    )
    assert error == "the cython backend is not built: rebuild"


PLOT_ROWS = [
    {"status": "ok", "kernel": "gae", "implementation": name, "dtype": "float32", "threads": 1}
    | {"tokens": tokens, "median": 1e-6 * tokens}
    for name in ("ppo_fast[numba]", "floor")
    for tokens in (1000, 10000)
]


def test_the_plot_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from ppo_fast.bench import plot

    plot(PLOT_ROWS, str(tmp_path / "plot"))  # as savefig: no extension gives .png
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"

    def interrupted_savefig(self, file, **options):
        file.write(b"\x89PNG half")
        raise KeyboardInterrupt

    monkeypatch.setattr(Figure, "savefig", interrupted_savefig)
    with pytest.raises(KeyboardInterrupt):
        plot(PLOT_ROWS, str(tmp_path / "plot.png"))
    assert os.listdir(tmp_path) == ["plot.png"]
    assert (tmp_path / "plot.png").stat().st_size > 100  # the earlier plot, untouched


def test_trace_groups_prints_each_groups_statistics_and_advantages(capsys):
    assert cli.main(["trace", "--groups"]) == 0
    out = capsys.readouterr().out
    groups = [line.split() for line in out.splitlines()[3:6]]
    # q-17: rows 0, 2, 4, 7 with scores 1, 0, 1, 1: mean 0.75, std (ddof 1) 0.5
    assert groups[0] == ["0", "q-17", "0,2,4,7", "4", "0.7500", "0.5000", "1.0000", "1.0000"]
    assert groups[2][:4] == ["2", "q-9", "5", "1"] and groups[2][5] == "-"
    rows = {line.split()[0]: line.split() for line in out.splitlines()[-8:]}
    # row 6 (q-4, scores 0, 0.5, 1): GRPO (1 - 0.5) / (0.5 + 1e-6), Dr.GRPO 0.5, RLOO 1 - 0.25,
    # GPG alpha = 8 / 6 nonzero scores times 0.5, and it is q-4's best row: pass@k 0.5 / 0.5
    assert rows["6"][3:] == ["1.0000", "1.0000", "0.5000", "1.0916", "0.7500", "0.6667", "1.0000"]
    # row 5 is alone in q-9: baseline 0 and std 1, pass@k 0
    assert rows["5"][3:] == ["1.0000", "1.0000", "1.0000", "1.0000", "1.0000", "1.3333", "0.0000"]


def test_trace_groups_reads_json_and_names_bad_input(tmp_path, capsys):
    path = tmp_path / "groups.json"
    path.write_text(json.dumps({"scores": [1, 2, 3], "groups": ["a", "a", 7]}))
    assert cli.main(["trace", "--groups", "--json", str(path)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[-3:]]
    assert [row[4] for row in rows] == ["-0.7071", "0.7071", "3.0000"]
    for batch, message in [
        ({"scores": [1, 2], "groups": ["a"]}, "groups has 1 labels and scores 2"),
        ({"scores": [1], "groups": [None]}, "groups[0] is null; a group label is a string"),
        ({"scores": [1], "group": ["a"]}, "unknown key 'group' (did you mean 'groups'?)"),
        ({"scores": ["x"], "groups": ["a"]}, "scores[0]"),
    ]:
        path.write_text(json.dumps(batch))
        error = one_error_line(
            capsys, cli.main(["trace", "--groups", "--json", str(path)]), "ppo-fast trace: "
        )
        assert message in error


# ppo-fast advantages: rollout datasets (ppo_fast.data)


def write_rollouts(path, **columns) -> None:
    """A small Parquet rollout file: three rows, ppo_fast's column names, ``columns`` replaced
    (a pyarrow array, or None to leave the column out)."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = {
        "uid": pa.array(["a", "a", "b"]),
        "score": pa.array([1.0, 0.0, 0.5]),
        "logprobs": pa.array([[-0.5, -1.0], [-0.2], [-0.3, -0.4, -0.1]]),
        "ref_logprobs": pa.array([[-0.6, -1.0], [-0.1], [-0.3, -0.5, -0.1]]),
        "values": pa.array([[0.1, 0.2], [0.3], [0.0, 0.5, 0.4]]),
    }
    table.update(columns)
    pq.write_table(pa.table({k: v for k, v in table.items() if v is not None}), path)


def test_advantages_writes_the_input_with_advantages_and_a_json_summary(tmp_path, capsys):
    pq = pytest.importorskip("pyarrow.parquet")
    from ppo_fast import data

    source, output = tmp_path / "in.parquet", tmp_path / "out.parquet"
    write_rollouts(source)
    arguments = ["advantages", str(source), "-o", str(output), "--kl-coef", "0.1", "--json"]
    assert cli.main([*arguments, "--batch-rows", "2"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["rows"], summary["tokens"], summary["passes"]) == (3, 6, 2)
    expected = data.advantages(pq.read_table(source), kl_coef=0.1)
    got = pq.read_table(output)
    assert got.column_names == expected.column_names
    np.testing.assert_allclose(
        got["advantages"].combine_chunks().flatten().to_numpy(),
        expected["advantages"].combine_chunks().flatten().to_numpy(),
        rtol=1e-12,
    )
    assert got["returns"].equals(expected["returns"])
    assert sorted(os.listdir(tmp_path)) == ["in.parquet", "out.parquet"]


def test_advantages_runs_remax_and_opo_as_the_table_api(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from ppo_fast import data

    with pytest.raises(SystemExit):
        cli.main(["advantages", "--help"])
    usage = " ".join(capsys.readouterr().out.split())
    assert "remax (needs --baseline-column" in usage and "opo (the group's mean" in usage
    source = tmp_path / "in.parquet"
    write_rollouts(source, greedy=pa.array([0.5, 0.5, 0.2]))
    table = pq.read_table(source)
    for estimator, extra, columns in (
        ("remax", ["--baseline-column", "greedy"], {"baseline": "greedy"}),
        ("opo", [], {}),
    ):
        output = tmp_path / f"{estimator}.parquet"
        arguments = ["advantages", str(source), "-o", str(output), "--estimator", estimator]
        assert cli.main([*arguments, *extra, "--batch-rows", "2"]) == 0
        expected = data.advantages(
            table, estimator=estimator, columns=data.resolve_columns(**columns)
        )
        assert pq.read_table(output).equals(expected)
    capsys.readouterr()


def _list(values, kind):
    pa = pytest.importorskip("pyarrow")
    return pa.array(values, pa.list_(kind))


BAD_ROLLOUTS = {
    "missing column": (
        {"values": None},
        "no column 'values' (the values column); the columns are uid, score, logprobs, "
        "ref_logprobs: name it with --values-column",
    ),
    "list of ints": (
        {"values": ("int64", [[1, 2], [3], [0, 5, 4]])},
        "column 'values' (the values column) is list<int64>; per-token data are list<float> "
        "or list<double>: cast it",
    ),
    "list of strings": (
        {"logprobs": ("string", [["a", "b"], ["c"], ["d", "e", "f"]])},
        "column 'logprobs' (the logprobs column) is list<string>",
    ),
    "null row": (
        {"values": ("float64", [[0.1, 0.2], [0.3], None])},
        "column 'values' (the values column) is null at row 2; every row needs a list",
    ),
    "null token": (
        # a second null after it: the message names the first
        {"ref_logprobs": ("float64", [[-0.6, -1.0], [None], [-0.3, None, -0.1]])},
        "column 'ref_logprobs' (the ref_logprobs column) has a null inside the list of row 1 "
        "(token 0)",
    ),
    "lengths differ": (
        # rows 1 and 2 both differ: the message names the first
        {"values": ("float64", [[0.1, 0.2], [0.3, 0.0], [0.0, 0.5, 0.4, 0.9]])},
        "row 1 has 1 tokens in column 'logprobs' but 2 in column 'values'",
    ),
    "null score": (
        {"score": [1.0, None, 0.5]},
        "column 'score' (the score column) is null at row 1",
    ),
}


@pytest.mark.parametrize("case", list(BAD_ROLLOUTS))
def test_advantages_refuses_bad_rollouts_naming_column_row_and_fix(case, tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    columns, message = BAD_ROLLOUTS[case]
    arrays = {
        name: value
        if value is None or not isinstance(value, tuple)
        else _list(value[1], getattr(pa, value[0])())
        for name, value in columns.items()
    }
    arrays = {k: (pa.array(v) if isinstance(v, list) else v) for k, v in arrays.items()}
    source, output = tmp_path / "in.parquet", tmp_path / "out.parquet"
    write_rollouts(source, **arrays)
    status = cli.main(["advantages", str(source), "-o", str(output), "--kl-coef", "0.1"])
    error = one_error_line(capsys, status, f"ppo-fast advantages: {source}: ")
    assert message in error
    assert sorted(os.listdir(tmp_path)) == ["in.parquet"]  # nothing at OUTPUT, no temporary


def test_advantages_refuses_bad_paths(tmp_path, capsys):
    source = tmp_path / "in.parquet"
    write_rollouts(source)
    text = tmp_path / "notes.parquet"
    text.write_text("score,values\n1.0,0.5\n")
    cases = [
        ([str(source), "-o", str(source)], f"-o {source} is the input file"),
        ([str(source), "-o", f"{tmp_path}/missing/out.parquet"], "does not exist"),
        ([str(source), "-o", f"{text}/out.parquet"], "is not a folder"),
        ([str(source), "-o", f"{tmp_path}/out.csv"], "end the name with .parquet"),
        ([str(text), "-o", f"{tmp_path}/out.parquet"], "is not a Parquet, Arrow IPC or JSON"),
        ([f"{tmp_path}/none.parquet", "-o", f"{tmp_path}/o.parquet"], "no such file"),
    ]
    for arguments, message in cases:
        error = one_error_line(
            capsys, cli.main(["advantages", *arguments]), "ppo-fast advantages: "
        )
        assert message in error, (arguments, error)
    (tmp_path / "broken.parquet").write_bytes(b"PAR1" + b"\0" * 40)
    status = cli.main(["advantages", str(tmp_path / "broken.parquet"), "-o", f"{tmp_path}/o.arrow"])
    assert "cannot read it" in one_error_line(capsys, status, "ppo-fast advantages: ")
    assert sorted(os.listdir(tmp_path)) == ["broken.parquet", "in.parquet", "notes.parquet"]


def test_advantages_interrupted_leaves_no_output(tmp_path, capsys, monkeypatch):
    from ppo_fast.data import _stream

    source, output = tmp_path / "in.parquet", tmp_path / "out.parquet"
    write_rollouts(source)
    real = _stream.Writer.write

    def write_then_interrupt(self, batch):
        real(self, batch)
        raise KeyboardInterrupt

    monkeypatch.setattr(_stream.Writer, "write", write_then_interrupt)
    assert cli.main(["advantages", str(source), "-o", str(output)]) == 130
    assert capsys.readouterr().err == "ppo-fast: interrupted\n"
    assert sorted(os.listdir(tmp_path)) == ["in.parquet"]


def test_trace_dataset_shows_the_example_through_ppo_fast_data(tmp_path, capsys):
    pytest.importorskip("pyarrow")
    assert cli.main(["trace", "--dataset"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ppo_fast.data on the example dataset (ppo-fast advantages --example")
    rows = rows_of(out)
    # Row 0 is the seed's example: its returns are the trace's (0.7212, 0.7960, 0.6800).
    assert [r[-1] for r in rows[:3]] == ["0.7212", "0.7960", "0.6800"]
    assert rows[4][3] == "0" and rows[4][-2:] == ["0.0000", "0.0000"]  # the masked tool token
    example = tmp_path / "rollouts.parquet"
    assert cli.main(["advantages", "--example", str(example)]) == 0
    capsys.readouterr()
    assert cli.main(["trace", "--dataset", str(example)]) == 0
    assert rows_of(capsys.readouterr().out) == rows
    # a JSON lines file, which the source reads whole (before 0.8.26 the trace then failed)
    lines = tmp_path / "rollouts.jsonl"
    lines.write_text("".join(json.dumps(row) + "\n" for row in cli_example_rows()))
    assert cli.main(["trace", "--dataset", str(lines)]) == 0
    assert rows_of(capsys.readouterr().out) == rows
    # without a mask column every token is valid, and the trace shows so
    unmasked = tmp_path / "unmasked.jsonl"
    without_mask = [{k: v for k, v in row.items() if k != "mask"} for row in cli_example_rows()]
    unmasked.write_text("".join(json.dumps(row) + "\n" for row in without_mask))
    assert cli.main(["trace", "--dataset", str(unmasked)]) == 0
    unmasked_rows = rows_of(capsys.readouterr().out)
    assert [r[3] for r in unmasked_rows] == ["1"] * 9
    assert unmasked_rows[4][-2:] != ["0.0000", "0.0000"]  # the tool token counts now
    missing = tmp_path / "missing.parquet"
    error = one_error_line(
        capsys, cli.main(["trace", "--dataset", str(missing)]), "ppo-fast trace: --dataset: "
    )
    assert error.startswith("no such file")


def _readme_block(starting: str) -> list[str]:
    """The lines of the README's code block whose first line starts with ``starting``."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```$", readme, re.MULTILINE | re.DOTALL)
    block = next(b for b in blocks if b.startswith(starting))
    return block.splitlines()


def test_the_readme_shows_what_trace_and_trace_dataset_print(tmp_path, capsys):
    """The README's two traces (the seed's pipeline, the example dataset) are the commands'
    output, rows and columns, but for the backend and the file named in the first line."""
    pytest.importorskip("pyarrow")
    assert cli.main(["trace"]) == 0
    printed = capsys.readouterr().out.splitlines()
    shown = _readme_block("KL-shaped rewards, GAE and whitening:")
    assert printed[1 : len(shown)] == shown[1:]
    assert printed[0].split(", backend=")[0] == shown[0].split(", backend=")[0]
    example = tmp_path / "rollouts.parquet"
    assert cli.main(["advantages", "--example", str(example)]) == 0
    capsys.readouterr()
    assert cli.main(["trace", "--dataset", str(example)]) == 0
    printed = capsys.readouterr().out.splitlines()
    shown = _readme_block("ppo_fast.data on rollouts.parquet:")
    assert printed[1:] == shown[1:]
    assert printed[0] == shown[0].replace("rollouts.parquet", str(example), 1)


def cli_example_rows() -> list[dict]:
    from ppo_fast.data import cli as data_cli

    return data_cli.example_table().to_pylist()


def test_advantages_names_the_output_when_writing_fails(tmp_path, capsys, monkeypatch):
    from ppo_fast.data import _stream

    source = tmp_path / "in.parquet"
    write_rollouts(source)

    def full(self, batch):  # the writer thread meets a full disk
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_stream.Writer, "_write", full)
    output = tmp_path / "out.parquet"
    status = cli.main(["advantages", str(source), "-o", str(output)])
    error = one_error_line(capsys, status, f"ppo-fast advantages: -o {output}: ")
    assert error == "cannot write it (No space left on device)"
    assert sorted(os.listdir(tmp_path)) == ["in.parquet"]


def test_advantages_refuses_a_folder_it_cannot_write(tmp_path, capsys, monkeypatch):
    source = tmp_path / "in.parquet"
    write_rollouts(source)

    def refuse(*args, **kwargs):  # what a read-only folder answers (root would write anyway)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    output = tmp_path / "out.parquet"
    status = cli.main(["advantages", str(source), "-o", str(output)])
    error = one_error_line(capsys, status, f"ppo-fast advantages: -o {output}: ")
    assert error.startswith(f"cannot write in {tmp_path} (Permission denied)")
    assert sorted(os.listdir(tmp_path)) == ["in.parquet"]
