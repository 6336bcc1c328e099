"""ppo_fast's verl plugin, end to end in verl 0.9.1 itself: verl's ``ray_trainer.compute_advantage``
on a DataProto with each registered ``ppo_fast_*`` estimator (and with the opt-in patch for gae
and grpo) equals verl's own estimator; ``get_policy_loss_fn("ppo_fast_*")`` called as verl's
actor calls it equals verl's loss in value, metrics and gradient; the installed entry point is
found by a fresh ``import verl``. The names come from ``verl_plugin.names``, the list the plugin
registers, so a function added to ppo_fast.compat.verl is tested here with no edit."""

from __future__ import annotations

import copy
import importlib.metadata
import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from peers.cases import assert_parity

_CI = os.environ.get("CI") == "true"
try:
    import verl
    from verl import DataProto
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import core_algos, ray_trainer
    from verl.workers.config import ActorConfig, PolicyLossConfig
except ImportError as error:  # CI installs verl 0.9.1 and the compat-test extra: fail there
    if _CI:
        raise
    pytest.skip(f"verl 0.9.1 does not import here ({error})", allow_module_level=True)

from ppo_fast.compat import verl as compat  # noqa: E402 (after the skip)
from ppo_fast.compat import verl_plugin  # noqa: E402

ESTIMATORS = verl_plugin.names("estimator")
POLICY_LOSSES = verl_plugin.names("policy_loss")
# The estimators whose inputs verl's compute_advantage passes only under verl's own name.
NAME_GATED = {"gae", "gdpo", "remax", "optimal_token_baseline", "tir_optimal_token_baseline"}


@pytest.fixture(scope="module", autouse=True)
def registered():
    verl_plugin.register()
    yield
    verl_plugin.unregister()


@pytest.fixture
def patched():
    verl_plugin.patch_core_algos()
    yield
    verl_plugin.unpatch_core_algos()


def _data(reward_baselines: bool = False, mask_dtype: torch.dtype = torch.float64) -> DataProto:
    """12 rows of width 7 in four groups of three string uids, right-padded with a hole in one
    row and one row with a single valid token; float64 (the mask ``mask_dtype``: verl's trainer
    slices it from the int64 attention mask)."""
    g = torch.Generator().manual_seed(15)
    rows, width = 12, 7
    lengths = torch.tensor([7, 5, 3, 1, 6, 7, 2, 4, 7, 5, 3, 6])
    mask = (torch.arange(width) < lengths[:, None]).double()
    mask[4, 2] = 0.0
    rewards = torch.zeros(rows, width, dtype=torch.float64)
    rewards[torch.arange(rows), lengths - 1] = torch.randn(rows, generator=g, dtype=torch.float64)
    rewards += 0.01 * torch.randn(rows, width, generator=g, dtype=torch.float64) * mask
    tensors = {
        "token_level_rewards": rewards,
        "response_mask": mask.to(mask_dtype),
        "values": torch.randn(rows, width, generator=g, dtype=torch.float64),
        "old_log_probs": -torch.rand(rows, width, generator=g, dtype=torch.float64),
        "sum_pi_squared": torch.rand(rows, width, generator=g, dtype=torch.float64),
    }
    # What verl's GDPO reads of the batch: the prompts' width and the attention mask.
    tensors["prompts"] = torch.ones(rows, 2, dtype=torch.int64)
    tensors["attention_mask"] = torch.cat([torch.ones(rows, 2), mask], dim=1).long()
    if reward_baselines:
        tensors["reward_baselines"] = torch.randn(rows, generator=g, dtype=torch.float64)
    uids = np.array([f"p{i // 3}" for i in range(rows)], dtype=object)
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uids})


def _algo(**fields) -> AlgoConfig:
    return AlgoConfig(gamma=0.97, lam=0.9, **fields)


def _compute_advantage(name: str, data: DataProto, config: AlgoConfig):
    """verl's trainer call (ray_trainer.py, RayPPOTrainer.fit): advantages and returns."""
    out = ray_trainer.compute_advantage(
        copy.deepcopy(data),
        adv_estimator=name,
        gamma=config.gamma,
        lam=config.lam,
        num_repeat=3,
        norm_adv_by_std_in_grpo=config.get("norm_adv_by_std_in_grpo", True),
        config=config,
    )
    return out.batch["advantages"], out.batch["returns"]


