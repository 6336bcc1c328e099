"""Every public function through the hostile-input generator (tests/hostile.py): the oracle's
answer or an error that names the argument, never a crash, never a modified input."""

from __future__ import annotations

import hostile
import pytest
from conftest import COMPILED

from ppo_fast._spec import KERNELS

TARGETS = hostile.targets()

# Known bugs, fixed on another branch: each mark names the precise cases, so that it can go when
# the fix lands (strict: a case that starts passing fails the run until its mark is removed).
KNOWN_BUGS = {
    "(a) a bool mask whose bytes are not 0/1 makes the losses divide by the byte value": (
        "clipped_surrogate:mask-bool-bytes-2",
        "clipped_surrogate:mask-bool-bytes-255",
        "clipped_surrogate[seq-mean-token-mean]:mask-bool-bytes-2",
        "clipped_surrogate[seq-mean-token-mean]:mask-bool-bytes-255",
        "value_loss:mask-bool-bytes-2",
        "value_loss:mask-bool-bytes-255",
        "value_loss[seq-mean-token-sum-norm]:mask-bool-bytes-2",
        "value_loss[seq-mean-token-sum-norm]:mask-bool-bytes-255",
        "torch.clipped_surrogate:mask-bool-bytes-2",
        "torch.clipped_surrogate:mask-bool-bytes-255",
        "torch.clipped_surrogate[seq-mean-token-mean]:mask-bool-bytes-2",
        "torch.clipped_surrogate[seq-mean-token-mean]:mask-bool-bytes-255",
        "torch.value_loss:mask-bool-bytes-2",
        "torch.value_loss:mask-bool-bytes-255",
        "torch.value_loss[seq-mean-token-sum-norm]:mask-bool-bytes-2",
        "torch.value_loss[seq-mean-token-sum-norm]:mask-bool-bytes-255",
        "verl.compute_policy_loss_vanilla:response_mask-mask-bool-bytes-2",
        "verl.compute_policy_loss_vanilla:response_mask-mask-bool-bytes-255",
        "verl.compute_value_loss:response_mask-mask-bool-bytes-2",
        "verl.compute_value_loss:response_mask-mask-bool-bytes-255",
        "openrlhf.PolicyLoss:action_mask-mask-bool-bytes-2",
        "openrlhf.PolicyLoss:action_mask-mask-bool-bytes-255",
    ),
    "(b) non-finite log-probs at valid positions without log_ratio_clamp: the compiled "
    "backends give a finite gradient where the oracle gives NaN": (
        "clipped_surrogate:lengths",
        "clipped_surrogate:lengths-uint64",
        "clipped_surrogate:lengths-int8",
        "clipped_surrogate[seq-mean-token-mean]:lengths",
        "clipped_surrogate[seq-mean-token-mean]:lengths-uint64",
        "clipped_surrogate[seq-mean-token-mean]:lengths-int8",
    ),
    "(c) value_loss with values near 1e200: the python backend raises OverflowError": (
        "value_loss:values-1e+200-at-valid",
        "value_loss:old_values-1e+200-at-valid",
        "value_loss:returns-1e+200-at-valid",
        "value_loss[seq-mean-token-sum-norm]:values-1e+200-at-valid",
        "torch.value_loss:values-1e+200-at-valid",
        "torch.value_loss:old_values-1e+200-at-valid",
        "torch.value_loss:returns-1e+200-at-valid",
        "torch.value_loss[seq-mean-token-sum-norm]:values-1e+200-at-valid",
        "verl.compute_value_loss:vpreds-1e+200-at-valid",
        "verl.compute_value_loss:returns-1e+200-at-valid",
        "verl.compute_value_loss:values-1e+200-at-valid",
        "openrlhf.ValueLoss:values-1e+200-at-valid",
        "openrlhf.ValueLoss:old_values-1e+200-at-valid",
        "openrlhf.ValueLoss:returns-1e+200-at-valid",
    ),
}
_XFAIL = {case: reason for reason, cases in KNOWN_BUGS.items() for case in cases}


def _params():
    for target in TARGETS:
        for case in hostile.cases(target):
            name = case.id(target)
            reason = _XFAIL.get(name)
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            yield pytest.param(target, case, id=name, marks=marks)


@pytest.mark.parametrize(("target", "case"), list(_params()))
def test_hostile_input(target, case):
    hostile.check(target, case, COMPILED)


def test_every_known_bug_names_a_case():
    names = {case.id(target) for target in TARGETS for case in hostile.cases(target)}
    assert set(_XFAIL) <= names


def test_every_kernel_is_reached_through_its_public_stage():
    stage = {"moments": "masked_moments"}
    names = {target.name for target in TARGETS}
    for kernel in KERNELS:
        assert stage.get(kernel, kernel) in names
        assert f"torch.{stage.get(kernel, kernel)}" in names
