"""verl 0.9.1's own ``ray_trainer.compute_advantage`` with verl's estimators and with ppo_fast's
plugin (the README's "Use it in verl" figures), in one pytest-benchmark run.

    pip install --no-deps verl==0.9.1 && pip install -e ".[bench,compat-test]"
    python -m pytest bench/test_verl_plugin_timing.py --shapes 1024x4096 \\
        --benchmark-group-by=group

Each group times the trainer's call on one float32 batch (right-padded, lengths uniform in
[T/8, T], groups of 8 uids): GAE as verl runs it and under ``PPO_FAST_VERL_PATCH``'s patch
(``verl_plugin.patch_core_algos``), REINFORCE++ as ``reinforce_plus_plus`` and as
``ppo_fast_reinforce_plus_plus``. The plugin's advantages and returns are checked against
verl's before either is timed. Read the ratio within a group.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

try:
    from verl import DataProto
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import ray_trainer
except ImportError as error:  # a benchmark against verl needs verl
    pytest.skip(
        f"the verl plugin timing needs verl 0.9.1 ({error}): pip install --no-deps verl==0.9.1 "
        '&& pip install -e ".[bench,compat-test]"',
        allow_module_level=True,
    )

from ppo_fast.compat import verl_plugin

# (case, verl's estimator, the plugin's, whether the plugin is the opt-in patch)
CASES = {
    "gae": ("gae", "gae", True),
    "reinforce_plus_plus": ("reinforce_plus_plus", "ppo_fast_reinforce_plus_plus", False),
}


def _data(rows: int, width: int) -> DataProto:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(max(1, width // 8), width + 1, (rows,), generator=g)
    mask = (torch.arange(width) < lengths[:, None]).float()
    rewards = torch.zeros(rows, width)
    rewards[torch.arange(rows), lengths - 1] = torch.randn(rows, generator=g)
    rewards += 0.01 * torch.randn(rows, width, generator=g) * mask
    tensors = {
        "token_level_rewards": rewards,
        "response_mask": mask,
        "values": torch.randn(rows, width, generator=g),
    }
    uids = np.array([f"p{i // 8}" for i in range(rows)], dtype=object)
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uids})


def _call(data: DataProto, estimator: str):
    config = AlgoConfig(gamma=0.99, lam=0.95)
    batch = copy.copy(data)
    batch.batch = data.batch.clone()
    out = ray_trainer.compute_advantage(
        batch, adv_estimator=estimator, gamma=config.gamma, lam=config.lam, config=config
    )
    return out.batch["advantages"], out.batch["returns"]


@pytest.fixture(scope="module", autouse=True)
def registered():
    verl_plugin.register()
    yield
    verl_plugin.unpatch_core_algos()
    verl_plugin.unregister()


@pytest.mark.parametrize("implementation", ["verl", "ppo_fast plugin"])
@pytest.mark.parametrize("estimator_case", list(CASES))
def test_verl_compute_advantage(benchmark, implementation, estimator_case, compat_shape):
    rows, width = compat_shape
    benchmark.group = f"compute_advantage {estimator_case} {rows}x{width}"
    benchmark.extra_info["case"] = benchmark.group
    data = _data(rows, width)
    own, plugin, patch = CASES[estimator_case]
    verl_plugin.unpatch_core_algos()
    expected = _call(data, own)
    if patch:
        verl_plugin.patch_core_algos()
    estimator = own if implementation == "verl" else plugin
    if implementation == "verl":
        verl_plugin.unpatch_core_algos()
    for actual, wanted in zip(_call(data, estimator), expected, strict=True):
        torch.testing.assert_close(actual, wanted, rtol=1e-4, atol=1e-5)
    benchmark.pedantic(lambda: _call(data, estimator), rounds=5, iterations=1)
