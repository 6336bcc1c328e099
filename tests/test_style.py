"""The code base is ruff-clean (lint and format), as configured in pyproject.toml."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff(command):
    ruff = shutil.which("ruff")
    assert ruff, "ruff is part of the test extra: pip install -e '.[test]'"
    out = subprocess.run([ruff, *command, "."], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_ci_runs_exactly_the_readmes_test_command():
    """The README opens with two commands; the second (the tests) is what .ci/run runs."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("```bash\n", 1)[1].split("```", 1)[0]
    install_and_run, install_and_test = (
        line.split("  #")[0].strip() for line in block.strip().splitlines()
    )
    # python -m: a bare pip (a pyenv shim) fails the command when its rehash cannot take the lock
    assert install_and_run.startswith("python -m pip install ")
    assert install_and_run.endswith("&& python -m ppo_fast bench")
    assert install_and_test.endswith("python -m pytest -n auto --dist loadgroup")
    assert install_and_test.startswith("python -m pip install ")
    assert " pip install" not in install_and_test.replace("python -m pip install", "")
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert install_and_test in [line.strip() for line in ci_lines]


def test_the_package_version_is_the_one_pyproject_declares():
    import ppo_fast

    declared = next(
        line.split("=", 1)[1].strip().strip('"')
        for line in (ROOT / "pyproject.toml").read_text().splitlines()
        if line.startswith("version = ")
    )
    assert ppo_fast.__version__ == declared
    assert f"## {declared}" in (ROOT / "CHANGELOG.md").read_text()
