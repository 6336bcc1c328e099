"""The comparison table: every kernel, our implementations, the peers, and what runs here.

``KERNELS`` lists each public kernel of ppo_fast with

- the bytes it must read and write (each input read once at its dtype, a bool mask at one byte,
  each output written once), which define its memory floor (``ppo_fast.bench.roofline``);
- the kernels of ppo_fast's kernel table it exercises (``table_kernels``);
- our implementations, one per backend (the pure-Python oracle only on small batches);
- the peers: the code that PPO trainers run today, from the verbatim copies in
  ``ppo_fast._peers`` (each names the release it copies), or the real function where its
  package imports (TorchRL's GAE); the adapters here only put the inputs in the peer's layout
  (torch tensors, time-major arrays for CleanRL and Stable-Baselines3);
- which outputs are compared, and where: every peer's output is checked against ours before it is
  timed (``checks.compare``), so that a benchmark never compares different computations.

Times are of whole calls, with inputs already in each implementation's own layout: conversions
are not timed, output allocation is. torch, scipy and torchrl are imported only when a row needs
them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _backend, _spec
from . import adapters
from .adapters import CLIP, DUAL_CLIP, GAMMA, KL_CLAMP, KL_COEF, LAM, LOG_RATIO_CLAMP, VALUE_CLIP
from .batch import GROUP_SIZE, Batch
from .roofline import COPY_BYTES, COPY_REPEATS, Copy

OURS, PEER, FLOOR = "ours", "peer", "floor"

# The oracle is a Python loop per token: it runs on batches up to this size only.
PYTHON_MAX_TOKENS = 1 << 16

# The kernels of ppo_fast's kernel table; every one has at least one entry in KERNELS.
TABLE_KERNELS = tuple(_spec.KERNELS)


@dataclass(frozen=True)
class Implementation:
    """One way to compute a kernel.

    ``prepare(batch, threads)`` puts the inputs in the implementation's own layout and returns
    the zero-argument call that is timed; ``outputs(result)`` turns its result into NumPy arrays
    in ppo_fast's (B, T) layout for the check.
    """

    name: str
    kind: str
    prepare: Callable[[Batch, int], Callable[[], Any]]
    outputs: Callable[[Any], dict[str, np.ndarray]] | None = None
    source: str = ""
    requires: tuple[str, ...] = ()
    backend: str | None = None
    max_tokens: int | None = None
    convention: str = ""
    check_dtype: Any = None  # compare at this dtype's tolerance (a peer that downcasts)
    compare: tuple[str, ...] | None = None  # the outputs compared, when not all the kernel's
    # Ours into preallocated outputs (out=): timed, checked and set against the floor, but not
    # a column of speed-ups (it is the same code as the row of its backend, minus allocation).
    preallocated: bool = False


@dataclass(frozen=True)
class Kernel:
    """A public kernel of ppo_fast, the bytes it moves, and everything it is compared with."""

    name: str
    summary: str
    reads: tuple[str, ...]  # Batch arrays it must read
    writes: int  # (B, T) arrays of the batch dtype it must write
    compare: tuple[str, ...]  # outputs checked against ours
    valid_only: bool  # compare at the valid positions only
    table_kernels: tuple[str, ...]  # the kernels of ppo_fast's kernel table it exercises
    implementations: tuple[Implementation, ...] = field(default_factory=tuple)

    def traffic(self, batch: Batch) -> tuple[int, int]:
        """(bytes read, bytes written): each input once, each output once."""
        read = sum(batch.nbytes(name) for name in self.reads)
        return read, self.writes * batch.tokens * batch.dtype.itemsize

    def implementation(self, name: str) -> Implementation:
        for implementation in self.implementations:
            if implementation.name == name:
                return implementation
        raise KeyError(f"{self.name} has no implementation {name!r}")


def _ours(
    prepare: Callable[[Batch, str], Callable[[], Any]],
    outputs: Callable[[Any], dict[str, np.ndarray]],
    call: str,
) -> list[Implementation]:
    return [
        Implementation(
            name=f"ppo_fast[{backend}]",
            kind=OURS,
            prepare=lambda batch, threads, backend=backend: prepare(batch, backend),
            outputs=outputs,
            source=call,
            backend=backend,
            max_tokens=PYTHON_MAX_TOKENS if backend == "python" else None,
        )
        for backend in _backend.BACKENDS
    ]


def _preallocated(prepare: Callable[[Batch, int], Callable[[], Any]], outputs, call: str):
    """ppo_fast's default backend writing into outputs allocated (and touched) once, outside
    the timing: the fresh rows' time minus the allocation and first touch of their outputs."""
    return Implementation(
        name="ppo_fast out=",
        kind=OURS,
        prepare=prepare,
        outputs=outputs,
        source=call,
        preallocated=True,
    )