def _verl_branch_kwargs(verl_name: str, data: DataProto, config: AlgoConfig) -> dict:
    """What compute_advantage passes to verl's own ``verl_name`` (ray_trainer.py)."""
    batch = data.batch
    kwargs = {
        "token_level_rewards": batch["token_level_rewards"],
        "response_mask": batch["response_mask"],
        "config": config,
        "index": data.non_tensor_batch["uid"],
    }
    if verl_name == "gae":
        return {
            "token_level_rewards": batch["token_level_rewards"],
            "values": batch["values"],
            "response_mask": batch["response_mask"],
            "config": config,
        }
    if verl_name == "remax":
        kwargs["reward_baselines"] = torch.randn(len(data), dtype=torch.float64)
    if verl_name == "gdpo":
        kwargs["non_tensor_batch"] = data.non_tensor_batch
        kwargs["batch"] = batch
    if verl_name.endswith("optimal_token_baseline"):
        kwargs["sum_pi_squared"] = batch["sum_pi_squared"]
        kwargs["old_log_probs"] = batch["old_log_probs"]
        kwargs["rollout_is_weights"] = None
    return kwargs


@pytest.mark.parametrize(
    ("norm", "mask_dtype"),
    [(True, torch.float64), (False, torch.int64)],
    ids=["std-float-mask", "no-std-int-mask"],
)
def test_each_estimator_in_compute_advantage_equals_verls(norm, mask_dtype):
    config = _algo(norm_adv_by_std_in_grpo=norm)
    data = _data(mask_dtype=mask_dtype)
    for ppo_name, (verl_name, function) in ESTIMATORS.items():
        registered = core_algos.get_adv_estimator_fn(ppo_name)
        assert registered.__ppo_fast_compat__ is function  # ppo_fast's, not verl's, runs
        assert function.__module__.startswith("ppo_fast.compat")
        if verl_name in NAME_GATED:
            continue
        expected = _compute_advantage(verl_name, data, config)
        actual = _compute_advantage(ppo_name, data, config)
        assert_parity(actual[0], expected[0], f"{ppo_name} advantages")
        assert_parity(actual[1], expected[1], f"{ppo_name} returns")
    tested = {v for v, _ in ESTIMATORS.values()} - NAME_GATED
    assert {"grpo", "reinforce_plus_plus", "rloo"} <= tested  # the list is not empty


def test_remax_in_compute_advantage_with_the_baselines_in_the_batch():
    data, config = _data(reward_baselines=True), _algo()
    expected = _compute_advantage("remax", data, config)
    actual = _compute_advantage("ppo_fast_remax", data, config)
    assert_parity(actual[0], expected[0], "remax advantages")
    assert_parity(actual[1], expected[1], "remax returns")


def test_name_gated_estimators_refuse_in_compute_advantage_and_equal_verl_given_the_inputs():
    """verl passes values, the GDPO batch, the OTB inputs and the ReMax baselines only under its
    own names: the ppo_fast_* name says what to set, and given what verl's branch passes, the
    registered function equals verl's."""
    data = _data()
    gdpo = _algo(gdpo_reward_keys=["acc", "fmt"], gdpo_reward_weights=[1.0, 0.5])
    g = np.random.default_rng(3)
    data.non_tensor_batch["acc"] = g.integers(0, 2, len(data)).astype(np.float32)
    data.non_tensor_batch["fmt"] = g.random(len(data)).astype(np.float32)
    for ppo_name, (verl_name, _) in ESTIMATORS.items():
        if verl_name not in NAME_GATED:
            continue
        config = gdpo if verl_name == "gdpo" else _algo()
        with pytest.raises(ValueError, match=rf"{ppo_name} needs .*adv_estimator="):
            _compute_advantage(ppo_name, data, config)
        kwargs = _verl_branch_kwargs(verl_name, data, config)
        if verl_name == "gae":
            expected = core_algos.compute_gae_advantage_return(
                **{k: v for k, v in kwargs.items() if k != "config"},
                gamma=config.gamma,
                lam=config.lam,
            )
        else:
            expected = core_algos.get_adv_estimator_fn(verl_name)(**kwargs)
        actual = core_algos.get_adv_estimator_fn(ppo_name)(**kwargs)
        # GDPO's per-reward scores are float32 in verl (its group statistics too, where
        # ppo_fast's are float64 and rounded once): float32's tolerance.
        rtol = 1e-5 if verl_name == "gdpo" else None
        assert_parity(actual[0], expected[0], f"{ppo_name} advantages", rtol=rtol)
        assert_parity(actual[1], expected[1], f"{ppo_name} returns", rtol=rtol)


