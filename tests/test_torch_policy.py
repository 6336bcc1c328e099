"""ppo_fast.torch's policy-loss family (reinforce_loss, cispo_loss, sapo_loss): the NumPy twin's
numbers on CPU, autograd of the formula written out in torch, finite differences, and the torch
path that tensors on another device take (forced here on CPU) equal to the kernel path.

Run with the default backend (``PPO_FAST_BACKEND`` picks it); both paths and the NumPy twin run
on that one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import ppo_fast
import ppo_fast.torch as pt
from ppo_fast import _validate

AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
LAYOUTS = ("mask-holes", "lengths", "packed")
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
# (loss, options): GPG and DRO, CISPO as verl (clamped) and as TRL (an upper bound on the ratio
# alone, no clamp), SAPO as verl and with other temperatures and no clamp.
CASES = [
    ("reinforce_loss", {"beta": 0.0}),
    ("reinforce_loss", {"beta": 0.05}),
    ("cispo_loss", {"clip_low": 0.2, "clip_high": 0.28, "log_ratio_clamp": 20.0}),
    ("cispo_loss", {"clip_low": 1.0, "clip_high": 4.0}),
    ("sapo_loss", {"tau_pos": 1.0, "tau_neg": 1.05, "log_ratio_clamp": 20.0}),
    ("sapo_loss", {"tau_pos": 2.0, "tau_neg": 0.5}),
]
CASE_IDS = [f"{name.removesuffix('_loss')}-{i % 2}" for i, (name, _) in enumerate(CASES)]
RTOL = {torch.float32: 2e-5, torch.float64: 1e-12}


@pytest.fixture
def device_path(monkeypatch):
    """Run the torch path (that of tensors on another device) on CPU tensors."""
    monkeypatch.setattr(pt, "_DEVICE_PATH_ON_CPU", True)


@dataclass
class Case:
    """One batch, kept padded (B, T) for the reference, and its layout for the functions."""

    logp: torch.Tensor
    old: torch.Tensor
    adv: torch.Tensor
    weights: torch.Tensor
    valid: torch.Tensor  # bool (B, T)
    layout: dict
    packed: bool

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (B, T) as the functions take it: itself, or its valid tokens packed."""
        return x[self.valid] if self.packed else x

    def arguments(self, weighted: bool) -> dict:
        weights = self.tokens(self.weights) if weighted else None
        return {**self.layout, "weights": weights}


