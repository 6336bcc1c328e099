"""The compat modules where trainers call them on a GPU: verl's actor computes its policy and
value losses there, TRL's GRPO and RLOO trainers their advantages, OpenRLHF's experience maker
its returns. Each call on CUDA tensors returns its tensors on the device, with the CPU call's
dtypes and shapes, and equals the same call on CPU tensors (which the parity tests hold to the
peers): bit for bit where the call computes on the host (the estimators, GAE, the returns, the
masked statistics: one round trip), within a few ulps where it computes in torch on the device
(the losses: the device's exp and log round differently from the kernels'), the gradient with
respect to the log-probabilities or values included. The inputs are left as they were.

The ``cuda`` cases need a CUDA device and are skipped, with that reason, where torch sees none
(CI has none): run ``python -m pytest tests/test_compat_cuda.py`` on a machine with a GPU. No
GPU has run them yet (0.8.28: the session that wrote them got no machine). The
``cpu-device-path`` cases run everywhere: the same losses on CPU tensors with the device path
forced (the torch formulas a CUDA tensor takes) and every kernel entry made to fail, against
the kernels' call."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import peers  # noqa: E402
from peers.cases import batch, group_batch  # noqa: E402
from test_compat_estimators_openrlhf import ESTIMATORS, _args, _copy_maker, experiences  # noqa: E402

import ppo_fast.torch as pt  # noqa: E402
from ppo_fast import _backend  # noqa: E402
from ppo_fast.compat import openrlhf, trl  # noqa: E402
from ppo_fast.compat import verl as verl_compat  # noqa: E402

CUDA = torch.cuda.is_available()
ON_CUDA = pytest.param(
    "cuda",
    marks=pytest.mark.skipif(
        not CUDA, reason="needs a CUDA device (torch.cuda.is_available() is False here)"
    ),
)
# The second call: on a CUDA device, or on CPU tensors with the device path forced (what a CUDA
# tensor's loss computes, in torch, without the device: CI runs this one).
TARGETS = pytest.mark.parametrize("target", [ON_CUDA, "cpu-device-path"])
PEER = peers.verl()  # its configs: verl's own where it imports, else the copy's stand-ins
# (rtol, atol on the scale of the largest magnitude) for the calls computed in torch on the
# device; the host calls are held to equality.
TOL = {torch.float32: (1e-5, 1e-6), torch.float64: (1e-12, 1e-14)}
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KINDS = ("right-padded", "holes", "with-empty-row")


@dataclasses.dataclass
class Call:
    """``function(*args, **kwargs)`` of a compat module; ``grad`` names the argument (its
    position) to differentiate the result's first tensor by, ``host`` says the call computes on
    the host (equal bits on both devices)."""

    function: Callable[..., Any]
    args: tuple
    kwargs: dict
    host: bool
    grad: int | None = None


def _policy_config(name: str):
    fields = {
        "clip_cov": {"clip_cov_ratio": 0.3, "clip_cov_lb": 0.05, "clip_cov_ub": 1.0},
        "kl_cov": {"kl_cov_ratio": 0.1, "ppo_kl_coef": 0.1},
        "sapo": {"tau_pos": 2.0, "tau_neg": 0.5},
        "vanilla": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0},
    }.get(name, {})
    if name in ("clip_cov", "kl_cov") and PEER.label == "verl-0.9.1-real":
        # verl's own ActorConfig holds them in its PolicyLossConfig (the copy's stand-in flat)
        from verl.workers.config.actor import PolicyLossConfig

        fields = {"policy_loss": PolicyLossConfig(**fields)}
    return PEER.make_config(**fields, global_batch_info={})


VERL_LOSSES = (
    "vanilla", "gpg", "cispo", "sapo", "gspo", "geo_mean", "dppo_tv", "dppo_kl", "clip_cov",
    "kl_cov", "reinforce",
)  # fmt: skip


def verl_calls(kind: str, dtype) -> dict[str, Call]:
    b = batch(kind, dtype, seed=3)
    g = group_batch("uneven", kind, dtype, seed=5)
    calls = {
        "gae": Call(
            verl_compat.compute_gae_advantage_return,
            (b.rewards, b.values, b.mask, 0.99, 0.95), {}, host=True,
        ),
        "reinforce_plus_plus": Call(
            verl_compat.compute_reinforce_plus_plus_outcome_advantage,
            (b.rewards, b.mask, PEER.make_algo_config(gamma=0.99)), {}, host=True,
        ),
        "remax": Call(
            verl_compat.compute_remax_outcome_advantage,
            (g.rewards, g.baselines, g.mask), {}, host=True,
        ),
        "optimal_token_baseline": Call(
            verl_compat.compute_optimal_token_baseline_advantage,
            (g.rewards, g.mask, g.index, g.old_log_probs, g.sum_pi_squared, g.is_weights), {},
            host=True,
        ),
        "masked_whiten": Call(verl_compat.masked_whiten, (b.advantages, b.mask), {}, host=True),
        "masked_mean": Call(verl_compat.masked_mean, (b.advantages, b.mask), {}, host=True),
        "masked_var": Call(verl_compat.masked_var, (b.advantages, b.mask), {}, host=True),
        "value_loss": Call(
            verl_compat.compute_value_loss,
            (b.values, b.returns, b.old_values, b.mask, 0.2, "token-mean"), {}, host=False,
            grad=0,
        ),
    }  # fmt: skip
    for name in (
        "grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "opo", "gpg",
        "reinforce_plus_plus_baseline",
    ):  # fmt: skip
        calls[name] = Call(
            getattr(verl_compat, f"compute_{name}_outcome_advantage"),
            (g.rewards, g.mask, g.index), {}, host=True,
        )  # fmt: skip
    for name in VERL_LOSSES:
        for mode in AGG_MODES:
            calls[f"policy_loss_{name}-{mode}"] = Call(
                getattr(verl_compat, f"compute_policy_loss_{name}"),
                (b.old_logprobs, b.logprobs, b.advantages, b.mask, mode, _policy_config(name)),
                {}, host=False, grad=1,
            )  # fmt: skip
    return calls


def trl_calls(dtype) -> dict[str, Call]:
    rng = np.random.default_rng(7)
    rows, width = 12, 9
    per_func = torch.tensor(rng.choice([0.0, 0.25, 0.5, 1.0], (rows, 3)), dtype=dtype)
    per_func[torch.tensor(rng.random(rows) < 0.3), 0] = float("nan")
    b = batch("right-padded", dtype, rows=rows, width=width, seed=11)
    lengths = b.mask.sum(-1) - 1  # TRL's sequence_lengths: the last valid position
    completion = torch.tensor(
        np.arange(width)[None, :] < rng.integers(1, width + 1, rows)[:, None], dtype=torch.int64
    )
    row_advantages = b.advantages[:, 0].contiguous()
    return {
        "grpo_advantages": Call(trl.grpo_advantages, (per_func, 4, [1.0, 0.5, 1.0]), {}, True),
        "grpo_advantages-batch": Call(
            trl.grpo_advantages, (per_func, 3), {"scale_rewards": "batch"}, True
        ),
        "rloo_advantages": Call(
            trl.rloo_advantages, (per_func, 4, [1.0, 0.5, 1.0]),
            {"beta": 0.05, "old_per_token_logps": b.old_logprobs,
             "ref_per_token_logps": b.ref_logprobs, "completion_mask": completion},
            True,
        ),
        "rollout_advantages": Call(
            trl.rollout_advantages,
            (b.logprobs, b.ref_logprobs, b.values, b.scores, lengths),
            {"kl_estimator": "k3", "gamma": 0.99, "whiten_rewards": True}, True,
        ),
        "masked_whiten": Call(trl.masked_whiten, (b.advantages, b.mask), {}, True),
        **{
            f"grpo_loss-{loss_type}-{level}": Call(
                trl.grpo_loss, (b.logprobs, b.old_logprobs, row_advantages, b.mask),
                {"loss_type": loss_type, "epsilon": 0.2, "epsilon_high": 0.28,
                 "importance_sampling_level": level, "max_completion_length": width,
                 "num_items_in_batch": float(b.mask.sum())},
                False, grad=0,
            )
            for loss_type in ("grpo", "dapo", "dr_grpo", "bnpo")
            for level in ("token", "sequence")
        },
    }  # fmt: skip


def openrlhf_calls(kind: str, dtype) -> dict[str, Call]:
    b = batch(kind, dtype, seed=13)
    action_mask = b.mask.bool()
    rollout = b.old_logprobs + 0.1
    return {
        "get_advantages_and_returns": Call(
            openrlhf.get_advantages_and_returns, (b.values, b.rewards, action_mask, 0.99, 0.95),
            {}, True,
        ),
        "get_cumulative_returns": Call(
            openrlhf.get_cumulative_returns, (b.rewards, action_mask, 0.99), {}, True
        ),
        "masked_mean": Call(openrlhf.masked_mean, (b.advantages, action_mask), {}, True),
        "policy_loss": Call(
            openrlhf.PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=3.0),
            (b.logprobs, b.old_logprobs, b.advantages, action_mask, rollout), {}, False, grad=0,
        ),
        "value_loss": Call(
            openrlhf.ValueLoss(0.2), (b.values, b.old_values, b.returns, action_mask), {},
            False, grad=0,
        ),
    }  # fmt: skip


def _on(value: Any, device: str) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_on(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _on(v, device) for k, v in value.items()}
    return value


def _leaves(value: Any, path: str = "result"):
    """(path, leaf) for each tensor, number or None in a result of tuples, named tuples,
    dataclasses and dicts."""
    if hasattr(value, "_fields"):
        for name in value._fields:
            yield from _leaves(getattr(value, name), f"{path}.{name}")
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from _leaves(getattr(value, field.name), f"{path}.{field.name}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _leaves(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key in sorted(value):
            yield from _leaves(value[key], f"{path}[{key!r}]")
    else:
        yield path, value


def _run(call: Call, device: str):
    args = list(_on(call.args, device))
    kwargs = _on(call.kwargs, device)
    if call.grad is not None:
        args[call.grad] = args[call.grad].clone().requires_grad_()
    before = [a.clone() for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    result = call.function(*args, **kwargs)
    after = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    for old, new in zip(before, after, strict=True):
        assert torch.equal(old.detach().nan_to_num(), new.detach().nan_to_num()), "input changed"
    grad = None
    if call.grad is not None:
        first = next(leaf for _, leaf in _leaves(result) if isinstance(leaf, torch.Tensor))
        first.backward()
        grad = args[call.grad].grad
    return result, grad


def _assert_same(actual: Any, expected: Any, host: bool, device: str, what: str) -> None:
    """``actual`` (the call's on ``device``) against ``expected`` (the CPU call's), leaf by
    leaf."""
    pairs = list(zip(_leaves(actual), _leaves(expected), strict=True))
    assert pairs, what
    for (path, a), (_, e) in pairs:
        where = f"{what}: {path}"
        if isinstance(e, torch.Tensor):
            assert isinstance(a, torch.Tensor), where
            assert a.device.type == device, f"{where} is on {a.device}"
            assert (a.dtype, a.shape) == (e.dtype, e.shape), where
            a = a.detach().cpu()
            e = e.detach()
            if host or not e.is_floating_point():
                torch.testing.assert_close(a, e, rtol=0, atol=0, equal_nan=True, msg=where)
            else:
                rtol, atol = TOL[e.dtype]
                finite = e[torch.isfinite(e)]
                scale = float(finite.abs().max()) if finite.numel() else 1.0
                torch.testing.assert_close(
                    a, e, rtol=rtol, atol=atol * max(scale, 1.0), equal_nan=True, msg=where
                )
        elif isinstance(e, float) and not host:
            assert a == pytest.approx(e, rel=TOL[torch.float32][0], nan_ok=True), where
        else:
            assert type(a) is type(e) and (a == e or (a != a and e != e)), where


def _no_kernel(*args, **kwargs):
    raise AssertionError("a kernel was called on the device path")


def _check(call: Call, target: str, what: str, monkeypatch) -> None:
    """The call on CPU tensors (the kernels), then on the target: on the CUDA device, or the
    device path on CPU tensors."""
    expected, expected_grad = _run(call, "cpu")
    device = "cuda"
    if target == "cpu-device-path":  # and no kernel runs: a device tensor never reaches one
        monkeypatch.setattr(pt, "_DEVICE_PATH_ON_CPU", True)
        for entry in ("resolve", "table_kernel", "run", "common"):
            monkeypatch.setattr(_backend, entry, _no_kernel)
        device = "cpu"
    actual, grad = _run(call, device)
    _assert_same(actual, expected, call.host, device, what)
    if call.grad is not None:
        _assert_same(grad, expected_grad, False, device, f"{what}: gradient")


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)


def _names(calls: dict[str, Call], target: str) -> list[str]:
    return sorted(name for name, call in calls.items() if target == "cuda" or not call.host)


def _cases(calls: dict[str, Call]) -> list:
    """(target, name) pairs: every call on CUDA, the device-path calls on CPU."""
    return [
        pytest.param(*pair, marks=ON_CUDA.marks if pair[0] == "cuda" else ())
        for target in ("cuda", "cpu-device-path")
        for pair in ((target, name) for name in _names(calls, target))
    ]


@DTYPES
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("target", "name"), _cases(verl_calls("holes", torch.float32)))
def test_verl_on_the_device_equals_the_cpu_call(target, name, kind, dtype, monkeypatch):
    _check(verl_calls(kind, dtype)[name], target, f"verl {name} {kind} {dtype}", monkeypatch)


@DTYPES
@pytest.mark.parametrize(("target", "name"), _cases(trl_calls(torch.float32)))
def test_trl_on_the_device_equals_the_cpu_call(target, name, dtype, monkeypatch):
    _check(trl_calls(dtype)[name], target, f"trl {name} {dtype}", monkeypatch)


@DTYPES
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("target", "name"), _cases(openrlhf_calls("holes", torch.float32)))
def test_openrlhf_on_the_device_equals_the_cpu_call(target, name, kind, dtype, monkeypatch):
    what = f"openrlhf {name} {kind} {dtype}"
    _check(openrlhf_calls(kind, dtype)[name], target, what, monkeypatch)


@ON_CUDA.marks[0]
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_openrlhf_experience_maker_on_the_device(estimator):
    """OpenRLHF's experience maker with the compat ``compute_advantages_and_returns`` (what the
    hook installs): the experiences' advantages, returns and statistics stay on the device,
    equal to the CPU call's."""
    results = {}
    for device in ("cpu", "cuda"):
        given = []
        for experience in experiences(torch.float64, seed=3):
            for name, value in vars(experience).items():
                setattr(experience, name, _on(value, device))
            given.append(experience)
        maker = _copy_maker(_args(estimator, 4, 0.95, False, 0.5, None))
        done = openrlhf.compute_advantages_and_returns(maker, given)
        results[device] = [(e.advantages, e.returns, e.info) for e in done]
    what = f"openrlhf experience maker {estimator}"
    _assert_same(results["cuda"], results["cpu"], True, "cuda", what)
