"""ppo_fast.compat.openrlhf.install(): OpenRLHF's PolicyLoss and experience maker replaced in
the modules OpenRLHF's trainer imports, in this process and, through the launcher's Ray
runtime_env, inside a Ray worker on a local cluster.

OpenRLHF 0.11.2's modules cannot be imported on a CPU machine (they import vLLM and flash-attn,
CUDA builds), so the hook is exercised on stand-in modules under OpenRLHF's names, written to a
temporary directory and imported through Python's import system as OpenRLHF's are:
``openrlhf.models.loss`` holds the verbatim copy's PolicyLoss (ppo_fast._peers.openrlhf_0_11_2),
``openrlhf.models`` re-exports it, ``openrlhf.trainer.ray.ppo_actor`` imports it as OpenRLHF's
``from openrlhf.models import ... PolicyLoss`` does, and ``openrlhf.trainer.ppo_utils.
experience_maker.RemoteExperienceMaker`` holds the copy's three methods in its class body. The
version refused or accepted is the installed distribution's (openrlhf==0.11.2 in CI)."""

from __future__ import annotations

import copy
import importlib.metadata
import os
import sys
import types
from pathlib import Path

import pytest
import torch
from peers.cases import assert_parity
from test_compat_estimators_openrlhf import _args, _copy_maker, experiences

from ppo_fast._peers import openrlhf_0_11_2 as ORL
from ppo_fast.compat import _openrlhf_hook as hook
from ppo_fast.compat import openrlhf as compat

_STANDIN = {
    "openrlhf/__init__.py": "",
    "openrlhf/models/__init__.py": "from .loss import PolicyLoss, ValueLoss\n",
    "openrlhf/models/loss.py": (
        "from ppo_fast._peers.openrlhf_0_11_2 import PolicyLoss, ValueLoss\n"
    ),
    "openrlhf/trainer/__init__.py": "",
    "openrlhf/trainer/ray/__init__.py": "",
    "openrlhf/trainer/ray/ppo_actor.py": "from openrlhf.models import PolicyLoss\n",
    "openrlhf/trainer/ppo_utils/__init__.py": "",
    "openrlhf/trainer/ppo_utils/experience_maker.py": (
        "from ppo_fast._peers import openrlhf_0_11_2 as _copy\n\n\n"
        "class RemoteExperienceMaker(_copy.RemoteExperienceMaker):\n"
        "    compute_advantages_and_returns = _copy.compute_advantages_and_returns\n"
        "    get_advantages_and_returns = _copy.get_advantages_and_returns\n"
        "    get_cumulative_returns = _copy.get_cumulative_returns\n"
    ),
}
_MODULES = ("openrlhf.models.loss", "openrlhf.models", "openrlhf.trainer.ray.ppo_actor")
try:
    _VERSION = importlib.metadata.version("openrlhf")
except importlib.metadata.PackageNotFoundError:
    _VERSION = None
pytestmark = pytest.mark.skipif(
    _VERSION != hook.OPENRLHF_VERSION and os.environ.get("CI") != "true",
    reason=f"openrlhf=={hook.OPENRLHF_VERSION} is not installed (CI installs it)",
)


def _write_standin(root: Path) -> Path:
    for name, text in _STANDIN.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def _import_and_check(args, dtype) -> dict:
    """Import OpenRLHF's (stand-in) modules as its trainer does and report what they hold: run in
    this process and in a Ray worker."""
    import openrlhf.trainer.ray.ppo_actor  # noqa: F401 (imports openrlhf.models first)
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    import ppo_fast

    maker = RemoteExperienceMaker(
        types.SimpleNamespace(value=0.05), types.SimpleNamespace(args=copy.deepcopy(args))
    )
    actual = maker.compute_advantages_and_returns(experiences(dtype))
    values, rewards = torch.randn(3, 5, dtype=dtype), torch.randn(3, 5, dtype=dtype)
    return {
        "ppo_fast": ppo_fast.__file__,
        "installed": compat.installed(),
        "policy_loss": [sys.modules[m].PolicyLoss is compat.PolicyLoss for m in _MODULES],
        "maker": RemoteExperienceMaker.compute_advantages_and_returns
        is compat.compute_advantages_and_returns,
        "advantages": [e.advantages for e in actual],
        "returns": [e.returns for e in actual],
        "gae": maker.get_advantages_and_returns(values, rewards, None, 0.9, 0.8),
        "gae_inputs": (values, rewards),
    }


def _expected(args, dtype) -> list:
    return ORL.compute_advantages_and_returns(_copy_maker(copy.deepcopy(args)), experiences(dtype))


def _assert_hook_in_place(report: dict, args, dtype) -> None:
    assert report["installed"] and all(report["policy_loss"]) and report["maker"], report
    expected = _expected(args, dtype)
    # GAE's advantages are normalised with OpenRLHF's float32 statistics: float32's tolerance.
    for got, want in zip(report["advantages"], expected, strict=True):
        assert_parity(got, want.advantages, "advantages", rtol=1e-5)
    for got, want in zip(report["returns"], expected, strict=True):
        assert_parity(got, want.returns, "returns")
    values, rewards = report["gae_inputs"]
    want = ORL.get_advantages_and_returns(None, values, rewards, None, 0.9, 0.8)
    assert_parity(report["gae"][0], want[0], "get_advantages_and_returns")