def make_case(layout: str, dtype: torch.dtype, rows: int = 5, width: int = 9, seed: int = 0):
    """Rows of several lengths, one empty, holes in the mask layout; log-ratios mostly of a few
    tenths, some extreme (+-25, +-30: beyond verl's clamp at 20)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, width + 1, rows)
    lengths[2] = 0
    valid = np.arange(width)[None, :] < lengths[:, None]
    if layout == "mask-holes":
        valid &= rng.random((rows, width)) > 0.25
        valid[0, 0] = True
    old = rng.uniform(-3.0, -0.1, (rows, width))
    log_ratio = rng.normal(0.0, 0.4, (rows, width))
    extreme = rng.random((rows, width)) < 0.15
    log_ratio[extreme] = rng.choice([-30.0, -2.0, 1.5, 25.0], int(extreme.sum()))

    def tensor(array):
        return torch.tensor(array, dtype=dtype)

    valid_t = torch.tensor(valid)
    if layout == "mask-holes":
        arguments = {"mask": valid_t.long()}
    elif layout == "lengths":
        arguments = {"lengths": torch.tensor(lengths)}
    else:
        arguments = {"cu_seqlens": torch.tensor(np.concatenate([[0], np.cumsum(lengths)]))}
    return Case(
        logp=tensor(old + log_ratio),
        old=tensor(old),
        adv=tensor(rng.normal(0.0, 1.0, (rows, width))),
        weights=tensor(rng.uniform(0.2, 2.0, (rows, width))),
        valid=valid_t,
        layout=arguments,
        packed=layout == "packed",
    )


def reference_terms(name, logp, old, adv, options):
    """The per-token loss written out in torch, differentiable by autograd."""
    clamp = options.get("log_ratio_clamp")
    log_ratio = logp - old if clamp is None else (logp - old).clamp(-clamp, clamp)
    if name == "reinforce_loss":
        return -(adv * logp - options["beta"] / 2 * (logp - old) ** 2)
    if name == "cispo_loss":
        high = options["clip_high"] if options["clip_high"] is not None else options["clip_low"]
        coefficient = log_ratio.exp().clamp(1 - options["clip_low"], 1 + high).detach()
        return -coefficient * adv * logp
    # (torch.where of two Python floats would round the temperatures to float32)
    tau_pos, tau_neg = (torch.tensor(options[k], dtype=adv.dtype) for k in ("tau_pos", "tau_neg"))
    tau = torch.where(adv > 0, tau_pos, tau_neg)
    return -torch.sigmoid(tau * (log_ratio.exp() - 1)) * 4 / tau * adv


def aggregate(per_token, valid, agg):
    per_token = torch.where(valid, per_token, 0.0)
    counts = valid.sum(-1)
    seqs = (counts > 0).sum()
    if agg == "token-mean":
        return per_token.sum() / valid.sum()
    if agg == "seq-mean-token-mean":
        rows = counts > 0
        return (per_token.sum(-1)[rows] / counts[rows]).sum() / seqs
    if agg == "seq-mean-token-sum":
        return per_token.sum() / seqs
    return per_token.sum() / valid.shape[-1]


def normaliser(case: Case, agg: str) -> dict:
    # Packed rows have no padded width: seq-mean-token-sum-norm takes it as loss_scale.
    if case.packed and agg == "seq-mean-token-sum-norm":
        return {"loss_scale": case.valid.shape[-1]}
    return {}


def run(case: Case, name: str, options: dict, agg: str, weighted: bool):
    """The torch function's result and the gradient its backward gives."""
    logp = case.tokens(case.logp).clone().requires_grad_()
    result = getattr(pt, name)(
        logp,
        case.tokens(case.old),
        case.tokens(case.adv),
        agg=agg,
        **normaliser(case, agg),
        **options,
        **case.arguments(weighted),
    )
    result.loss.backward()
    return result, logp.grad


def assert_close(actual, expected, dtype, what, scale=None):
    rtol = RTOL[dtype]
    expected = torch.as_tensor(expected, dtype=torch.float64)
    actual = torch.as_tensor(actual, dtype=torch.float64)
    if scale is None:
        finite = expected[torch.isfinite(expected)].abs()
        scale = max(1.0, float(finite.max())) if finite.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * scale, msg=what)