def _outcome(estimator: str, labels: str, call: str) -> Implementation:
    """ppo_fast's outcome estimator: NumPy over the rows (groups numbered by a hash table), with
    no compiled backend of its own to choose."""
    return Implementation(
        name="ppo_fast",
        kind=OURS,
        prepare=adapters.ours_outcome(estimator, labels),
        outputs=adapters.advantages_output,
        source=call,
    )


def _floor_implementation(kernel: Kernel) -> Implementation:
    read = ", ".join(kernel.reads)
    return Implementation(
        name="floor",
        kind=FLOOR,
        # what is timed is the copy that measures the bandwidth; the row's time is the floor
        prepare=lambda batch, threads: Copy(threads),
        source=f"the memory floor: reading {read} and writing {kernel.writes} array(s) once, at "
        f"the copy bandwidth (np.copyto over {COPY_BYTES >> 20} MiB, best of {COPY_REPEATS} around "
        "ppo_fast's rows of the table)",
    )


def _kernel(kernel: Kernel) -> Kernel:
    implementations = (*kernel.implementations, _floor_implementation(kernel))
    return dataclasses.replace(kernel, implementations=implementations)


VERL = "verl 0.9.1 (_peers.verl_0_9_1)"
OPENRLHF = "OpenRLHF 0.11.2 (_peers.openrlhf_0_11_2)"
TRL_PPO = "TRL 0.29.1 (_peers.trl_0_29_1) PPOTrainer.train"
TRL_GRPO = "TRL 0.29.1 (_peers.trl_0_29_1) GRPOTrainer._generate_and_score_completions's"
TRL_RLOO = "TRL 0.29.1 (_peers.trl_0_29_1) RLOOTrainer._generate_and_score_completions's"
_TOKEN_SCORES = (
    "verl reads the scores as token_level_rewards (each score on its row's last valid token) "
    "and sums them back over T, inside the timed call"
)
_FLOAT32_GROUPS = (
    _TOKEN_SCORES + "; its group_mean_std is float32 whatever the scores' dtype, so float64 "
    "results agree to float32 precision"
)
_BESSEL = (
    "masked_var's Bessel factor mask_sum / (mask_sum - 1) divides two integer tensors, which "
    "torch returns in float32, so float64 results agree to float32 precision"
)


def _policy_family(loss: str, summary: str, call: str, selection: tuple[str, ...] = ()) -> Kernel:
    """A loss of the policy family against verl's registered function, eager and torch.compile'd
    (forward + backward), with verl's settings (``adapters.ours_policy_family``); ``selection``:
    the table kernels of a token selection that ours runs first, as verl's function does."""
    verl_function = adapters.FAMILY_VERL[loss]
    return Kernel(
        loss,
        f"{summary}, loss and d loss / d logprobs",
        reads=("logprobs", "old_logprobs", "advantages", "mask"),
        writes=1,
        compare=("loss", "grad"),
        valid_only=True,
        table_kernels=(loss, *selection),
        implementations=(
            *_ours(adapters.ours_policy_family(loss), adapters.loss_outputs, call),
            Implementation(
                "verl",
                PEER,
                adapters.verl_policy_family(loss, compiled=False),
                adapters.loss_and_grad,
                f"{VERL} {verl_function}, forward + backward",
                requires=("torch",),
            ),
            Implementation(
                "torch.compile",
                PEER,
                adapters.verl_policy_family(loss, compiled=True),
                adapters.loss_and_grad,
                f"torch.compile of {VERL} {verl_function}, forward + backward",
                requires=("torch",),
                convention="compiled on the warm-up call, not timed",
            ),
        ),
    )


