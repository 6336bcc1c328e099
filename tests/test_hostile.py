"""Every public function through the hostile-input generator (tests/hostile.py): the oracle's
answer or an error that names the argument, never a crash, never a modified input."""

from __future__ import annotations

import hostile
import pytest
from conftest import COMPILED

from ppo_fast._spec import KERNELS

TARGETS = hostile.targets()

# Hostile inputs make numpy and torch warn (NaN cast to int, complex cast to real) by design; the
# compat estimators run their peers' torch arithmetic, which warns as the peers do on a 0-d NumPy
# hyperparameter (epsilon) and on the std of an empty batch (TRL's logging std).
pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:Casting complex values to real:UserWarning"),
    pytest.mark.filterwarnings("ignore:__array_wrap__ must accept context:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:std\\(\\). degrees of freedom is <= 0:UserWarning"),
]


def _params():
    for target in TARGETS:
        for case in hostile.cases(target):
            dtype = pytest.mark.numba_dtype("float32" if case.float32 else "float64")
            yield pytest.param(target, case, id=case.id(target), marks=dtype)


# Each case runs on every compiled backend, numba's at its targets' float64 arrays (float32 for
# the cases that make them so): that dtype's xdist group (tests/conftest.py), whose worker
# compiles those kernels for the other tests too.
@pytest.mark.numba
@pytest.mark.parametrize(("target", "case"), list(_params()))
def test_hostile_input(target, case):
    hostile.check(target, case, COMPILED)


def test_every_kernel_is_reached_through_its_public_stage():
    import ppo_fast.torch

    stage = {
        "moments": "masked_moments",
        "reinforce": "reinforce_loss",
        "cispo": "cispo_loss",
        "sapo": "sapo_loss[seq-mean-token-mean]",
        "dppo": "dppo_loss[kl]",
        "kl_cov": "kl_cov_loss",
        "kl_cov_top_k": "kl_cov_selection",
        "gspo": "gspo_loss",
        "geo_mean": "geo_mean_loss",
    }
    names = {target.name for target in TARGETS}
    for kernel in KERNELS:
        assert stage.get(kernel, kernel) in names
        if stage.get(kernel, kernel) in hostile.NUMPY_ONLY:
            # When ppo_fast.torch gains it, it leaves NUMPY_ONLY and gets its torch target.
            assert not hasattr(ppo_fast.torch, stage.get(kernel, kernel))
        else:
            assert f"torch.{stage.get(kernel, kernel)}" in names