@pytest.mark.parametrize("norm", [True, False], ids=["std", "no-std"])
def test_the_opt_in_runs_ppo_fast_in_the_hard_coded_gae_and_grpo_branches(norm, patched):
    config, data = _algo(norm_adv_by_std_in_grpo=norm), _data()
    assert core_algos.compute_gae_advantage_return is compat.compute_gae_advantage_return
    assert core_algos.compute_grpo_outcome_advantage is compat.compute_grpo_outcome_advantage
    assert core_algos.verl_F.masked_whiten is compat.masked_whiten
    results = {name: _compute_advantage(name, data, config) for name in ("gae", "grpo")}
    verl_plugin.unpatch_core_algos()
    assert core_algos.compute_gae_advantage_return.__module__ == core_algos.__name__
    assert not verl_plugin.patched()
    for name, actual in results.items():
        expected = _compute_advantage(name, data, config)
        assert_parity(actual[0], expected[0], f"patched {name} advantages")
        assert_parity(actual[1], expected[1], f"patched {name} returns")
    verl_plugin.patch_core_algos()
    verl_plugin.patch_core_algos()  # idempotent
    assert verl_plugin.patched()
    # verl's own registry entries are never replaced.
    assert core_algos.ADV_ESTIMATOR_REGISTRY["gae"].__module__ == core_algos.__name__


def _actor_config(loss_mode: str, agg: str, global_batch_info: dict) -> ActorConfig:
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=0.2,
        clip_ratio_low=0.15,
        clip_ratio_high=0.28,
        loss_agg_mode=agg,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode, dro_beta=0.1),
        global_batch_info=dict(global_batch_info),
    )


def _actor_call(config: ActorConfig, batch: dict, log_prob: torch.Tensor):
    """workers/utils/losses.py ppo_loss: the loss function by config.policy_loss.loss_mode,
    called with verl's keywords and a bool mask."""
    loss_fn = core_algos.get_policy_loss_fn(config.policy_loss.get("loss_mode", "vanilla"))
    return loss_fn(
        old_log_prob=batch["old_log_probs"],
        log_prob=log_prob,
        advantages=batch["advantages"],
        response_mask=batch["response_mask"].to(bool),
        loss_agg_mode=config.loss_agg_mode,
        config=config,
        rollout_is_weights=batch["rollout_is_weights"],
    )


@pytest.mark.parametrize(
    ("agg", "global_batch_info"),
    [
        ("token-mean", {}),
        (
            "seq-mean-token-mean",
            {"dp_size": 2, "batch_num_tokens": 90, "global_batch_size": 20},
        ),
    ],
    ids=["local", "global"],
)
def test_each_policy_loss_as_verls_actor_calls_it_equals_verls(agg, global_batch_info):
    g = torch.Generator().manual_seed(7)
    rows, width = 10, 9
    lengths = torch.tensor([9, 4, 1, 7, 9, 3, 6, 8, 2, 5])
    mask = (torch.arange(width) < lengths[:, None]).float()
    old = -torch.rand(rows, width, generator=g) * 2
    batch = {
        "old_log_probs": old,
        "advantages": torch.randn(rows, width, generator=g),
        "response_mask": mask,
        "rollout_is_weights": torch.rand(rows, width, generator=g) + 0.5,
    }
    new = old + 0.3 * torch.randn(rows, width, generator=g)
    for ppo_name, (verl_name, function) in POLICY_LOSSES.items():
        assert core_algos.get_policy_loss_fn(ppo_name) is function
        assert function.__module__.startswith("ppo_fast.compat")
        results = []
        for name in (ppo_name, verl_name):
            log_prob = new.clone().requires_grad_()
            config = _actor_config(name, agg, global_batch_info)
            loss, metrics = _actor_call(config, batch, log_prob)
            loss.backward()
            results.append((loss, metrics, log_prob.grad))
        (loss, metrics, grad), (verl_loss, verl_metrics, verl_grad) = results
        assert_parity(loss, verl_loss.detach(), f"{ppo_name} {agg} loss")
        assert_parity(grad, verl_grad, f"{ppo_name} {agg} gradient")
        assert metrics.keys() == verl_metrics.keys(), ppo_name
        for key, value in verl_metrics.items():
            assert_parity(metrics[key], value, f"{ppo_name} {key}", dtype=torch.float32)
    assert {"vanilla", "cispo"} <= {v for v, _ in POLICY_LOSSES.values()}