@pytest.fixture
def standin(tmp_path, monkeypatch):
    """The stand-in modules importable in this process; OpenRLHF's names removed afterwards."""
    monkeypatch.syspath_prepend(str(_write_standin(tmp_path)))
    yield
    hook.uninstall()
    for name in [n for n in sys.modules if n == "openrlhf" or n.startswith("openrlhf.")]:
        del sys.modules[name]


ARGS = _args("gae", 4, 0.95, False, None, None)


def test_install_patches_modules_imported_before_and_after_and_uninstall_restores(standin):
    import openrlhf.models.loss as loss  # imported before install: patched at once

    hook.install()
    hook.install()  # idempotent
    assert loss.PolicyLoss is compat.PolicyLoss
    report = _import_and_check(ARGS, torch.float64)  # the others: patched as they are imported
    _assert_hook_in_place(report, ARGS, torch.float64)
    hook.uninstall()
    assert not compat.installed()
    assert all(sys.modules[m].PolicyLoss is ORL.PolicyLoss for m in _MODULES)
    maker = sys.modules[hook._MAKER].RemoteExperienceMaker
    assert maker.compute_advantages_and_returns is ORL.compute_advantages_and_returns
    assert maker.get_cumulative_returns is ORL.get_cumulative_returns
    hook.install()  # again, on the modules already imported
    assert loss.PolicyLoss is compat.PolicyLoss
    assert maker.get_cumulative_returns is not ORL.get_cumulative_returns


def test_install_refuses_another_openrlhf(monkeypatch, standin):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.11.3")
    with pytest.raises(
        RuntimeError, match=r"reproduces OpenRLHF 0\.11\.2, this is OpenRLHF 0\.11\.3"
    ):
        hook.install()
    assert not compat.installed()

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(RuntimeError, match=r"OpenRLHF is not installed.*openrlhf==0\.11\.2"):
        hook.install()
    import openrlhf.models.loss as loss

    assert loss.PolicyLoss is ORL.PolicyLoss


def test_a_module_without_a_target_fails_its_import_with_the_reason(standin, tmp_path):
    (tmp_path / "openrlhf/trainer/ray/ppo_actor.py").write_text("Actor = None\n")
    hook.install()
    with pytest.raises(RuntimeError, match=r"openrlhf\.trainer\.ray\.ppo_actor has no PolicyLoss"):
        import openrlhf.trainer.ray.ppo_actor  # noqa: F401


def test_runtime_env_runs_the_setup_hook_with_openrlhfs_environment(monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    env = compat.runtime_env()
    assert env["worker_process_setup_hook"] == "ppo_fast.compat._openrlhf_hook.setup_worker"
    assert env["env_vars"]["NCCL_DEBUG"] == "INFO"
    assert env["env_vars"]["TOKENIZERS_PARALLELISM"] == "true"


def test_the_launcher_starts_ray_with_the_hook_and_runs_openrlhfs_train_ppo_ray(
    monkeypatch, standin
):
    """``python -m ppo_fast.compat.openrlhf ARGS`` (``main``): ray.init with ``runtime_env()``,
    then OpenRLHF's ``train_ppo_ray`` as ``__main__`` with ARGS (Ray and OpenRLHF's script
    recorded, not run: the script imports vLLM)."""
    import runpy

    import ray

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: bool(calls))
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(("init", kwargs)))
    monkeypatch.setattr(
        runpy, "run_module", lambda name, **kwargs: calls.append((name, list(sys.argv), kwargs))
    )
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    hook.main(["--pretrain", "m", "--algo.advantage.estimator", "gae"])
    assert compat.installed()
    assert calls[0] == ("init", {"runtime_env": compat.runtime_env()})
    name, argv, kwargs = calls[1]
    assert name == "openrlhf.cli.train_ppo_ray" and kwargs["run_name"] == "__main__"
    assert argv[1:] == ["--pretrain", "m", "--algo.advantage.estimator", "gae"]
    with pytest.raises(RuntimeError, match=r"already initialised.*runtime_env"):
        hook.main([])


@pytest.mark.slow
@pytest.mark.xdist_group("ray")  # one local Ray cluster at a time (--dist loadgroup)
def test_the_hook_is_in_place_inside_a_ray_worker(tmp_path):
    """ray.init with the launcher's runtime_env on a local cluster: the worker ran the setup hook
    (installed, before any OpenRLHF module was imported) and OpenRLHF's modules imported there
    hold ppo_fast's PolicyLoss and experience maker, with the copy's numbers."""
    ray = pytest.importorskip("ray") if os.environ.get("CI") != "true" else __import__("ray")
    repo = Path(__file__).resolve().parents[1]
    runtime_env = compat.runtime_env()
    path = [str(_write_standin(tmp_path)), str(repo), str(repo / "tests")]
    runtime_env["env_vars"]["PYTHONPATH"] = os.pathsep.join(path)
    ray.init(num_cpus=2, runtime_env=runtime_env, include_dashboard=False)
    try:

        @ray.remote
        def in_worker(args, dtype):
            before = [n for n in sys.modules if n.startswith("openrlhf")]
            return before, _import_and_check(args, dtype)

        before, report = ray.get(in_worker.remote(ARGS, torch.float32), timeout=300)
    finally:
        ray.shutdown()
    assert before == []  # the hook imported nothing of OpenRLHF
    assert report["ppo_fast"].startswith(str(repo / "ppo_fast")), report["ppo_fast"]
    _assert_hook_in_place(report, ARGS, torch.float32)
