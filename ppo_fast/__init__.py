"""ppo_fast: the numeric core of PPO for language models, exact and compiled.

KL-shaped rewards, GAE, the critic-free estimators (discounted returns for REINFORCE++, ReMax, the
optimal token baseline), masked whitening and fused clipped losses over ragged batches (padded
with a mask or lengths, or packed with cu_seqlens), on numba, Cython or the pure-Python oracle.
"""

from ._backend import BackendUnavailableError, available_backends, get_backend, set_backend
from ._threads import get_num_threads, set_num_threads
from ._warmup import warmup
from .gae import GAEResult, gae
from .loss import PolicyLossResult, ValueLossResult, clipped_surrogate, value_loss
from .returns import (
    AdvantagesResult,
    discounted_returns,
    optimal_token_baseline,
    reinforce_plus_plus,
    remax,
)
from .rewards import kl_penalty, shape_rewards
from .whiten import Moments, masked_moments, whiten

__version__ = "0.2.0"

__all__ = [
    "AdvantagesResult",
    "BackendUnavailableError",
    "GAEResult",
    "Moments",
    "PolicyLossResult",
    "ValueLossResult",
    "available_backends",
    "clipped_surrogate",
    "discounted_returns",
    "gae",
    "get_backend",
    "get_num_threads",
    "kl_penalty",
    "masked_moments",
    "optimal_token_baseline",
    "reinforce_plus_plus",
    "remax",
    "set_backend",
    "set_num_threads",
    "shape_rewards",
    "value_loss",
    "warmup",
    "whiten",
]