KERNELS: dict[str, Kernel] = {
    kernel.name: _kernel(kernel)
    for kernel in (
        Kernel(
            "kl_penalty",
            f"k3 KL estimate per token, clamped to +-{KL_CLAMP:g} (verl's low_var_kl)",
            reads=("logprobs", "ref_logprobs"),
            writes=1,
            compare=("kl",),
            valid_only=False,
            table_kernels=("kl_penalty",),
            implementations=(
                *_ours(adapters.ours_kl, lambda kl: {"kl": kl}, "kl_penalty(logp, ref, 'k3', 10)"),
                Implementation(
                    "verl kl_penalty",
                    PEER,
                    adapters.verl_kl,
                    lambda kl: {"kl": adapters.numpy(kl)},
                    f"{VERL} kl_penalty(logprob, ref_logprob, 'low_var_kl')",
                    requires=("torch",),
                ),
            ),
        ),
        Kernel(
            "shape_rewards",
            f"-{KL_COEF:g} * k3 KL per valid token, plus the score on the last one",
            reads=("scores", "logprobs", "ref_logprobs", "mask"),
            writes=1,
            compare=("rewards",),
            valid_only=False,
            table_kernels=("shape_rewards",),
            implementations=(
                *_ours(
                    adapters.ours_shape_rewards,
                    lambda rewards: {"rewards": rewards},
                    "shape_rewards(scores, logp, ref, kl_coef=0.05, estimator='k3', mask=mask)",
                ),
                Implementation(
                    "trl",
                    PEER,
                    adapters.trl_shape_rewards,
                    adapters.trl_rewards_outputs,
                    f"{TRL_PPO} steps 3-4, the padding masks and '4. compute rewards' (k3)",
                    requires=("torch",),
                    convention="TRL adds the score one token past the last valid one (on it when "
                    "the row is full); the check moves it back onto the last valid token, where "
                    "ppo_fast puts it",
                ),
            ),
        ),
        Kernel(
            "gae",
            f"GAE (gamma={GAMMA:g}, lam={LAM:g}) over right-padded rows",
            reads=("rewards", "values", "mask"),
            writes=2,
            compare=("advantages", "returns"),
            valid_only=True,
            table_kernels=("gae",),
            implementations=(
                *_ours(adapters.ours_gae, adapters.gae_outputs, "gae(rewards, values, mask=mask)"),
                _preallocated(
                    adapters.ours_gae_out,
                    adapters.gae_outputs,
                    "gae(rewards, values, mask=mask, out=(advantages, returns))",
                ),
                Implementation(
                    "openrlhf",
                    PEER,
                    adapters.openrlhf_gae,
                    adapters.pair,
                    f"{OPENRLHF} RemoteExperienceMaker.get_advantages_and_returns",
                    requires=("torch",),
                ),
                Implementation(
                    "cleanrl",
                    PEER,
                    adapters.cleanrl_gae,
                    adapters.pair_time_major,
                    "CleanRL v1.0.0 (_peers.cleanrl_1_0_0) cleanrl/ppo.py's GAE block (torch loop "
                    "over T)",
                    requires=("torch",),
                    convention="time-major (T, B) tensors; a row's end is a done flag",
                ),
                Implementation(
                    "sb3",
                    PEER,
                    adapters.sb3_gae,
                    adapters.pair_time_major,
                    "Stable-Baselines3 2.7.1 (_peers.stable_baselines3_2_7_1) "
                    "RolloutBuffer.compute_returns_and_advantage (NumPy loop over T)",
                    requires=("torch",),
                    convention="time-major (T, B) arrays in the batch's dtype (SB3's buffers are "
                    "float32); a row's end is an episode start",
                ),
                Implementation(
                    "scipy lfilter",
                    PEER,
                    adapters.spinningup_gae,
                    adapters.flat_advantages,
                    "Spinning Up 0.2 (_peers.spinningup_0_2) PPOBuffer.finish_path once per "
                    "trajectory, discount_cumsum by scipy.signal.lfilter",
                    requires=("scipy.signal",),
                    convention="flat buffers of the valid tokens, one trajectory per row; only "
                    "the advantages are compared (Spinning Up's value targets are rewards-to-go)",
                    compare=("advantages",),
                ),
                Implementation(
                    "torchrl gae",
                    PEER,
                    adapters.torchrl_gae(vectorised=False),
                    adapters.torchrl_outputs,
                    "torchrl.objectives.value.functional.generalized_advantage_estimate "
                    "(pytorch/rl, the installed package)",
                    requires=("torch", "torchrl.objectives.value.functional"),
                    convention="[B, T, 1] tensors; done = terminated at a row's last token; its "
                    "discounts are float32 (lmbda * gamma * (~done).int()), so float64 results "
                    "agree to float32 precision",
                    check_dtype=np.float32,
                ),
                Implementation(
                    "torchrl vec_gae",
                    PEER,
                    adapters.torchrl_gae(vectorised=True),
                    adapters.torchrl_outputs,
                    "torchrl.objectives.value.functional.vec_generalized_advantage_estimate "
                    "(pytorch/rl, the installed package)",
                    requires=("torch", "torchrl.objectives.value.functional"),
                    convention="[B, T, 1] tensors; done = terminated at a row's last token",
                ),
            ),
        ),
        Kernel(
            "gae+whiten",
            "GAE, then the advantages whitened over the mask (unbiased variance)",
            reads=("rewards", "values", "mask"),
            writes=2,
            compare=("advantages", "returns"),
            valid_only=True,
            table_kernels=("gae", "moments", "whiten"),
            implementations=(
                *_ours(
                    adapters.ours_gae_whiten,
                    adapters.pair,
                    "gae(...) then whiten(advantages, mask=mask, unbiased=True, out=advantages)",
                ),
                Implementation(
                    "verl",
                    PEER,
                    adapters.verl_gae_whiten,
                    adapters.pair,
                    f"{VERL} compute_gae_advantage_return (GAE, then masked_whiten)",
                    requires=("torch",),
                    convention="verl does not zero the advantages outside the mask; " + _BESSEL,
                    check_dtype=np.float32,
                ),
                Implementation(
                    "trl",
                    PEER,
                    adapters.trl_gae_whiten,
                    adapters.pair,
                    f"{TRL_PPO} step 6, '6. compute advantages and returns'",
                    requires=("torch",),
                    convention=_BESSEL,
                    check_dtype=np.float32,
                ),
            ),
        ),
        Kernel(
            "discounted_returns",
            f"discounted returns (gamma={GAMMA:g}) over right-padded rows",
            reads=("rewards", "mask"),
            writes=1,
            compare=("returns",),
            valid_only=False,
            table_kernels=("discounted_returns",),
            implementations=(
                *_ours(
                    adapters.ours_discounted_returns,
                    adapters.returns_outputs,
                    "discounted_returns(rewards, mask=mask)",
                ),
                _preallocated(
                    adapters.ours_discounted_returns_out,
                    adapters.returns_outputs,
                    "discounted_returns(rewards, mask=mask, out=returns)",
                ),
                Implementation(
                    "verl",
                    PEER,
                    adapters.verl_returns_loop,
                    adapters.returns_outputs,
                    f"{VERL} compute_reinforce_plus_plus_outcome_advantage's loop over T (torch)",
                    requires=("torch",),
                    convention="the running return is in the batch's dtype (float32: it drifts "
                    "by about T * 6e-8 relative)",
                ),
            ),
        ),
        Kernel(
            "reinforce++",
            "REINFORCE++: discounted returns whitened over the mask (unbiased variance)",
            reads=("rewards", "mask"),
            writes=2,
            compare=("advantages", "returns"),
            valid_only=False,
            table_kernels=("discounted_returns", "moments", "whiten"),
            implementations=(
                *_ours(
                    adapters.ours_reinforce_plus_plus,
                    adapters.pair,
                    "reinforce_plus_plus(rewards, mask=mask, unbiased=True)",
                ),
                Implementation(
                    "verl",
                    PEER,
                    adapters.verl_reinforce_plus_plus,
                    adapters.pair,
                    f"{VERL} compute_reinforce_plus_plus_outcome_advantage (the loop over T, "
                    "then masked_whiten)",
                    requires=("torch",),
                    convention=_BESSEL,
                    check_dtype=np.float32,
                ),
            ),
        ),
        Kernel(
            "remax",
            "ReMax: discounted returns minus each row's baseline (gamma=1)",
            reads=("rewards", "scores", "mask"),
            writes=2,
            compare=("advantages", "returns"),
            valid_only=True,
            table_kernels=("remax",),
            implementations=(
                *_ours(
                    adapters.ours_remax,
                    adapters.pair,
                    "remax(rewards, baselines, mask=mask)",
                ),
                Implementation(
                    "verl",
                    PEER,
                    adapters.verl_remax,
                    adapters.pair,
                    f"{VERL} compute_remax_outcome_advantage (reverse cumulative sum in torch)",
                    requires=("torch",),
                ),
            ),
        ),
        Kernel(
            "optimal_token_baseline",
            f"the optimal token baseline over groups of {GROUP_SIZE} adjacent rows "
            "(zero tail, eps 1e-8)",
            reads=("rewards", "old_logprobs", "sum_pi_squared", "mask"),
            writes=2,
            compare=("advantages", "returns"),
            valid_only=True,
            table_kernels=("optimal_token_baseline",),
            implementations=(
                *_ours(
                    adapters.ours_optimal_token_baseline,
                    adapters.pair,
                    "optimal_token_baseline(rewards, old_logprobs, sum_pi_squared, groups, "
                    "mask=mask)",
                ),
                Implementation(
                    "verl",
                    PEER,
                    adapters.verl_optimal_token_baseline(multi_turn=False),
                    adapters.pair,
                    f"{VERL} compute_optimal_token_baseline_advantage (a Python loop over "
                    "groups, torch within)",
                    requires=("torch",),
                ),
                Implementation(
                    "verl tir",
                    PEER,
                    adapters.verl_optimal_token_baseline(multi_turn=True),
                    adapters.pair,
                    f"{VERL} compute_multi_turn_optimal_token_baseline_advantage (Python loops "
                    "over rows and groups)",
                    requires=("torch",),
                ),
            ),
        ),
        Kernel(
            "grpo",
            f"GRPO over groups of {GROUP_SIZE} adjacent rows named by uuid strings (std + "
            f"{adapters.GRPO_EPS:g}, unbiased), on each row's valid tokens",
            reads=("scores", "mask"),
            writes=1,
            compare=("advantages",),
            valid_only=False,
            table_kernels=(),
            implementations=(
                _outcome(
                    "grpo", "uids", f"grpo(scores, uids, mask=mask, eps={adapters.GRPO_EPS:g})"
                ),
                Implementation(
                    "verl loop",
                    PEER,
                    adapters.verl_outcome("compute_grpo_outcome_advantage", "uids"),
                    adapters.first_of_pair,
                    f"{VERL} compute_grpo_outcome_advantage (a Python loop over rows)",
                    requires=("torch",),
                    convention=_TOKEN_SCORES,
                ),
                Implementation(
                    "verl vectorized",
                    PEER,
                    adapters.verl_outcome("compute_grpo_vectorized_outcome_advantage", "uids"),
                    adapters.first_of_pair,
                    f"{VERL} compute_grpo_vectorized_outcome_advantage (np.unique of the uids, "
                    "then torch)",
                    requires=("torch",),
                    convention=_FLOAT32_GROUPS,
                    check_dtype=np.float32,
                ),
                Implementation(
                    "trl",
                    PEER,
                    adapters.trl_outcome("grpo"),
                    adapters.per_row_advantages,
                    f"{TRL_GRPO} advantages (scale_rewards='group'), per row",
                    requires=("torch",),
                    convention=f"groups are {GROUP_SIZE} consecutive rows (TRL's only grouping)",
                ),
            ),
        ),
        Kernel(
            "grpo int ids",
            f"GRPO over groups of {GROUP_SIZE} adjacent rows named by int64 ids (std + "
            f"{adapters.GRPO_EPS:g}), on each row's valid tokens",
            reads=("scores", "group_ids", "mask"),
            writes=1,
            compare=("advantages",),
            valid_only=False,
            table_kernels=(),
            implementations=(
                _outcome(
                    "grpo", "group_ids", f"grpo(scores, ids, mask=mask, eps={adapters.GRPO_EPS:g})"
                ),
                Implementation(
                    "verl vectorized",
                    PEER,
                    adapters.verl_outcome("compute_grpo_vectorized_outcome_advantage", "group_ids"),
                    adapters.first_of_pair,
                    f"{VERL} compute_grpo_vectorized_outcome_advantage (int ids)",
                    requires=("torch",),
                    convention=_FLOAT32_GROUPS,
                    check_dtype=np.float32,
                ),
            ),
        ),
        Kernel(
            "rloo",
            f"RLOO (leave-one-out baseline) over groups of {GROUP_SIZE} adjacent rows named by "
            "uuid strings, on each row's valid tokens",
            reads=("scores", "mask"),
            writes=1,
            compare=("advantages",),
            valid_only=False,
            table_kernels=(),
            implementations=(
                _outcome("rloo", "uids", "rloo(scores, uids, mask=mask)"),
                Implementation(
                    "verl loop",
                    PEER,
                    adapters.verl_outcome("compute_rloo_outcome_advantage", "uids"),
                    adapters.first_of_pair,
                    f"{VERL} compute_rloo_outcome_advantage (a Python loop over rows)",
                    requires=("torch",),
                    convention=_TOKEN_SCORES,
                ),
                Implementation(
                    "verl vectorized",
                    PEER,
                    adapters.verl_outcome("compute_rloo_vectorized_outcome_advantage", "uids"),
                    adapters.first_of_pair,
                    f"{VERL} compute_rloo_vectorized_outcome_advantage (np.unique, bincount)",
                    requires=("torch",),
                    convention=_TOKEN_SCORES,
                ),
                Implementation(
                    "trl",
                    PEER,
                    adapters.trl_outcome("rloo"),
                    adapters.per_row_advantages,
                    f"{TRL_RLOO} advantages (no KL penalty, no clipping), per row",
                    requires=("torch",),
                    convention=f"groups are {GROUP_SIZE} consecutive rows (TRL's only grouping)",
                ),
            ),
        ),
        Kernel(
            "whiten",
            "(x - mean) / sqrt(var + 1e-8) over the mask (population variance)",
            reads=("advantages", "mask"),
            writes=1,
            compare=("whitened",),
            valid_only=True,
            table_kernels=("moments", "whiten"),
            implementations=(
                *_ours(
                    adapters.ours_whiten,
                    lambda whitened: {"whitened": whitened},
                    "whiten(advantages, mask=mask)",
                ),
                Implementation(
                    "openrlhf",
                    PEER,
                    adapters.openrlhf_whiten,
                    lambda whitened: {"whitened": adapters.numpy(whitened)},
                    f"{OPENRLHF} RemoteExperienceMaker.compute_advantages_and_returns's "
                    "normalisation of the advantages",
                    requires=("torch",),
                    convention="rsqrt(max(var, 1e-8)) and no zeroing outside the mask",
                    check_dtype=np.float32,
                ),
            ),
        ),
        Kernel(
            "masked_moments",
            "count, sum and sum of squares over the mask, for a global whitening",
            reads=("advantages", "mask"),
            writes=0,
            compare=("count", "sum", "sum_sq"),
            valid_only=False,
            table_kernels=("moments",),
            implementations=tuple(
                _ours(
                    adapters.ours_moments,
                    adapters.moments_outputs,
                    "masked_moments(advantages, mask=mask)",
                )
            ),
        ),
        Kernel(
            "clipped_surrogate",
            f"clipped surrogate (clip {CLIP:g}, dual clip {DUAL_CLIP:g}, log-ratio clamp "
            f"{LOG_RATIO_CLAMP:g}), token mean, loss and d loss / d logprobs",
            reads=("logprobs", "old_logprobs", "advantages", "mask"),
            writes=1,
            compare=("loss", "grad"),
            valid_only=True,
            table_kernels=("clipped_surrogate",),
            implementations=(
                *_ours(
                    adapters.ours_policy_loss,
                    adapters.loss_outputs,
                    "clipped_surrogate(logp, old, adv, mask=mask, dual_clip=3, log_ratio_clamp=20)",
                ),
                Implementation(
                    "torch autograd",
                    PEER,
                    adapters.trl_policy_loss(compiled=False),
                    adapters.loss_and_grad,
                    f"{TRL_PPO} policy loss (pg_loss), forward + backward",
                    requires=("torch",),
                    convention="no dual clip or clamp: on this batch neither is active "
                    "(|log-ratio| < 1), which the check confirms",
                ),
                Implementation(
                    "torch.compile",
                    PEER,
                    adapters.trl_policy_loss(compiled=True),
                    adapters.loss_and_grad,
                    f"torch.compile of {TRL_PPO} policy loss (pg_loss), forward + backward",
                    requires=("torch",),
                    convention="as torch autograd; compiled on the warm-up call, not timed",
                ),
                Implementation(
                    "verl",
                    PEER,
                    adapters.verl_policy_loss,
                    adapters.loss_and_grad,
                    f"{VERL} compute_policy_loss_vanilla, forward + backward",
                    requires=("torch",),
                ),
            ),
        ),
        _policy_family(
            "reinforce",
            "GPG / REINFORCE (-A log pi), token mean",
            "reinforce_loss(logp, old, adv, mask=mask)",
        ),
        _policy_family(
            "cispo",
            f"CISPO (clip {CLIP:g}, log-ratio clamp {LOG_RATIO_CLAMP:g}), token mean",
            "cispo_loss(logp, old, adv, mask=mask, clip_low=0.2, log_ratio_clamp=20)",
        ),
        _policy_family(
            "sapo",
            "SAPO (tau 1 and 1.05, log-ratio clamp 20), seq-mean-token-mean",
            "sapo_loss(logp, old, adv, mask=mask, agg='seq-mean-token-mean', log_ratio_clamp=20)",
        ),
        _policy_family(
            "gspo",
            f"GSPO (clip {CLIP:g}, sequence log-ratio clamp 10, verl's detached gradient), "
            "seq-mean-token-mean",
            "gspo_loss(logp, old, adv, mask=mask, agg='seq-mean-token-mean', clip_low=0.2, "
            "log_ratio_max=10)",
        ),
        _policy_family(
            "geo_mean",
            f"verl's geometric mean (GMPO, log-ratio clip {CLIP:g}), the mean over the rows",
            "geo_mean_loss(logp, old, adv, mask=mask, clip_low=0.2, num_seqs=B)",
        ),
        _policy_family(
            "dppo",
            "DPPO-Binary-KL (bound 0.2, ratio cap 3, log-ratio clamp 20), token mean",
            "dppo_loss(logp, old, adv, mask=mask, divergence='kl', ratio_cap=3, "
            "log_ratio_clamp=20)",
        ),
        _policy_family(
            "kl_cov",
            "KL-Cov (ratio 0.0002, coef 0.1; the covariance top-k included), token mean",
            "kl_cov_loss(logp, old, adv, kl_cov_selection(logp, adv, mask=mask), coef=0.1, "
            "mask=mask)",
            selection=("kl_cov_top_k",),
        ),
        Kernel(
            "value_loss",
            f"clipped value loss (clip {VALUE_CLIP:g}), token mean, loss and d loss / d values",
            reads=("values", "old_values", "returns", "mask"),
            writes=1,
            compare=("loss", "grad"),
            valid_only=True,
            table_kernels=("value_loss",),
            implementations=(
                *_ours(
                    adapters.ours_value_loss,
                    adapters.loss_outputs,
                    "value_loss(v, v_old, returns, clip=0.2)",
                ),
                Implementation(
                    "torch autograd",
                    PEER,
                    adapters.trl_value_loss(compiled=False),
                    adapters.loss_and_grad,
                    f"{TRL_PPO} value loss (vf_loss), forward + backward",
                    requires=("torch",),
                ),
                Implementation(
                    "torch.compile",
                    PEER,
                    adapters.trl_value_loss(compiled=True),
                    adapters.loss_and_grad,
                    f"torch.compile of {TRL_PPO} value loss (vf_loss), forward + backward",
                    requires=("torch",),
                    convention="compiled on the warm-up call, not timed",
                ),
                Implementation(
                    "verl",
                    PEER,
                    adapters.verl_value_loss,
                    adapters.loss_and_grad,
                    f"{VERL} compute_value_loss, forward + backward",
                    requires=("torch",),
                ),
            ),
        ),
    )
}


def table_entry(table_kernel: str) -> Kernel:
    """The entry of ``KERNELS`` that exercises ``table_kernel`` with the fewest other kernels."""
    entries = [kernel for kernel in KERNELS.values() if table_kernel in kernel.table_kernels]
    if not entries:
        raise KeyError(f"no benchmark entry exercises the table kernel {table_kernel!r}")
    return min(entries, key=lambda kernel: len(kernel.table_kernels))
