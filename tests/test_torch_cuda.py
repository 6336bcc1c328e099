"""ppo_fast.torch on a real CUDA device: every loss computed on the device (its torch path) equals
the same call on CPU tensors (the compiled kernels): loss, statistics and gradient, in every
layout (bool, int64 and float masks, lengths, cu_seqlens), float32, float64 and bfloat16. The
results stay on the device, and a bool mask costs no synchronisation with the host (counted with
torch.cuda.set_sync_debug_mode). The estimators (host round trip) return on the device, equal to
the CPU call.

These tests need a CUDA device and are skipped, with that reason, where torch sees none (CI has
none). They ran on an NVIDIA H200 (README, "On a GPU"): run them with
``python -m pytest tests/test_torch_cuda.py`` on a machine with a GPU."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import ppo_fast.torch as pt  # noqa: E402

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(
    not CUDA, reason="needs a CUDA device (torch.cuda.is_available() is False here)"
)

AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
LAYOUTS = ("mask-bool", "mask-int64", "mask-float", "lengths", "cu_seqlens")
# (rtol, atol on the scale of the largest magnitude): the device's exp/log round differently
# from the kernels' by an ulp or two; sums are float64 on both.
TOL = {torch.float32: (1e-5, 1e-6), torch.float64: (1e-12, 1e-14), torch.bfloat16: (1e-2, 1e-3)}
LOSSES = [
    ("clipped_surrogate", {"clip_low": 0.2, "clip_high": 0.28}),
    ("clipped_surrogate", {"clip_low": 0.1, "dual_clip": 1.5, "log_ratio_clamp": 0.5}),
    ("reinforce_loss", {"beta": 0.0}),
    ("reinforce_loss", {"beta": 0.1}),
    ("cispo_loss", {"clip_low": 0.2, "clip_high": 0.28, "log_ratio_clamp": 20.0}),
    ("sapo_loss", {"tau_pos": 1.0, "tau_neg": 1.05}),
    ("gspo_loss", {"form": "detached", "clip_low": 3e-4, "clip_high": 4e-4, "log_ratio_max": 10.0}),
    ("gspo_loss", {"form": "sequence", "clip_low": 0.2, "dual_clip": 3.0}),
    ("geo_mean_loss", {"clip_low": 0.4}),
    ("dppo_loss", {"divergence": "tv"}),
    ("dppo_loss", {"divergence": "kl", "divergence_low": 0.1, "divergence_high": 0.3}),
    ("kl_cov_loss", {"coef": 1.0}),
]


class Case:
    """A ragged batch on the CPU: rows of several lengths (one empty), holes in the masks."""

    def __init__(self, layout: str, dtype: torch.dtype, seed: int, rows: int = 7, width: int = 13):
        rng = np.random.default_rng(seed)
        lengths = rng.integers(1, width + 1, rows)
        lengths[3] = 0
        valid = np.arange(width)[None, :] < lengths[:, None]
        if layout.startswith("mask"):
            valid &= rng.random((rows, width)) < 0.85
        old = rng.uniform(-3.0, -0.1, (rows, width))
        logp = old + rng.normal(0.0, 0.3, (rows, width))
        adv = rng.normal(0.0, 1.0, (rows, width))
        adv[rng.random((rows, width)) < 0.05] = 0.0
        weights = rng.uniform(0.5, 1.5, (rows, width))
        select = rng.random((rows, width)) < 0.3
        if layout == "cu_seqlens":  # the valid tokens packed back to back
            cu = np.concatenate([[0], np.cumsum(lengths)])
            self.layout = {"cu_seqlens": torch.tensor(cu, dtype=torch.int32)}
            pick = valid
        else:
            pick = np.ones_like(valid)
            given = {
                "mask-bool": lambda: torch.tensor(valid),
                "mask-int64": lambda: torch.tensor(valid.astype(np.int64)),
                "mask-float": lambda: torch.tensor(valid.astype(np.float32)),
                "lengths": lambda: torch.tensor(lengths, dtype=torch.int64),
            }[layout]()
            self.layout = {"lengths" if layout == "lengths" else "mask": given}
        self.tokens = {
            name: torch.tensor(array[pick], dtype=dtype).reshape(
                -1 if layout == "cu_seqlens" else (rows, width)
            )
            for name, array in (("logp", logp), ("old", old), ("adv", adv), ("weights", weights))
        }
        self.selected = torch.tensor(select[pick]).reshape(self.tokens["logp"].shape)
        self.width = width

    def on(self, device: str) -> tuple[dict, dict, torch.Tensor]:
        tokens = {k: v.to(device) for k, v in self.tokens.items()}
        layout = {k: v.to(device) for k, v in self.layout.items()}
        return tokens, layout, self.selected.to(device)


def run_loss(name, options, agg, weighted, case: Case, on_device):
    """(result, gradient) of the loss on the tensors ``on_device`` (``case.on(device)``),
    forward and backward."""
    tokens, layout, selected = on_device
    arguments = dict(options, agg=agg, **layout)
    if agg == "seq-mean-token-sum-norm":
        arguments["loss_scale"] = float(case.width)
    if weighted and name != "value_loss":
        arguments["weights"] = tokens["weights"]
    logp = tokens["logp"].clone().requires_grad_()
    others = (tokens["old"], tokens["adv"])
    if name == "kl_cov_loss":
        others = (*others, selected)
    result = getattr(pt, name)(logp, *others, **arguments)
    result.loss.backward()
    return result, logp.grad


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype, what: str) -> None:
    assert actual.device.type == "cuda", f"{what}: on {actual.device}, not on the device"
    assert actual.dtype == expected.dtype, f"{what}: {actual.dtype} != {expected.dtype}"
    rtol, atol = TOL[dtype]
    a, e = actual.detach().cpu().double().numpy(), expected.detach().double().numpy()
    scale = max(1.0, float(np.nanmax(np.abs(e), initial=0.0)))
    np.testing.assert_allclose(a, e, rtol=rtol, atol=atol * scale, err_msg=what)


def synchronisations(function) -> tuple[object, int]:
    """``function()``'s value and how many synchronising CUDA operations it ran."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            value = function()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return value, sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("name", "options"), LOSSES, ids=lambda v: str(v)[:40])