@pytest.mark.parametrize(("name", "options"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@DTYPES
def test_kernel_path_equals_numpy_autograd_of_the_formula_and_the_torch_path(
    name, options, layout, dtype, monkeypatch
):
    case = make_case(layout, dtype)
    for agg in AGGS:
        for weighted in (False, True):
            what = f"{name} {options} {layout} {agg} weighted={weighted}"
            result, grad = run(case, name, options, agg, weighted)
            assert result.loss.dtype == dtype and grad.dtype == dtype
            assert not any(s.requires_grad for s in result[1:])

            # (1) The NumPy twin on the same kernels: the same bits.
            arguments = case.arguments(weighted)
            numpy = getattr(ppo_fast, name)(
                case.tokens(case.logp).numpy(),
                case.tokens(case.old).numpy(),
                case.tokens(case.adv).numpy(),
                agg=agg,
                **normaliser(case, agg),
                **options,
                **{k: None if v is None else v.numpy() for k, v in arguments.items()},
            )
            np.testing.assert_array_equal(grad.numpy(), numpy.grad, err_msg=what)
            expected = (numpy.loss, numpy.clipfrac, numpy.clipfrac_lower, numpy.approx_kl)
            for actual, value in zip(result, expected, strict=True):
                assert torch.equal(actual, torch.tensor(value, dtype=dtype)) or (
                    math.isnan(value) and actual.isnan()
                ), what

            # (2) Autograd of the formula written out, on the padded batch.
            plain = case.logp.clone().requires_grad_()
            terms = reference_terms(name, plain, case.old, case.adv, options)
            if weighted:
                terms = terms * case.weights
            reference = aggregate(terms, case.valid, agg)
            reference.backward()
            magnitude = float(aggregate(terms.detach().abs(), case.valid, agg))
            assert_close(result.loss.detach(), reference.detach(), dtype, what, magnitude)
            assert_close(grad, case.tokens(plain.grad), dtype, f"d {what}")

            # (4) The torch path, that of tensors on another device, forced on CPU.
            monkeypatch.setattr(pt, "_DEVICE_PATH_ON_CPU", True)
            forced, forced_grad = run(case, name, options, agg, weighted)
            monkeypatch.setattr(pt, "_DEVICE_PATH_ON_CPU", False)
            assert forced.loss.dtype == dtype and forced_grad.dtype == dtype
            assert_close(forced.loss.detach(), result.loss.detach(), dtype, f"torch {what}")
            assert_close(forced_grad, grad, dtype, f"torch d {what}")
            for stat, kernel_stat in zip(forced[1:], result[1:], strict=True):
                assert_close(stat, kernel_stat, dtype, f"torch stats {what}")


@pytest.mark.parametrize(("name", "options"), CASES[1::2] + CASES[2:3], ids=str)
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("forced", [False, True], ids=["kernels", "torch-path"])
def test_finite_differences(name, options, agg, forced, monkeypatch):
    """Central differences of the loss at a few tokens, float64. CISPO's clipped ratio is a
    stop-gradient constant: there ``old_logprobs`` moves with ``logprobs`` (the ratio, so the
    constant, stays put) and the difference is the derivative CISPO defines."""
    monkeypatch.setattr(pt, "_DEVICE_PATH_ON_CPU", forced)
    case = make_case("mask-holes", torch.float64, seed=3)
    logp, old = case.logp.clone().requires_grad_(), case.old.clone()
    function = getattr(pt, name)

    def loss(x, o):
        arguments = {**options, **case.arguments(True), "agg": agg}
        return function(x, o, case.adv, **arguments).loss

    loss(logp, old).backward()
    moves_old = name == "cispo_loss"
    step = 1e-6
    # Valid tokens of moderate log-ratio, and a masked one (whose gradient is 0).
    moderate = case.valid & ((case.logp - case.old).abs() < 1.0)
    tokens = [tuple(i) for i in moderate.nonzero()[:4].tolist()]
    tokens.append(tuple((~case.valid).nonzero()[0].tolist()))
    for token in tokens:
        shift = torch.zeros_like(case.logp)
        shift[token] = step
        up = loss(case.logp + shift, old + shift if moves_old else old)
        down = loss(case.logp - shift, old - shift if moves_old else old)
        difference = float(up - down) / (2 * step)
        np.testing.assert_allclose(
            float(logp.grad[token]), difference, rtol=1e-6, atol=1e-9, err_msg=f"{token}"
        )


@pytest.mark.parametrize("name", ["reinforce_loss", "cispo_loss", "sapo_loss"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("forced", [False, True], ids=["kernels", "torch-path"])
def test_inputs_are_never_modified(name, layout, forced, monkeypatch):
    monkeypatch.setattr(pt, "_DEVICE_PATH_ON_CPU", forced)
    case = make_case(layout, torch.float32, seed=5)
    inputs = [case.tokens(x) for x in (case.logp, case.old, case.adv)]
    arguments = case.arguments(True)
    before = [x.clone() for x in (*inputs, *arguments.values())]
    logp = inputs[0].requires_grad_()
    (2.0 * getattr(pt, name)(logp, *inputs[1:], **arguments).loss).backward()
    for after, original in zip((*inputs, *arguments.values()), before, strict=True):
        assert torch.equal(after.detach(), original)


@pytest.mark.parametrize("name", ["reinforce_loss", "cispo_loss", "sapo_loss"])
@pytest.mark.parametrize("forced", [False, True], ids=["kernels", "torch-path"])
def test_a_gradient_the_kernel_does_not_compute_is_refused(name, forced, monkeypatch):
    monkeypatch.setattr(pt, "_DEVICE_PATH_ON_CPU", forced)
    case = make_case("lengths", torch.float64)
    function = getattr(pt, name)
    for argument in ("old_logprobs", "advantages", "weights"):
        values = {"old_logprobs": case.old, "advantages": case.adv, "weights": case.weights}
        values[argument] = values[argument].clone().requires_grad_()
        with pytest.raises(ValueError, match=f"{argument} requires grad.*{argument}.detach"):
            function(case.logp.clone().requires_grad_(), **values)


@pytest.mark.parametrize("name", ["reinforce_loss", "cispo_loss", "sapo_loss"])
@pytest.mark.parametrize("forced", [False, True], ids=["kernels", "torch-path"])
def test_backward_scales_by_grad_output_and_the_statistics_are_constants(name, forced, monkeypatch):
    monkeypatch.setattr(pt, "_DEVICE_PATH_ON_CPU", forced)
    case = make_case("mask-holes", torch.float64, seed=7)
    once, thrice = (case.logp.clone().requires_grad_() for _ in range(2))
    function = getattr(pt, name)
    function(once, case.old, case.adv, **case.layout).loss.backward()
    result = function(thrice, case.old, case.adv, **case.layout)
    (3.0 * result.loss).backward()
    torch.testing.assert_close(thrice.grad, 3.0 * once.grad, rtol=1e-15, atol=0.0)
    assert result.loss.grad_fn is not None
    assert not result.approx_kl.requires_grad and not result.clipfrac.requires_grad


@pytest.mark.parametrize("name", ["reinforce_loss", "cispo_loss", "sapo_loss"])
def test_the_torch_path_reads_no_tensor_through_the_host(name, monkeypatch):
    """The torch path never hands a tensor to NumPy (what would copy a device's memory)."""
    case = make_case("packed", torch.float32, seed=9)

    def refuse(name, tensor):
        raise AssertionError(f"{name} was read through the host")

    monkeypatch.setattr(_validate, "tensor_array", refuse)
    monkeypatch.setattr(pt, "_DEVICE_PATH_ON_CPU", True)
    tokens = [case.tokens(x) for x in (case.logp, case.old, case.adv)]
    getattr(pt, name)(*tokens, **case.arguments(True)).loss.item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_on_the_torch_path_is_the_kernel_paths(dtype, monkeypatch):
    case = make_case("mask-holes", torch.float32, seed=11)
    results = []
    for forced in (False, True):
        monkeypatch.setattr(pt, "_DEVICE_PATH_ON_CPU", forced)
        logp = case.logp.to(dtype).requires_grad_()
        result = pt.sapo_loss(logp, case.old, case.adv, log_ratio_clamp=20.0, **case.layout)
        result.loss.backward()
        assert result.loss.dtype == dtype and logp.grad.dtype == dtype
        results.append((result, logp.grad))
    (kernel, kernel_grad), (forced, forced_grad) = results
    torch.testing.assert_close(forced.loss, kernel.loss)
    torch.testing.assert_close(forced_grad, kernel_grad)


@pytest.mark.parametrize("name", ["reinforce_loss", "cispo_loss", "sapo_loss"])
@pytest.mark.parametrize("forced", [False, True], ids=["kernels", "torch-path"])
def test_no_valid_token(name, forced, monkeypatch):
    monkeypatch.setattr(pt, "_DEVICE_PATH_ON_CPU", forced)
    logp = torch.randn(3, 4, dtype=torch.float64).requires_grad_()
    for agg in AGGS:
        result = getattr(pt, name)(
            logp, logp.detach(), logp.detach(), mask=torch.zeros(3, 4), agg=agg
        )
        result.loss.backward()
        assert result.loss.item() == 0.0 and torch.equal(logp.grad, torch.zeros(3, 4).double())
        assert all(math.isnan(s.item()) for s in result[1:])
        logp.grad = None


def _bad_calls():
    x = torch.zeros(2, 3)
    packed = torch.zeros(5)
    return [
        ("mask of 2", lambda f: f(x, x, x, mask=torch.full((2, 3), 2))),
        ("mask shape", lambda f: f(x, x, x, mask=torch.ones(3, 2))),
        ("lengths range", lambda f: f(x, x, x, lengths=torch.tensor([1, 4]))),
        ("lengths float", lambda f: f(x, x, x, lengths=torch.tensor([1.0, 2.0]))),
        ("lengths and mask", lambda f: f(x, x, x, lengths=torch.tensor([1, 2]), mask=x)),
        ("cu_seqlens end", lambda f: f(packed, packed, packed, cu_seqlens=torch.tensor([0, 4]))),
        (
            "cu_seqlens order",
            lambda f: f(packed, packed, packed, cu_seqlens=torch.tensor([0, 3, 2, 5])),
        ),
        ("cu_seqlens start", lambda f: f(packed, packed, packed, cu_seqlens=torch.tensor([1, 5]))),
        ("packed without cu_seqlens", lambda f: f(packed, packed, packed)),
        ("cu_seqlens on 2-D", lambda f: f(x, x, x, cu_seqlens=torch.tensor([0, 6]))),
        (
            "packed norm",
            lambda f: f(
                packed,
                packed,
                packed,
                cu_seqlens=torch.tensor([0, 5]),
                agg="seq-mean-token-sum-norm",
            ),
        ),
        ("normaliser of another mode", lambda f: f(x, x, x, agg="token-mean", num_seqs=2)),
        ("unknown agg", lambda f: f(x, x, x, agg="token-median")),
        ("num_tokens 0", lambda f: f(x, x, x, num_tokens=0.0)),
        ("num_tokens whose 1/x overflows", lambda f: f(x, x, x, num_tokens=1e-39)),
        (
            "loss_scale whose 1/x overflows",
            lambda f: f(x, x, x, agg="seq-mean-token-sum-norm", loss_scale=1e-39),
        ),
        ("dtypes", lambda f: f(x, x.double(), x)),
        ("shapes", lambda f: f(x, torch.zeros(2, 4), x)),
        ("3-D", lambda f: f(x[None], x[None], x[None])),
        ("weights dtype", lambda f: f(x, x, x, weights=x.long())),
        ("weights float8", lambda f: f(x, x, x, weights=x.to(torch.float8_e4m3fn))),
        ("weights complex", lambda f: f(x, x, x, weights=x.to(torch.complex64))),
        ("meta", lambda f: f(x, torch.zeros(2, 3, device="meta"), x)),
    ]


@pytest.mark.parametrize("name", ["reinforce_loss", "cispo_loss", "sapo_loss"])
def test_the_torch_path_raises_the_kernel_paths_errors(name, monkeypatch):
    function = getattr(pt, name)
    for what, call in _bad_calls():
        errors = []
        for forced in (False, True):
            monkeypatch.setattr(pt, "_DEVICE_PATH_ON_CPU", forced)
            with pytest.raises((TypeError, ValueError)) as caught:
                call(function)
            errors.append((caught.type, str(caught.value)))
        assert errors[0] == errors[1], what
    for forced in (False, True):
        monkeypatch.setattr(pt, "_DEVICE_PATH_ON_CPU", forced)
        with pytest.raises(ValueError, match=r"clip_low|beta|tau_pos"):
            function(
                torch.zeros(2, 3),
                torch.zeros(2, 3),
                torch.zeros(2, 3),
                **{
                    "reinforce_loss": {"beta": -1.0},
                    "cispo_loss": {"clip_low": 1.5},
                    "sapo_loss": {"tau_pos": 0.0},
                }[name],
            )
    if name == "sapo_loss":  # temperatures that float32 rounds to inf or to 0
        zeros = torch.zeros(2, 3)
        for tau in ({"tau_pos": 1e39}, {"tau_neg": 1e-46}):
            errors = []
            for forced in (False, True):
                monkeypatch.setattr(pt, "_DEVICE_PATH_ON_CPU", forced)
                with pytest.raises(ValueError, match=r"is (inf|0) in float32") as caught:
                    function(zeros, zeros, zeros, **tau)
                errors.append(str(caught.value))
            assert errors[0] == errors[1], tau
            assert errors[0].startswith(next(iter(tau))), errors[0]


def on_both_paths(name, logp, old, adv, monkeypatch, **options):
    """The kernel path's and the torch path's (forced on CPU) results and gradients."""
    results = []
    for forced in (False, True):
        monkeypatch.setattr(pt, "_DEVICE_PATH_ON_CPU", forced)
        x = logp.clone().requires_grad_()
        result = getattr(pt, name)(x, old, adv, **options)
        result.loss.backward()
        results.append((result, x.grad))
    return results


@DTYPES
def test_the_torch_path_on_the_clamp_and_clip_bounds_is_the_kernels(dtype, monkeypatch):
    """Log-ratios exactly at SAPO's and CISPO's clamp (-c and c, where the gradient still
    passes), beyond it and inside, ratios exactly at CISPO's clip bounds (1 -+ 1/2 when the
    log-ratio is -+log 2), advantages of 0: the torch path's loss, gradient and statistics are
    the kernels'."""
    # SAPO: c = 1/2; the log-ratios -c, c, beyond (-3/4, 3/4), inside (-1/8, 0)
    sapo = torch.tensor([-0.5, 0.5, -0.75, 0.75, -0.125, 0.0], dtype=dtype)
    # CISPO: ratios 1/2, 2 (its bounds with clip_low 1/2 and clip_high 1, and the clamp log 2),
    # 4 (beyond both), 1; each against an old that gives the log-ratio back exactly
    ln2 = torch.tensor(math.log(2.0), dtype=dtype)
    cispo = torch.stack([-ln2, ln2, -ln2, ln2, 2 * ln2, 0 * ln2])
    cispo_old = torch.tensor([-0.25, -1.0, -0.25, -1.0, -2.0, -1.0], dtype=dtype)
    adv = torch.tensor([[1.5, -0.5, 0.75, -1.0, 0.0, 2.0], [-1.5, 0.5, 0.0, 0.25, -0.5, 1.0]])
    adv = adv.to(dtype)
    lengths = torch.tensor([6, 5])
    for name, log_ratio, old, options in (
        ("sapo_loss", sapo, -1.0, {"log_ratio_clamp": 0.5}),
        ("sapo_loss", sapo, -1.0, {"log_ratio_clamp": 0.5, "tau_pos": 2.0, "tau_neg": 0.5}),
        ("cispo_loss", cispo, cispo_old, {"clip_low": 0.5, "clip_high": 1.0}),
        ("cispo_loss", cispo, cispo_old, {"clip_low": 0.5, "clip_high": 1.0,
                                          "log_ratio_clamp": float(ln2)}),
    ):  # fmt: skip
        old = torch.as_tensor(old, dtype=dtype).expand(2, 6).contiguous()
        logp = old + log_ratio
        # the bounds are hit: the log-ratio the formulas compute, the ratio torch's exp gives
        assert torch.equal(logp - old, log_ratio.expand_as(old))
        if name == "cispo_loss":
            assert torch.equal(log_ratio.exp()[:4], torch.tensor([0.5, 2.0, 0.5, 2.0]).to(dtype))
        for agg in ("token-mean", "seq-mean-token-sum"):
            what = f"{name} {options} {agg}"
            (kernel, grad), (forced, forced_grad) = on_both_paths(
                name, logp, old, adv, monkeypatch, lengths=lengths, agg=agg, **options
            )
            assert_close(forced.loss.detach(), kernel.loss.detach(), dtype, what)
            assert_close(forced_grad, grad, dtype, f"d {what}")
            for stat, kernel_stat in zip(forced[1:], kernel[1:], strict=True):
                assert_close(stat, kernel_stat, dtype, f"stats {what}")
            if name == "sapo_loss":
                # at -c and c the slope passes (A != 0); beyond the clamp it is 0
                assert (grad[:, :2] != 0).all() and (forced_grad[:, :2] != 0).all(), what
                assert (grad[:, 2:4] == 0).all(), what
            else:
                # ratios on the clip bounds are not clipped: only 4 is (one token per row),
                # and not when the clamp (at log 2) makes it 2
                share = 0.0 if "log_ratio_clamp" in options else 2 / 11
                assert kernel.clipfrac.item() == pytest.approx(share), what
                assert kernel.clipfrac_lower.item() == 0.0, what