def test_bad_input_names_what_to_change(monkeypatch):
    data = _data()
    with pytest.raises(ValueError, match="ppo_fast_nope"):
        _compute_advantage("ppo_fast_nope", data, _algo())
    # verl's own message for a loss mode lists the registered names, ppo_fast's among them.
    with pytest.raises(ValueError, match="ppo_fast_vanilla"):
        core_algos.get_policy_loss_fn("ppo_fast_nope")
    gae = core_algos.get_adv_estimator_fn("ppo_fast_gae")
    kwargs = _verl_branch_kwargs("gae", data, None)
    with pytest.raises(ValueError, match=r"algorithm\.gamma from config.*config=None"):
        gae(**kwargs)
    from omegaconf import OmegaConf

    with pytest.raises(ValueError, match=r"needs algorithm\.lam.*set algorithm\.lam"):
        gae(**{**kwargs, "config": OmegaConf.create({"gamma": 0.9})})
    rpp = core_algos.get_adv_estimator_fn("ppo_fast_reinforce_plus_plus")
    with pytest.raises(ValueError, match="meta tensor"):
        rpp(
            token_level_rewards=torch.empty(2, 3, device="meta"),
            response_mask=torch.ones(2, 3),
            config=_algo(),
        )
    del data.non_tensor_batch["uid"]
    with pytest.raises(ValueError, match=r"ppo_fast_rloo needs index \(data.non_tensor_batch"):
        _compute_advantage("ppo_fast_rloo", data, _algo())


def test_refusals_leave_verl_as_it_was(monkeypatch, caplog):
    verl_plugin.unregister()
    before = (dict(core_algos.ADV_ESTIMATOR_REGISTRY), dict(core_algos.POLICY_LOSS_REGISTRY))
    monkeypatch.setattr(verl, "__version__", "0.9.2")
    with caplog.at_level(logging.WARNING, logger=verl_plugin.__name__):
        assert not verl_plugin.load_plugin()
    assert "reproduces verl 0.9.1, this is verl 0.9.2: install verl==0.9.1" in caplog.text
    assert caplog.records[-1].levelno == logging.WARNING
    monkeypatch.setattr(verl, "__version__", "0.9.1")
    monkeypatch.setenv(verl_plugin.PATCH_ENV, "maybe")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=verl_plugin.__name__):
        assert not verl_plugin.load_plugin()
    assert "PPO_FAST_VERL_PATCH must be 1 or 0" in caplog.text
    monkeypatch.delenv(verl_plugin.PATCH_ENV)

    def foreign(*args, **kwargs):
        raise AssertionError("not called")

    monkeypatch.setitem(core_algos.POLICY_LOSS_REGISTRY, "ppo_fast_vanilla", foreign)
    with pytest.raises(RuntimeError, match="already holds 'ppo_fast_vanilla'"):
        verl_plugin.register()
    assert core_algos.POLICY_LOSS_REGISTRY["ppo_fast_vanilla"] is foreign
    monkeypatch.delitem(core_algos.POLICY_LOSS_REGISTRY, "ppo_fast_vanilla")
    after = (dict(core_algos.ADV_ESTIMATOR_REGISTRY), dict(core_algos.POLICY_LOSS_REGISTRY))
    assert after == before
    monkeypatch.setattr(core_algos, "compute_gae_advantage_return", foreign)
    with pytest.raises(RuntimeError, match="something else patched it"):
        verl_plugin.patch_core_algos()
    assert core_algos.compute_grpo_outcome_advantage.__module__ == core_algos.__name__
    verl_plugin.register()
    verl_plugin.register()  # idempotent


@pytest.mark.slow
def test_a_fresh_import_verl_finds_the_installed_entry_point():
    """The entry point as installed (``pip install -e .``; CI installs it): a fresh process that
    only does ``import verl`` has the names registered and, with PPO_FAST_VERL_PATCH=1, the
    opt-in applied."""
    points = importlib.metadata.entry_points(group="verl.plugins", name="ppo_fast")
    if not points:
        message = "ppo_fast's verl.plugins entry point is not installed: pip install -e ."
        if _CI:
            pytest.fail(message)
        pytest.skip(message)
    script = (
        "import json, sys, verl\n"
        "m = sys.modules['verl.trainer.ppo.core_algos']\n"
        "print(json.dumps([sorted(n for n in m.ADV_ESTIMATOR_REGISTRY if n.startswith('ppo_')),"
        " sorted(n for n in m.POLICY_LOSS_REGISTRY if n.startswith('ppo_')),"
        " m.compute_gae_advantage_return.__module__, m.verl_F.masked_whiten.__module__]))\n"
    )
    env = {**os.environ, verl_plugin.PATCH_ENV: "1", "VERL_USE_EXTERNAL_PLUGINS": "auto"}
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=240
    )
    assert run.returncode == 0, run.stderr[-2000:]
    estimators, losses, gae_module, whiten_module = json.loads(run.stdout.splitlines()[-1])
    assert estimators == sorted(ESTIMATORS)
    assert losses == sorted(POLICY_LOSSES)
    assert gae_module == compat.compute_gae_advantage_return.__module__
    assert whiten_module == compat.masked_whiten.__module__ == "ppo_fast.compat._verl_functional"
    assert "did not load" not in run.stderr
