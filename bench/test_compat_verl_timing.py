"""ppo_fast.compat.verl against verl 0.9.1's own functions, in one pytest-benchmark run.

    pip install --no-deps verl==0.9.1 && pip install -e ".[bench,compat-test]"
    python -m pytest bench/test_compat_verl_timing.py --benchmark-group-by=param:case

Each group times one verl function on one (B, T) batch (``--shapes``), as verl and as
ppo_fast.compat.verl: read the ratio within a group (both are measured in the same process, on the
same tensors). ppo_fast.compat's output is checked against verl's before either is timed. The
losses are timed forward and backward, as a trainer calls them. Masks are right-padded with holes.
Without verl 0.9.1 the module is skipped, and the skip says why.
"""

from __future__ import annotations

import time

import pytest
import torch

from ppo_fast.compat import verl as compat

try:
    import verl.trainer.ppo.core_algos as verl_core
    import verl.utils.torch_functional as verl_F
    from verl.workers.config import ActorConfig
except ImportError as error:  # a benchmark against verl needs verl
    pytest.skip(
        f"the verl timing suite needs verl 0.9.1 ({error}): pip install --no-deps verl==0.9.1 "
        '&& pip install -e ".[bench,compat-test]"',
        allow_module_level=True,
    )

SLOW_CALL_SECONDS = 0.2  # a slower call is timed over three rounds (verl's loop over T)
IMPLEMENTATIONS = {
    "verl": (verl_core, verl_F),
    "ppo_fast.compat": (compat, compat),
}


def _batch(rows: int, width: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(rows * width)

    def normal(scale=1.0):
        return scale * torch.randn(rows, width, generator=generator)

    lengths = torch.randint(width // 4, width + 1, (rows,), generator=generator)
    mask = (torch.arange(width)[None, :] < lengths[:, None]) & (
        torch.rand(rows, width, generator=generator) > 0.05
    )
    old = normal(0.5) - 1.0
    return {
        "mask": mask.long(),
        "rewards": normal(0.1),
        "values": normal(),
        "old_values": normal(),
        "returns": normal(),
        "old_log_prob": old,
        "log_prob": old + normal(0.2),
        "advantages": normal(),
    }


def _config():
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        global_batch_info={},
    )


def _cases(rows, width):
    b = _batch(rows, width)
    config = _config()
    core = {name: impl[0] for name, impl in IMPLEMENTATIONS.items()}
    functional = {name: impl[1] for name, impl in IMPLEMENTATIONS.items()}

    def gae(name):
        return lambda: core[name].compute_gae_advantage_return(
            b["rewards"], b["values"], b["mask"], 1.0, 0.95
        )

    def whiten(name):
        return lambda: functional[name].masked_whiten(b["advantages"], b["mask"])

    def policy(name):
        def run():
            log_prob = b["log_prob"].clone().requires_grad_()
            loss, _ = core[name].compute_policy_loss_vanilla(
                b["old_log_prob"], log_prob, b["advantages"], b["mask"], "token-mean", config
            )
            loss.backward()
            return log_prob.grad

        return run

    def value(name):
        def run():
            vpreds = b["values"].clone().requires_grad_()
            loss, _ = core[name].compute_value_loss(
                vpreds, b["returns"], b["old_values"], b["mask"], 0.2
            )
            loss.backward()
            return vpreds.grad

        return run

    return {
        "gae_advantage_return": gae,
        "masked_whiten": whiten,
        "policy_loss": policy,
        "value_loss": value,
    }


def _tensors(result) -> list[torch.Tensor]:
    return list(result) if isinstance(result, tuple) else [result]


@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
@pytest.mark.parametrize(
    "function", ["gae_advantage_return", "masked_whiten", "policy_loss", "value_loss"]
)
def test_compat_verl(benchmark, implementation, function, compat_shape):
    rows, width = compat_shape
    benchmark.group = f"{function} {rows}x{width}"
    benchmark.extra_info["case"] = benchmark.group
    cases = _cases(rows, width)
    run = cases[function](implementation)
    start = time.perf_counter()
    result = run()  # compiles the kernels before timing, and gives the output checked
    warm_up = time.perf_counter() - start
    expected = result if implementation == "verl" else cases[function]("verl")()
    mask = _batch(rows, width)["mask"].bool()
    for actual, wanted in zip(_tensors(result), _tensors(expected), strict=True):
        # positions outside the mask are not compared (verl does not zero them everywhere)
        torch.testing.assert_close(actual[mask], wanted[mask], rtol=1e-4, atol=1e-5)
    if warm_up > SLOW_CALL_SECONDS:
        benchmark.pedantic(run, rounds=3, iterations=1)
    else:
        benchmark(run)