def test_loss_on_the_device_equals_the_kernels(name, options, layout, dtype):
    for seed, agg in enumerate(AGGS):
        if layout == "cu_seqlens" and agg == "seq-mean-token-sum-norm":
            continue  # needs loss_scale on packed rows: passed, so keep the case
        case = Case(layout, dtype, seed)
        for weighted in (False, True):
            what = f"{name} {options} {layout} {agg} weighted={weighted} {dtype}"
            expected, expected_grad = run_loss(name, options, agg, weighted, case, case.on("cpu"))
            on_device = case.on("cuda")  # the copies there are not the loss's
            torch.cuda.synchronize()
            (actual, grad), syncs = synchronisations(
                lambda: run_loss(name, options, agg, weighted, case, on_device)  # noqa: B023
            )
            for field, a, e in zip(expected._fields, actual, expected, strict=True):
                assert_close(a, e, dtype, f"{what}: {field}")
            assert_close(grad, expected_grad, dtype, f"{what}: gradient")
            # A bool mask: nothing read back. Other layouts: their values are checked in one
            # reduction read back as one bool (ppo_fast.torch's docstring).
            allowed = 0 if layout == "mask-bool" else 1
            assert syncs <= allowed, f"{what}: {syncs} synchronisations, expected <= {allowed}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_value_loss_on_the_device_equals_the_kernels(layout, dtype):
    for seed, agg in enumerate(AGGS):
        case = Case(layout, dtype, seed)
        for clip in (None, 0.2):
            what = f"value_loss clip={clip} {layout} {agg} {dtype}"
            results = []
            for device in ("cpu", "cuda"):
                tokens, given, _ = case.on(device)
                values = tokens["logp"].clone().requires_grad_()
                scale = {"loss_scale": 13.0} if agg == "seq-mean-token-sum-norm" else {}
                result = pt.value_loss(
                    values, tokens["old"], tokens["adv"], clip=clip, agg=agg, **given, **scale
                )
                result.loss.backward()
                results.append((result, values.grad))
            (expected, expected_grad), (actual, grad) = results
            for field, a, e in zip(expected._fields, actual, expected, strict=True):
                assert_close(a, e, dtype, f"{what}: {field}")
            assert_close(grad, expected_grad, dtype, f"{what}: gradient")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_estimators_return_on_the_device(layout):
    """The estimators take a host round trip: the same numbers as on CPU tensors, returned on
    the input's device."""
    case = Case(layout, torch.float32, 11)
    cpu_tokens, cpu_layout, _ = case.on("cpu")
    cuda_tokens, cuda_layout, _ = case.on("cuda")
    rows = 7
    scores = torch.linspace(-1.0, 1.0, rows)
    for device, tokens, given in (
        ("cpu", cpu_tokens, cpu_layout),
        ("cuda", cuda_tokens, cuda_layout),
    ):
        rewards = pt.shape_rewards(
            scores.to(device), tokens["logp"], tokens["old"], kl_coef=0.05, estimator="k3",
            **given,
        )  # fmt: skip
        result = pt.gae(rewards, tokens["adv"], gamma=0.99, lam=0.95, **given)
        whitened = pt.whiten(result.advantages, **given)
        moments = pt.masked_moments(tokens["weights"], **given)
        kl = pt.kl_penalty(tokens["logp"], tokens["old"], "k2")
        if device == "cpu":
            expected = (rewards, result.advantages, result.returns, whitened, kl)
            expected_moments = moments
            continue
        for what, a, e in zip(
            ("rewards", "advantages", "returns", "whitened", "kl"),
            (rewards, result.advantages, result.returns, whitened, kl),
            expected,
            strict=True,
        ):
            assert a.device.type == "cuda", what
            torch.testing.assert_close(a.cpu(), e, rtol=0, atol=0, msg=what)
        assert moments == expected_moments


