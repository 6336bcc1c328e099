"""The peers that ppo_fast.compat is held to.

Each loader returns a ``Peer``: the real package's functions where it imports at the version the
compat module cites, else the verbatim copy shipped in ppo_fast._peers (the copies the
benchmark times). ``Peer.label`` says which
(``verl-0.9.1-real``, ``verl-0.9.1-copy``) and goes into every parity test's id, so a run shows
what it compared against; nothing is skipped for a missing package. The advantage estimators
are held to both where verl imports (``verl_real_and_copy``).

- verl 0.9.1 imports with ``pip install --no-deps verl==0.9.1`` plus omegaconf, codetiming,
  transformers and ray (the ``compat-test`` extra).
- OpenRLHF 0.11.2 and TRL 0.29.1 always run as copies: OpenRLHF's package imports deepspeed,
  peft and flash-attn (a CUDA build); TRL's trainer code is inline in PPOTrainer.train and in the
  GRPO and RLOO trainers' _generate_and_score_completions. Their copies are checked against the
  installed wheels' source where present (tests/test_compat_peer_copies.py).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from ppo_fast import _peers as copies

verl_0_9_1 = copies.copy("verl_0_9_1")
openrlhf_0_11_2 = copies.copy("openrlhf_0_11_2")
trl_0_29_1 = copies.copy("trl_0_29_1")


@dataclass(frozen=True)
class Peer:
    label: str
    api: Any  # the functions, as attributes
    make_config: Callable[..., Any] | None = None
    # verl's AlgoConfig (the estimators' config): gamma, norm_adv_by_std_in_grpo, gdpo_*.
    make_algo_config: Callable[..., Any] | None = None


def _installed(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


_VERL_ESTIMATORS = (
    "compute_grpo_outcome_advantage compute_grpo_vectorized_outcome_advantage "
    "compute_gdpo_outcome_advantage compute_grpo_passk_outcome_advantage "
    "compute_reinforce_plus_plus_baseline_outcome_advantage compute_rloo_outcome_advantage "
    "compute_opo_outcome_advantage compute_reinforce_plus_plus_outcome_advantage "
    "compute_remax_outcome_advantage compute_gpg_outcome_advantage "
    "compute_rloo_vectorized_outcome_advantage compute_optimal_token_baseline_advantage "
    "compute_multi_turn_optimal_token_baseline_advantage"
).split()
_VERL_NAMES = (
    "masked_sum masked_mean masked_var masked_whiten clip_by_value AdaptiveKLController "
    "FixedKLController get_kl_controller compute_gae_advantage_return compute_rewards agg_loss "
    "compute_policy_loss compute_policy_loss_vanilla compute_value_loss kl_penalty "
    "kl_penalty_forward"
).split() + _VERL_ESTIMATORS

# verl's policy-loss family (in the verbatim copy too).
_VERL_POLICY_LOSSES = (
    "compute_policy_loss_gpg compute_policy_loss_dro compute_policy_loss_cispo "
    "compute_policy_loss_sapo compute_policy_loss_gspo compute_policy_loss_geo_mean "
    "compute_policy_loss_dppo_tv compute_policy_loss_dppo_kl "
    "compute_policy_loss_clip_cov compute_policy_loss_kl_cov compute_policy_loss_reinforce"
).split()
# verl's own only (its rollout-correction helper has no verbatim copy here)
_VERL_REAL_ONLY = ("compute_policy_loss_bypass_mode",)


def _real_verl() -> Peer | str:
    version = _installed("verl")
    if version != "0.9.1":
        return f"verl {version or 'not installed'}"
    try:
        import verl.trainer.ppo.core_algos as core_algos
        import verl.utils.torch_functional as verl_F
        from verl.trainer.config import AlgoConfig
        from verl.workers.config import ActorConfig
    except ImportError as error:
        return f"verl 0.9.1 does not import ({error})"

    def make_config(**fields):
        fields.setdefault("global_batch_info", {})
        return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, **fields)

    api = types.SimpleNamespace(
        **{
            n: getattr(verl_F if hasattr(verl_F, n) else core_algos, n)
            for n in _VERL_NAMES + _VERL_POLICY_LOSSES
        },
        **{n: getattr(core_algos, n) for n in _VERL_REAL_ONLY},
    )
    return Peer("verl-0.9.1-real", api, make_config, AlgoConfig)


def _verl_copy() -> Peer:
    api = types.SimpleNamespace(
        **{n: getattr(verl_0_9_1, n) for n in _VERL_NAMES + _VERL_POLICY_LOSSES}
    )
    return Peer("verl-0.9.1-copy", api, verl_0_9_1.ActorConfig, verl_0_9_1.AlgoConfig)


def verl() -> Peer:
    real = _real_verl()
    return real if isinstance(real, Peer) else _verl_copy()


def verl_real_and_copy() -> list[Peer]:
    """verl itself where 0.9.1 imports, and always the verbatim copy: the estimators' parity
    tests hold ppo_fast.compat.verl to both."""
    real = _real_verl()
    return [real, _verl_copy()] if isinstance(real, Peer) else [_verl_copy()]


def openrlhf() -> Peer:
    return Peer("openrlhf-0.11.2-copy", openrlhf_0_11_2)


def trl() -> Peer:
    return Peer("trl-0.29.1-copy", trl_0_29_1)


COPIES = tuple(copies.copy(name) for name in copies.COPIES)
