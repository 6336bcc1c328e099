"""ppo_fast.torch: tensors in and out, no copies on CPU, bf16/fp16 in float32, and autograd for the
fused losses (gradcheck in float64, and against autograd of the plain formula)."""

from __future__ import annotations

import inspect
import subprocess
import sys

import numpy as np
import pytest
import torch
from peers.cases import batch

import ppo_fast
import ppo_fast.torch as pt
from ppo_fast import _backend, _validate

AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def test_the_torch_inside_is_the_real_torch():
    assert pt.torch is sys.modules["torch"] and hasattr(pt.torch, "autograd")


def test_import_of_compat_is_lazy_too():
    out = subprocess.run(
        [sys.executable, "-c", "import sys, ppo_fast.compat; print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_every_function_equals_its_numpy_twin(dtype):
    b = batch("holes", dtype)
    mask = b.mask.bool()
    np_mask = mask.numpy()
    kl = pt.kl_penalty(b.logprobs, b.ref_logprobs, "k3", 10.0)
    np.testing.assert_array_equal(
        kl.numpy(), ppo_fast.kl_penalty(b.logprobs.numpy(), b.ref_logprobs.numpy(), "k3", 10.0)
    )
    rewards = pt.shape_rewards(
        b.scores,
        b.logprobs,
        b.ref_logprobs,
        kl_coef=torch.tensor(0.1, dtype=torch.float64),
        estimator="k1",
        mask=mask,
    )
    expected = ppo_fast.shape_rewards(
        b.scores.numpy(), b.logprobs.numpy(), b.ref_logprobs.numpy(), kl_coef=0.1, mask=np_mask
    )
    np.testing.assert_array_equal(rewards.numpy(), expected)
    lengths = mask.sum(-1)
    result = pt.gae(
        rewards,
        b.values,
        gamma=torch.full((6,), 0.99, dtype=torch.float64),
        lam=0.9,
        lengths=lengths,
        bootstrap=None,
    )
    expected = ppo_fast.gae(
        rewards.numpy(), b.values.numpy(), gamma=0.99, lam=0.9, lengths=lengths.numpy()
    )
    assert isinstance(result, ppo_fast.GAEResult)
    for actual, reference in zip(result, expected, strict=True):
        assert actual.dtype == dtype
        np.testing.assert_array_equal(actual.numpy(), reference)
    whitened = pt.whiten(result.advantages, mask=mask, unbiased=True)
    np.testing.assert_array_equal(
        whitened.numpy(), ppo_fast.whiten(expected.advantages, mask=np_mask, unbiased=True)
    )
    moments = pt.masked_moments(result.advantages, mask=mask, shift=torch.tensor(0.5))
    assert moments == ppo_fast.masked_moments(expected.advantages, mask=np_mask, shift=0.5)
    packed = pt.gae(
        rewards.reshape(-1), b.values.reshape(-1), cu_seqlens=torch.tensor([0, 50, 102])
    )
    assert packed.advantages.shape == (102,)


def test_contiguous_cpu_tensors_are_not_copied(monkeypatch):
    """The kernels read the tensor's own memory, and the result tensor is the kernel's output."""
    seen = []
    checked = _validate.batch  # the token arrays and rows of every stage's general way

    def spy(*args, **kwargs):
        arrays, rows = checked(*args, **kwargs)
        seen.extend(arrays)
        return arrays, rows

    monkeypatch.setattr(_validate, "batch", spy)
    # the common cases go to their kernels without batch(): what the kernels read is checked.
    kernel_inputs = []
    common = _backend.common

    def spy_common(name, backend, n_threads=0, *types):
        entry = common(name, backend, n_threads, *types)

        def spy_entry(*arguments):
            kernel_inputs.extend(arguments[:2])
            return entry(*arguments)

        return spy_entry

    monkeypatch.setattr(_backend, "common", spy_common)
    written = []
    whiten = pt._numpy_whiten

    def spy_whiten(*args, **kwargs):
        written.append(whiten(*args, **kwargs))
        return written[-1]

    monkeypatch.setattr(pt, "_numpy_whiten", spy_whiten)
    x = torch.randn(4, 32)
    out = pt.whiten(x, mask=torch.ones(4, 32, dtype=torch.bool))  # the common case
    assert np.shares_memory(kernel_inputs[0], x.numpy())
    assert np.shares_memory(written[0], out.numpy())
    kernel_inputs.clear()
    out = pt.whiten(x.reshape(-1), cu_seqlens=torch.tensor([0, 60, 128]))  # packed: fast too
    assert np.shares_memory(kernel_inputs[0], x.numpy())
    assert np.shares_memory(written[1], out.numpy())
    # int16 cu_seqlens: the general way
    out = pt.whiten(x.reshape(-1), cu_seqlens=torch.tensor([0, 60, 128], dtype=torch.int16))
    assert np.shares_memory(seen[0], x.numpy())
    assert np.shares_memory(written[2], out.numpy())
    kernel_inputs.clear()
    rewards, values = torch.randn(4, 32), torch.randn(4, 32)
    pt.gae(rewards, values)
    assert np.shares_memory(kernel_inputs[0], rewards.numpy())
    assert np.shares_memory(kernel_inputs[1], values.numpy())


def _tensor_array_the_long_way(tensor):
    tensor = tensor.detach().resolve_conj().resolve_neg()
    if tensor.dtype in (torch.bfloat16, torch.float16):
        tensor = tensor.float()
    return tensor.numpy()


def test_tensor_arrays_of_every_kind_of_cpu_tensor_are_what_the_long_way_gives():
    """_validate.tensor_array takes .numpy() straight when it can; where it cannot (conjugate
    and negative views, bf16) or must not (float16: computed in float32), the long way."""
    x = torch.randn(3, 4, dtype=torch.float64)
    tensors = [x, x.float(), x > 0, x.to(torch.int64), x.half(), x.bfloat16(), x.T, x[:, ::2]]
    tensors += [x.clone().requires_grad_(), torch.randn(3, dtype=torch.complex64).conj()]
    tensors += [torch._neg_view(x), torch.empty(0, 5)]
    for tensor in tensors:
        array = _validate.tensor_array("x", tensor)
        expected = _tensor_array_the_long_way(tensor)
        assert array.dtype == expected.dtype and array.shape == expected.shape, tensor.dtype
        assert array.tobytes() == expected.tobytes(), tensor.dtype
        if tensor.dtype in (torch.float32, torch.float64, torch.bool, torch.int64):
            viewed = tensor.detach().numpy() if not tensor.is_neg() else None
            assert viewed is None or np.shares_memory(array, viewed) or not array.size


def test_statistics_tensors_hold_the_floats_rounded_as_torch_tensor_rounds_them():
    rng = np.random.default_rng(4)
    values = [*rng.normal(size=50) * 10.0 ** rng.integers(-45, 39, 50)]
    values += [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-46, 3.4028235e38, 3.5e38, 1 / 3]
    # float32's largest, and the floats next to it either side (past it: the way around NumPy)
    largest = float(np.finfo(np.float32).max)
    values += [largest, -largest, np.nextafter(largest, np.inf), np.nextafter(largest, 0.0)]
    for dtype in (torch.float32, torch.float64):
        like = torch.zeros((), dtype=dtype)
        for value, tensor in zip(values, pt._scalars(like, *values), strict=True):
            expected = torch.tensor(value, dtype=dtype)
            assert tensor.dtype == dtype and tensor.shape == ()
            assert tensor.numpy().tobytes() == expected.numpy().tobytes(), value


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_is_computed_in_float32(dtype):
    b = batch("left-padded", torch.float32)
    rewards, values = b.rewards.to(dtype), b.values.to(dtype)
    result = pt.gae(rewards, values, mask=b.mask)
    reference = pt.gae(rewards.float(), values.float(), mask=b.mask)
    assert result.advantages.dtype == dtype and result.returns.dtype == dtype
    assert torch.equal(result.advantages, reference.advantages.to(dtype))
    logp = b.logprobs.to(dtype).requires_grad_()
    wide = b.logprobs.to(dtype).float().requires_grad_()
    loss = pt.clipped_surrogate(logp, b.old_logprobs, b.advantages, mask=b.mask).loss
    loss.backward()
    pt.clipped_surrogate(wide, b.old_logprobs, b.advantages, mask=b.mask).loss.backward()
    assert loss.dtype == dtype and logp.grad.dtype == dtype
    # What float32 gives, rounded (a gradient past float16's range becomes inf, as it must).
    assert torch.equal(logp.grad, wide.grad.to(dtype))


def test_non_contiguous_and_requires_grad_inputs():
    x = torch.randn(32, 4).t().requires_grad_()  # a transposed view
    out = pt.whiten(x)
    assert out.shape == (4, 32) and out.grad_fn is None
    np.testing.assert_allclose(out.numpy(), ppo_fast.whiten(x.detach().numpy()), rtol=1e-6)


def test_numpy_in_ppo_fast_torch_is_a_type_error():
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        pt.gae(np.zeros((1, 2)), np.zeros((1, 2)))
    with pytest.raises(TypeError, match="floating-point"):
        pt.whiten(torch.zeros(2, 2, dtype=torch.int64))


def _plain_surrogate(logp, old, adv, mask, clip_low, clip_high, dual, clamp, weights):
    """The clipped surrogate written out in torch (DESIGN.md section 3), token-mean."""
    log_ratio = logp - old
    if clamp is not None:
        log_ratio = log_ratio.clamp(-clamp, clamp)
    ratio = log_ratio.exp()
    objective = torch.min(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)
    if dual is not None:
        objective = torch.where(adv < 0, torch.max(objective, dual * adv), objective)
    per_token = -objective * (1.0 if weights is None else weights)
    valid = mask.bool()
    return torch.where(valid, per_token, 0.0).sum() / valid.sum()


@pytest.mark.parametrize("kind", ["holes", "left-padded", "length-1-rows"])
@pytest.mark.parametrize(
    "options",
    [
        {"clip_low": 0.2, "clip_high": None, "dual_clip": None, "log_ratio_clamp": None},
        {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": 3.0, "log_ratio_clamp": 20.0},
        {"clip_low": 0.1, "clip_high": 0.3, "dual_clip": 1.5, "log_ratio_clamp": 20.0},
    ],
    ids=["plain", "dual-clip-and-clamp", "tight"],
)
@pytest.mark.parametrize("weighted", [False, True])
def test_policy_loss_gradient_equals_autograd_of_the_formula(kind, options, weighted):
    """float64, extreme log-ratios (±25, ±30) included: the clamp and the dual clip are taken."""
    b = batch(kind, torch.float64, seed=29)
    weights = torch.rand(b.logprobs.shape, dtype=torch.float64) if weighted else None
    fused = b.logprobs.clone().requires_grad_()
    plain = b.logprobs.clone().requires_grad_()
    result = pt.clipped_surrogate(
        fused, b.old_logprobs, b.advantages, mask=b.mask, weights=weights, **options
    )
    clip_high = options["clip_high"] if options["clip_high"] is not None else options["clip_low"]
    reference = _plain_surrogate(
        plain,
        b.old_logprobs,
        b.advantages,
        b.mask,
        options["clip_low"],
        clip_high,
        options["dual_clip"],
        options["log_ratio_clamp"],
        weights,
    )
    result.loss.backward()
    reference.backward()
    torch.testing.assert_close(result.loss, reference.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fused.grad, plain.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("kind", ["holes", "with-empty-row"])
def test_gradcheck_policy_loss(agg, kind):
    b = batch(kind, torch.float64, rows=4, width=7, seed=31)
    # Log-ratios of a few tenths: away from the kinks, where finite differences hold.
    logp = b.old_logprobs + 0.05 * torch.arange(28, dtype=torch.float64).reshape(4, 7) % 0.6
    logp = logp.requires_grad_()

    def loss(x):
        return pt.clipped_surrogate(
            x, b.old_logprobs, b.advantages, mask=b.mask, dual_clip=3.0, agg=agg
        ).loss

    assert torch.autograd.gradcheck(loss, (logp,))


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("clip", [None, 0.2])
def test_gradcheck_value_loss(agg, clip):
    b = batch("holes", torch.float64, rows=4, width=7, seed=37)
    values = b.values.clone().requires_grad_()

    def loss(x):
        return pt.value_loss(x, b.old_values, b.returns, mask=b.mask, clip=clip, agg=agg).loss

    assert torch.autograd.gradcheck(loss, (values,))
    plain = b.values.clone().requires_grad_()
    fused = b.values.clone().requires_grad_()
    lossfn = (plain - b.returns) ** 2
    if clip is not None:
        clipped = torch.max(torch.min(plain, b.old_values + clip), b.old_values - clip)
        lossfn = torch.max(lossfn, (clipped - b.returns) ** 2)
    if agg == "token-mean":
        valid = b.mask.bool()
        reference = 0.5 * torch.where(valid, lossfn, 0.0).sum() / valid.sum()
        reference.backward()
        loss(fused).backward()
        torch.testing.assert_close(fused.grad, plain.grad, rtol=1e-12, atol=1e-12)


def test_backward_scales_by_grad_output_and_stats_are_constants():
    b = batch("holes", torch.float64)
    once = b.logprobs.clone().requires_grad_()
    thrice = b.logprobs.clone().requires_grad_()
    pt.clipped_surrogate(once, b.old_logprobs, b.advantages, mask=b.mask).loss.backward()
    result = pt.clipped_surrogate(thrice, b.old_logprobs, b.advantages, mask=b.mask)
    (3.0 * result.loss).backward()
    torch.testing.assert_close(thrice.grad, 3.0 * once.grad, rtol=1e-15, atol=0.0)
    assert not result.clipfrac.requires_grad and not result.approx_kl.requires_grad
    numpy = ppo_fast.clipped_surrogate(
        b.logprobs.numpy(), b.old_logprobs.numpy(), b.advantages.numpy(), mask=b.mask.numpy()
    )
    assert result.loss.item() == numpy.loss and result.clipfrac.item() == numpy.clipfrac
    np.testing.assert_array_equal(once.grad.numpy(), numpy.grad)


def test_a_gradient_the_kernel_does_not_compute_is_refused():
    b = batch("holes", torch.float64)
    with pytest.raises(ValueError, match="old_logprobs requires grad"):
        pt.clipped_surrogate(b.logprobs, b.old_logprobs.requires_grad_(), b.advantages)
    with pytest.raises(ValueError, match="returns requires grad"):
        pt.value_loss(b.values.requires_grad_(), b.old_values, b.returns.requires_grad_())


def test_float8_and_meta_tensors_are_refused_by_name():
    x = torch.zeros(2, 3)
    with pytest.raises(TypeError, match=r"logprobs has dtype torch.float8_e4m3fn.*logprobs.float"):
        pt.kl_penalty(x.to(torch.float8_e4m3fn), x)
    with pytest.raises(TypeError, match=r"old_logprobs has dtype torch.float8_e5m2"):
        pt.clipped_surrogate(x, x.to(torch.float8_e5m2), x)
    with pytest.raises(ValueError, match="values is a meta tensor"):
        pt.gae(x, torch.zeros(2, 3, device="meta"))
    with pytest.raises(ValueError, match="x is a meta tensor"):
        pt.whiten(torch.zeros(2, 3, device="meta"))


@pytest.mark.parametrize(
    ("call", "pattern"),
    [
        (
            lambda x: pt.kl_penalty(x, x.long()),
            r"ref_logprobs must be float32 or float64.*ref_logprobs.float\(\)",
        ),
        (lambda x: pt.gae(x, x.double()), r"values.*values.to\(torch.float32\)"),
        (lambda x: pt.gae(x, x, lengths=torch.ones(2)), r"lengths.long\(\)"),
        (lambda x: pt.kl_penalty(x.long(), x), r"logprobs.to\(torch.float32\)"),
    ],
)
def test_dtype_hints_speak_torch(call, pattern):
    with pytest.raises(TypeError, match=pattern) as caught:
        call(torch.zeros(2, 3))
    assert "astype" not in str(caught.value) and "np." not in str(caught.value)


TWINS = ["kl_penalty", "shape_rewards", "gae", "masked_moments", "whiten"]
TWINS += ["clipped_surrogate", "value_loss", "reinforce_loss", "cispo_loss", "sapo_loss"]


@pytest.mark.parametrize("name", TWINS)
def test_each_function_takes_its_numpy_twins_arguments(name):
    """The module's promise: the arguments of the NumPy twin, in order, keyword-only where the
    twin's are, with the twin's defaults."""

    def parameters(function):
        return [
            (p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()
        ]

    # Preallocated outputs are NumPy arrays: the tensor API does not take them (yet).
    numpy_only = {"out", "grad_out"}
    twin = [p for p in parameters(getattr(ppo_fast, name)) if p[0] not in numpy_only]
    assert parameters(getattr(pt, name)) == twin