@pytest.mark.parametrize("layout", LAYOUTS)
def test_selections_return_on_the_device(layout):
    case = Case(layout, torch.float32, 5)
    picks = []
    for device in ("cpu", "cuda"):
        tokens, given, _ = case.on(device)
        kl = pt.kl_cov_selection(tokens["logp"], tokens["adv"], ratio=0.2, **given)
        clip = pt.clip_cov_selection(
            tokens["logp"], tokens["old"], tokens["adv"], seed=3, ratio=0.2, lower=-1.0,
            upper=1.0, **given,
        )  # fmt: skip
        assert kl.device.type == clip.device.type == device
        assert kl.dtype == clip.dtype == torch.bool
        picks.append((kl.cpu(), clip.cpu()))
    assert torch.equal(picks[0][0], picks[1][0]) and torch.equal(picks[0][1], picks[1][1])
    assert picks[0][0].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kl_cov_selection_runs_on_the_device(layout, dtype):
    """KL-Cov's selection on the device picks the kernels' tokens, reading back only the count
    of valid tokens (one synchronisation; one more for a layout whose values are checked)."""
    for seed in range(4):
        case = Case(layout, dtype, seed, rows=64, width=257)
        for ratio in (0.0002, 0.01, 0.2, 1.0):
            tokens, given, _ = case.on("cpu")
            expected = pt.kl_cov_selection(tokens["logp"], tokens["adv"], ratio=ratio, **given)
            tokens, given, _ = case.on("cuda")
            torch.cuda.synchronize()
            actual, syncs = synchronisations(
                lambda: pt.kl_cov_selection(tokens["logp"], tokens["adv"], ratio=ratio, **given)  # noqa: B023
            )
            what = f"{layout} {dtype} seed={seed} ratio={ratio}"
            assert actual.device.type == "cuda" and actual.dtype == torch.bool, what
            assert torch.equal(actual.cpu(), expected), what
            allowed = 1 if layout == "mask-bool" else 2
            assert syncs <= allowed, f"{what}: {syncs} synchronisations, expected <= {allowed}"


def test_kl_cov_selection_on_the_device_at_the_bench_size():
    """At 1024 x 4096 (the benchmark's batch), the device's selection equals the kernels'."""
    rng = np.random.default_rng(11)
    lengths = rng.integers(2048, 4097, 1024)
    mask = torch.tensor(np.arange(4096)[None, :] < lengths[:, None])
    logp = torch.tensor(rng.uniform(-3.0, 0.0, (1024, 4096)), dtype=torch.float32)
    adv = torch.tensor(rng.normal(0.0, 1.0, (1024, 4096)), dtype=torch.float32)
    for ratio in (0.0002, 0.002):
        expected = pt.kl_cov_selection(logp, adv, ratio=ratio, mask=mask)
        actual = pt.kl_cov_selection(logp.cuda(), adv.cuda(), ratio=ratio, mask=mask.cuda())
        assert torch.equal(actual.cpu(), expected), ratio
