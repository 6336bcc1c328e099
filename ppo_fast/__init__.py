"""ppo_fast: the numeric core of PPO for language models, exact and compiled.

KL-shaped rewards, GAE, the critic-free estimators (discounted returns for REINFORCE++, ReMax, the
optimal token baseline), masked whitening, fused clipped losses and the policy-loss family (CISPO,
SAPO, REINFORCE/GPG, DRO) over ragged batches (padded
with a mask or lengths, or packed with cu_seqlens), on numba, Cython or the pure-Python oracle.
"""

from ._backend import BackendUnavailableError, available_backends, get_backend, set_backend
from ._result_arrays import set_result_cache
from ._threads import get_num_threads, set_num_threads
from ._warmup import warmup
from .covariance import clip_cov_selection, kl_cov_selection
from .gae import GAEResult, gae
from .loss import PolicyLossResult, ValueLossResult, clipped_surrogate, value_loss
from .outcome import (
    broadcast_to_tokens,
    gdpo,
    gpg,
    grpo,
    opo,
    pass_at_k,
    reinforce_plus_plus_baseline,
    rloo,
)
from .policy import (
    cispo_loss,
    clip_cov_loss,
    dppo_loss,
    geo_mean_loss,
    gspo_loss,
    kl_cov_loss,
    reinforce_loss,
    sapo_loss,
)
from .returns import (
    AdvantagesResult,
    discounted_returns,
    optimal_token_baseline,
    reinforce_plus_plus,
    remax,
)
from .rewards import kl_penalty, shape_rewards
from .whiten import Moments, masked_moments, whiten

__version__ = "0.8.44"

__all__ = [
    "AdvantagesResult",
    "BackendUnavailableError",
    "GAEResult",
    "Moments",
    "PolicyLossResult",
    "ValueLossResult",
    "available_backends",
    "broadcast_to_tokens",
    "cispo_loss",
    "clip_cov_loss",
    "clip_cov_selection",
    "clipped_surrogate",
    "discounted_returns",
    "dppo_loss",
    "gae",
    "gdpo",
    "geo_mean_loss",
    "get_backend",
    "get_num_threads",
    "gpg",
    "grpo",
    "gspo_loss",
    "kl_cov_loss",
    "kl_cov_selection",
    "kl_penalty",
    "masked_moments",
    "opo",
    "optimal_token_baseline",
    "pass_at_k",
    "reinforce_loss",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "rloo",
    "sapo_loss",
    "set_backend",
    "set_num_threads",
    "set_result_cache",
    "shape_rewards",
    "value_loss",
    "warmup",
    "whiten",
]
