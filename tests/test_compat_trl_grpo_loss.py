"""ppo_fast.compat.trl.grpo_loss equals TRL 0.29.1's GRPOTrainer._compute_loss (its block from
the log-ratio to the clip metrics, run from the verbatim copy in ppo_fast._peers with a stand-in
trainer; tests/test_compat_peer_copies.py holds the copy to TRL's source): the loss, its gradient
with respect to the log-probs and the clip metrics, for every loss type, importance-sampling
level, delta, advantages per row or per token."""

from __future__ import annotations

import types
from collections import defaultdict

import peers
import pytest
import torch
from peers.cases import assert_parity, batch

from ppo_fast.compat import trl as compat

TRL = peers.trl().api


def trl_loss(logp, old, advantages, mask, *, loss_type, level, delta, accumulation, items):
    """The copy of TRL's block, on a stand-in trainer; (loss, metrics of the train mode)."""
    trainer = types.SimpleNamespace(
        importance_sampling_level=level,
        loss_type=loss_type,
        epsilon_low=0.2,
        epsilon_high=0.28,
        beta=0.0,
        args=types.SimpleNamespace(delta=delta),
        off_policy_mask_threshold=None,
        use_vllm=False,
        model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=accumulation,
        max_completion_length=mask.shape[1],
        accelerator=types.SimpleNamespace(gather=TRL.gather, num_processes=1),
        _metrics={"train": defaultdict(list)},
    )
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    loss = TRL.grpo_trainer_loss(
        trainer,
        {"num_items_in_batch": items},
        logp,
        old,
        advantages,
        mask,
        torch.zeros_like(logp),
        None,
    )
    metrics = {k: v[0] for k, v in trainer._metrics["train"].items() if k.startswith("clip")}
    return loss, metrics


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_grpo_loss_equals_trl(loss_type, level, dtype):
    for k, (kind, delta, per_row) in enumerate(
        [("holes", None, True), ("with-empty-row", 2.0, False), ("left-padded", 1.5, True)]
    ):
        b = batch(kind, dtype, seed=31 + k)
        advantages = b.advantages[:, 0].contiguous() if per_row else b.advantages
        items = float(b.mask.sum()) + 5.0
        outputs = []
        for function in ("ours", "trl"):
            logp = b.logprobs.clone().requires_grad_()
            if function == "ours":
                loss, metrics = compat.grpo_loss(
                    logp, b.old_logprobs, advantages, b.mask, loss_type=loss_type,
                    epsilon=0.2, epsilon_high=0.28, delta=delta,
                    importance_sampling_level=level, max_completion_length=b.mask.shape[1],
                    num_items_in_batch=items, gradient_accumulation_steps=2,
                )  # fmt: skip
            else:
                loss, metrics = trl_loss(
                    logp, b.old_logprobs, advantages, b.mask, loss_type=loss_type,
                    level=level, delta=delta, accumulation=2, items=items,
                )  # fmt: skip
            loss.backward()
            outputs.append((loss, metrics, logp.grad))
        (loss, metrics, grad), (loss_ref, metrics_ref, grad_ref) = outputs
        what = f"{loss_type} {level} {kind} delta={delta} per_row={per_row} {dtype}"
        assert_parity(loss, loss_ref, what)
        assert_parity(grad, grad_ref, f"d {what}")
        assert metrics.keys() == metrics_ref.keys(), what
        for key, value in metrics_ref.items():
            assert_parity(metrics[key], value, f"{what} {key}", dtype)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_the_loss_takes_trls_dtype_from_the_mask_and_its_count(loss_type):
    """TRL's loss is promoted with the mask (per_token_loss * mask) and, for "grpo" and
    "bnpo", with mask.sum().clamp(min=1.0), float32 for an integer or bool mask: float32
    inputs under a float64 mask give a float64 loss, bfloat16 ones a float32 loss there."""
    for dtype in (torch.float32, torch.bfloat16):
        b = batch("holes", dtype, seed=37)
        for mask_dtype in (torch.bool, torch.int64, torch.float32, torch.float64):
            mask = b.mask.to(mask_dtype)
            items = float(b.mask.sum()) + 5.0
            ours, _ = compat.grpo_loss(
                b.logprobs, b.old_logprobs, b.advantages, mask, loss_type=loss_type,
                epsilon=0.2, epsilon_high=0.28, max_completion_length=mask.shape[1],
                num_items_in_batch=items, gradient_accumulation_steps=2,
            )  # fmt: skip
            theirs, _ = trl_loss(
                b.logprobs, b.old_logprobs, b.advantages, mask, loss_type=loss_type,
                level="token", delta=None, accumulation=2, items=items,
            )  # fmt: skip
            what = f"{loss_type} {dtype} {mask_dtype}"
            assert ours.dtype == theirs.dtype, what
            tolerance = {"rtol": 2e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {}
            torch.testing.assert_close(ours, theirs, check_dtype=False, msg=what, **tolerance)


def test_the_batch_takes_the_clip_and_delta():
    """What the parity covers: sequence ratios beyond the bounds and beyond delta, both signs."""
    b = batch("holes", torch.float64, seed=31)
    mask = b.mask.bool()
    mean = torch.where(mask, b.logprobs - b.old_logprobs, 0.0).sum(-1) / b.mask.sum(-1)
    assert (mean.exp() > 2.0).any() and (mean.exp() < 0.8).any()
    ratio = (b.logprobs - b.old_logprobs)[mask].exp()
    assert (ratio > 2.0).any() and (ratio < 0.8).any()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"loss_type": "luspo"}, "loss_type must be one of"),
        ({"importance_sampling_level": "row"}, "Unknown importance sampling level"),
        ({"delta": 1.1, "epsilon_high": 0.28}, "delta must be > 1 \\+ epsilon_high"),
        ({"loss_type": "dapo"}, "needs num_items_in_batch"),
    ],
)
def test_settings_it_does_not_reproduce_are_errors_naming_them(options, message):
    b = batch("holes", torch.float64)
    with pytest.raises(ValueError, match=message):
        compat.grpo_loss(b.logprobs, b.old_logprobs, b.advantages, b.mask, **options)
