"""How each implementation of the comparison table is called: our stages and the peers' code, with
the inputs put in each one's own layout (torch tensors, time-major arrays for CleanRL and
Stable-Baselines3), and their outputs turned into NumPy arrays in ppo_fast's (B, T) layout for
the check. ``prepare(batch, ...)`` returns the zero-argument call that is timed.

The peers' code is the verbatim copies in ``ppo_fast._peers`` (or the real function where its
package imports: TorchRL's GAE); nothing here copies it again. torch, scipy and torchrl are
imported only when a row needs them.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import numpy as np

from .._peers import copy as peer_copy
from .batch import GROUP_SIZE, Batch

# Hyperparameters of every row: verl's defaults for language models.
GAMMA, LAM = 1.0, 0.95
KL_COEF, KL_CLAMP = 0.05, 10.0
CLIP, DUAL_CLIP, LOG_RATIO_CLAMP, VALUE_CLIP = 0.2, 3.0, 20.0, 0.2


def torch_module():
    import torch

    return torch


def tensor(array: np.ndarray):
    return torch_module().from_numpy(array)


def pair(result) -> dict[str, np.ndarray]:
    advantages, returns = result
    return {"advantages": numpy(advantages), "returns": numpy(returns)}


def pair_time_major(result) -> dict[str, np.ndarray]:
    advantages, returns = result
    return {"advantages": numpy(advantages).T, "returns": numpy(returns).T}


def numpy(x) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    return x.detach().numpy()


def loss_and_grad(result) -> dict[str, np.ndarray]:
    loss, grad = result
    return {"loss": np.array(float(loss)), "grad": numpy(grad)}


# kl_penalty ---------------------------------------------------------------------------------


def ours_kl(batch: Batch, backend: str):
    from ..rewards import kl_penalty

    logp, ref = batch.logprobs, batch.ref_logprobs
    return lambda: kl_penalty(logp, ref, "k3", KL_CLAMP, backend=backend)


def verl_kl(batch: Batch, threads: int):
    logp, ref = tensor(batch.logprobs), tensor(batch.ref_logprobs)
    verl = peer_copy("verl_0_9_1")
    return lambda: verl.kl_penalty(logp, ref, "low_var_kl")


# shape_rewards ------------------------------------------------------------------------------


def ours_shape_rewards(batch: Batch, backend: str):
    from ..rewards import shape_rewards

    scores, logp, ref, mask = batch.scores, batch.logprobs, batch.ref_logprobs, batch.mask
    return lambda: shape_rewards(
        scores, logp, ref, kl_coef=KL_COEF, estimator="k3", mask=mask, backend=backend
    )


def trl_shape_rewards(batch: Batch, threads: int):
    trl = peer_copy("trl_0_29_1")
    args = types.SimpleNamespace(kl_estimator="k3", kl_coef=KL_COEF)
    scores = tensor(batch.scores)
    logp, ref = tensor(batch.logprobs), tensor(batch.ref_logprobs)
    values = tensor(batch.values)
    responses = tensor(batch.mask)  # only its shape is read
    # TRL's sequence_lengths: the index of the last valid token
    lengths = tensor(batch.lengths)
    sequence_lengths = lengths - 1
    return lambda: (
        trl.ppo_trainer_rewards(args, responses, sequence_lengths, logp, ref, values, scores),
        lengths,
    )


def trl_rewards_outputs(result) -> dict[str, np.ndarray]:
    """TRL adds the score one token past the last valid one (at the last column when the row is
    full): moved back onto the last valid token, where ppo_fast puts it."""
    block, lengths = result
    rewards, lengths = numpy(block.rewards).copy(), numpy(lengths)
    rows = np.flatnonzero(lengths < rewards.shape[1])
    rewards[rows, lengths[rows] - 1] += rewards[rows, lengths[rows]]
    rewards[rows, lengths[rows]] = 0
    return {"rewards": rewards}


# gae ----------------------------------------------------------------------------------------


def ours_gae(batch: Batch, backend: str):
    from ..gae import gae

    rewards, values, mask = batch.rewards, batch.values, batch.mask
    return lambda: gae(rewards, values, gamma=GAMMA, lam=LAM, mask=mask, backend=backend)


def ours_gae_out(batch: Batch, threads: int):
    """gae into preallocated outputs (``out=``), as a trainer that keeps its buffers calls it."""
    from ..gae import gae

    rewards, values, mask = batch.rewards, batch.values, batch.mask
    out = (np.zeros_like(rewards), np.zeros_like(rewards))  # touched before the timing
    return lambda: gae(rewards, values, gamma=GAMMA, lam=LAM, mask=mask, out=out)


def gae_outputs(result) -> dict[str, np.ndarray]:
    return {"advantages": result.advantages, "returns": result.returns}


def openrlhf_gae(batch: Batch, threads: int):
    values, rewards = tensor(batch.values), tensor(batch.rewards)
    action_mask = tensor(batch.mask)
    openrlhf = peer_copy("openrlhf_0_11_2")
    # a method that never reads self
    return lambda: openrlhf.get_advantages_and_returns(
        None, values, rewards, action_mask, GAMMA, LAM
    )


def episode_start_flags(batch: Batch) -> np.ndarray:
    """Time-major (T, B): 1 where a step starts a new episode, the step after each row's end."""
    starts = np.zeros((batch.shape[1], batch.shape[0]), dtype=batch.dtype)
    inside = batch.lengths < batch.shape[1]
    starts[batch.lengths[inside], np.flatnonzero(inside)] = 1
    return starts


def cleanrl_gae(batch: Batch, threads: int):
    torch = torch_module()
    cleanrl = peer_copy("cleanrl_1_0_0")
    rows, width = batch.shape
    args = types.SimpleNamespace(num_steps=width, gamma=GAMMA, gae_lambda=LAM)
    # the state after the last step is terminal: its value is never used
    agent = types.SimpleNamespace(get_value=lambda obs: torch.zeros(rows, dtype=values.dtype))
    rewards = tensor(np.ascontiguousarray(batch.rewards.T))
    values = tensor(np.ascontiguousarray(batch.values.T))
    dones = tensor(episode_start_flags(batch))
    next_done = torch.ones(rows, dtype=rewards.dtype)
    return lambda: cleanrl.ppo_advantages(
        args, agent, None, next_done, rewards, dones, values, "cpu"
    )


def sb3_gae(batch: Batch, threads: int):
    torch = torch_module()
    sb3 = peer_copy("stable_baselines3_2_7_1")
    rewards = np.ascontiguousarray(batch.rewards.T)
    values = np.ascontiguousarray(batch.values.T)
    episode_starts = episode_start_flags(batch)
    last_values = torch.zeros(batch.shape[0], dtype=tensor(rewards).dtype)
    dones = np.ones(batch.shape[0], dtype=bool)

    def run():
        # RolloutBuffer.reset allocates the advantages; its buffers take the batch's dtype here
        buffer = types.SimpleNamespace(
            buffer_size=rewards.shape[0],
            rewards=rewards,
            values=values,
            episode_starts=episode_starts,
            advantages=np.zeros(rewards.shape, dtype=rewards.dtype),
            gamma=GAMMA,
            gae_lambda=LAM,
        )
        sb3.compute_returns_and_advantage(buffer, last_values, dones)
        return buffer.advantages, buffer.returns

    return run


def spinningup_gae(batch: Batch, threads: int):
    spinningup = peer_copy("spinningup_0_2")
    mask, lengths = batch.mask, batch.lengths
    rewards, values = batch.rewards[mask], batch.values[mask]  # the trajectories, one after another

    def run():
        buffer = types.SimpleNamespace(
            rew_buf=rewards,
            val_buf=values,
            adv_buf=np.zeros_like(rewards),
            ret_buf=np.zeros_like(rewards),
            gamma=GAMMA,
            lam=LAM,
            path_start_idx=0,
            ptr=0,
        )
        for length in lengths:  # PPOBuffer.finish_path at the end of each trajectory
            buffer.ptr += int(length)
            spinningup.finish_path(buffer, 0)
        return buffer.adv_buf, mask

    return run


def flat_advantages(result) -> dict[str, np.ndarray]:
    advantages, mask = result
    padded = np.zeros(mask.shape, dtype=advantages.dtype)
    padded[mask] = advantages
    return {"advantages": padded}


def torchrl_inputs(batch: Batch):
    """TorchRL's layout: [B, T, 1] tensors, the next state's value, done = terminated.

    A row ends at its last valid token; its padding (all zeros) is one more trajectory, ended at
    T - 1. (Ending every padding position would make vec_generalized_advantage_estimate pad one
    trajectory per position to length T: B * T * T elements.)
    """
    next_values = np.zeros_like(batch.values)
    next_values[:, :-1] = batch.values[:, 1:]
    positions = np.arange(batch.shape[1])
    done = (positions == batch.lengths[:, None] - 1) | (positions == batch.shape[1] - 1)
    return (
        tensor(batch.values[..., None]),
        tensor(next_values[..., None]),
        tensor(batch.rewards[..., None]),
        tensor(done[..., None]),
    )


def torchrl_gae(vectorised: bool):
    def prepare(batch: Batch, threads: int):
        from torchrl.objectives.value import functional

        estimate = (
            functional.vec_generalized_advantage_estimate
            if vectorised
            else functional.generalized_advantage_estimate
        )
        value, next_value, reward, done = torchrl_inputs(batch)
        return lambda: estimate(GAMMA, LAM, value, next_value, reward, done, done)

    return prepare


def torchrl_outputs(result) -> dict[str, np.ndarray]:
    advantage, value_target = result
    return {"advantages": numpy(advantage)[..., 0], "returns": numpy(value_target)[..., 0]}


# gae + whiten -------------------------------------------------------------------------------


def ours_gae_whiten(batch: Batch, backend: str):
    from ..gae import gae
    from ..whiten import whiten

    rewards, values, mask = batch.rewards, batch.values, batch.mask

    def run():
        advantages, returns = gae(rewards, values, gamma=GAMMA, lam=LAM, mask=mask, backend=backend)
        # in place, as verl's compat entry whitens: the advantages are this call's own array
        whiten(advantages, mask=mask, unbiased=True, out=advantages, backend=backend)
        return advantages, returns

    return run


def verl_gae_whiten(batch: Batch, threads: int):
    rewards, values = tensor(batch.rewards), tensor(batch.values)
    # verl's response_mask is a slice of the int64 attention mask.
    response_mask = tensor(batch.mask.astype(np.int64))
    verl = peer_copy("verl_0_9_1")
    return lambda: verl.compute_gae_advantage_return(rewards, values, response_mask, GAMMA, LAM)


def trl_gae_whiten(batch: Batch, threads: int):
    rewards, values = tensor(batch.rewards), tensor(batch.values)
    padding_mask = tensor(~batch.mask)
    responses = padding_mask  # only its shape is read
    trl = peer_copy("trl_0_29_1")
    args = types.SimpleNamespace(gamma=GAMMA, lam=LAM)
    return lambda: trl.ppo_trainer_gae(args, responses, rewards, values, padding_mask)


# discounted_returns, reinforce++, remax, optimal_token_baseline ------------------------------


def ours_discounted_returns(batch: Batch, backend: str):
    from ..returns import discounted_returns

    rewards, mask = batch.rewards, batch.mask
    return lambda: discounted_returns(rewards, gamma=GAMMA, mask=mask, backend=backend)


def ours_discounted_returns_out(batch: Batch, threads: int):
    """discounted_returns into a preallocated output (``out=``)."""
    from ..returns import discounted_returns

    rewards, mask = batch.rewards, batch.mask
    out = np.zeros_like(rewards)  # touched before the timing
    return lambda: discounted_returns(rewards, gamma=GAMMA, mask=mask, out=out)


def returns_outputs(returns) -> dict[str, np.ndarray]:
    return {"returns": numpy(returns)}


def verl_returns_loop(batch: Batch, threads: int):
    # verl's response_mask is a slice of the int64 attention mask.
    rewards, response_mask = tensor(batch.rewards), tensor(batch.mask.astype(np.int64))
    verl = peer_copy("verl_0_9_1")
    return lambda: verl.reinforce_plus_plus_returns(rewards, response_mask, GAMMA)


def ours_reinforce_plus_plus(batch: Batch, backend: str):
    from ..returns import reinforce_plus_plus

    rewards, mask = batch.rewards, batch.mask
    return lambda: reinforce_plus_plus(
        rewards, gamma=GAMMA, mask=mask, unbiased=True, backend=backend
    )


def verl_reinforce_plus_plus(batch: Batch, threads: int):
    rewards, response_mask = tensor(batch.rewards), tensor(batch.mask.astype(np.int64))
    verl = peer_copy("verl_0_9_1")
    config = types.SimpleNamespace(gamma=GAMMA)
    return lambda: verl.compute_reinforce_plus_plus_outcome_advantage(
        rewards, response_mask, config
    )


def ours_remax(batch: Batch, backend: str):
    from ..returns import remax

    rewards, baselines, mask = batch.rewards, batch.scores, batch.mask
    return lambda: remax(rewards, baselines, mask=mask, backend=backend)


def verl_remax(batch: Batch, threads: int):
    rewards, baselines = tensor(batch.rewards), tensor(batch.scores)
    response_mask = tensor(batch.mask.astype(np.int64))
    verl = peer_copy("verl_0_9_1")
    return lambda: verl.compute_remax_outcome_advantage(rewards, baselines, response_mask)


def sum_pi_squared(batch: Batch) -> np.ndarray:
    """A stand-in for the sum over the vocabulary of the squared probabilities: pi^2 + 0.1 (at
    least pi^2, as a softmax's), 0 past a row's end as every array of the batch."""
    pi_squared = np.exp(2 * batch.old_logprobs)
    return (pi_squared + batch.dtype.type(0.1)) * batch.mask


def ours_optimal_token_baseline(batch: Batch, backend: str):
    from ..returns import optimal_token_baseline

    rewards, old_logprobs, mask = batch.rewards, batch.old_logprobs, batch.mask
    squares, groups = sum_pi_squared(batch), batch.group_ids
    return lambda: optimal_token_baseline(
        rewards, old_logprobs, squares, groups, mask=mask, backend=backend
    )


def verl_optimal_token_baseline(multi_turn: bool):
    def prepare(batch: Batch, threads: int):
        verl = peer_copy("verl_0_9_1")
        estimate = (
            verl.compute_multi_turn_optimal_token_baseline_advantage
            if multi_turn
            else verl.compute_optimal_token_baseline_advantage
        )
        rewards, old_logprobs = tensor(batch.rewards), tensor(batch.old_logprobs)
        response_mask = tensor(batch.mask.astype(np.int64))
        squares, index = tensor(sum_pi_squared(batch)), batch.group_ids
        return lambda: estimate(rewards, response_mask, index, old_logprobs, squares)

    return prepare


# grpo, rloo: outcome estimators over groups ---------------------------------------------------


# TRL's epsilon, hard-coded in its GRPO block; verl's functions and ours take it as an argument.
GRPO_EPS = 1e-4


def ours_outcome(estimator: str, labels: str):
    def prepare(batch: Batch, threads: int):
        from .. import outcome

        estimate = getattr(outcome, estimator)
        scores, groups, mask = batch.scores, getattr(batch, labels), batch.mask
        options = {"eps": GRPO_EPS} if estimator == "grpo" else {}
        return lambda: estimate(scores, groups, mask=mask, **options)

    return prepare


def advantages_output(advantages) -> dict[str, np.ndarray]:
    return {"advantages": numpy(advantages)}


def first_of_pair(result) -> dict[str, np.ndarray]:
    return {"advantages": numpy(result[0])}


def token_level_scores(batch: Batch) -> np.ndarray:
    """Each row's score on its last valid token, 0 elsewhere: verl's token_level_rewards of an
    outcome reward (its estimators sum them back over T)."""
    rewards = np.zeros(batch.shape, dtype=batch.dtype)
    rewards[np.arange(batch.shape[0]), batch.lengths - 1] = batch.scores
    return rewards


def verl_outcome(function: str, labels: str):
    def prepare(batch: Batch, threads: int):
        estimate = getattr(peer_copy("verl_0_9_1"), function)
        rewards = tensor(token_level_scores(batch))
        # verl's response_mask is a slice of the int64 attention mask.
        response_mask, index = tensor(batch.mask.astype(np.int64)), getattr(batch, labels)
        options = {"epsilon": GRPO_EPS} if "grpo" in function else {}
        return lambda: estimate(rewards, response_mask, index, **options)

    return prepare


def trl_outcome(estimator: str):
    """TRL's GRPO (scale_rewards="group") or RLOO advantage block: one reward function, groups
    of ``GROUP_SIZE`` consecutive rows (TRL's only grouping), per-row advantages."""

    def prepare(batch: Batch, threads: int):
        torch = torch_module()
        trl = peer_copy("trl_0_29_1")
        mask = batch.mask  # returned beside the result, for the check on the tokens
        # TRL's groups are consecutive blocks of num_generations rows; a batch smaller than one
        # group is one group, as batch.group_ids has it.
        n = min(GROUP_SIZE, batch.shape[0])
        if batch.shape[0] % n:
            raise ValueError(
                f"TRL groups rows in blocks of num_generations={n}: B={batch.shape[0]} is not a "
                "multiple of it"
            )
        rewards_per_func = tensor(batch.scores.reshape(-1, 1))
        weights = torch.ones(1, dtype=rewards_per_func.dtype)
        if estimator == "grpo":
            trainer = types.SimpleNamespace(
                multi_objective_aggregation="sum_then_normalize",
                reward_weights=weights,
                scale_rewards="group",
                reward_funcs=[None],
            )
            return lambda: (
                trl.grpo_trainer_advantages(trainer, rewards_per_func, n, "cpu").advantages,
                mask,
            )
        trainer = types.SimpleNamespace(
            reward_weights=weights, reward_clip_range=None, beta=0.0, normalize_advantages=False
        )
        empty = tensor(np.zeros((batch.shape[0], 1), dtype=batch.dtype))
        return lambda: (
            trl.rloo_trainer_advantages(
                trainer, rewards_per_func, n, "cpu", empty, empty, empty
            ).advantages,
            mask,
        )

    return prepare


def per_row_advantages(result) -> dict[str, np.ndarray]:
    """TRL's (B,) advantages put on the tokens for the check, as its loss broadcasts them."""
    advantages, mask = result
    return {"advantages": numpy(advantages)[:, None] * mask}


# whiten, masked_moments ---------------------------------------------------------------------


def ours_whiten(batch: Batch, backend: str):
    from ..whiten import whiten

    advantages, mask = batch.advantages, batch.mask
    return lambda: whiten(advantages, mask=mask, backend=backend)


def openrlhf_whiten(batch: Batch, threads: int):
    openrlhf = peer_copy("openrlhf_0_11_2")
    advantage = types.SimpleNamespace(estimator="gae", no_std_norm=False)
    args = types.SimpleNamespace(algo=types.SimpleNamespace(advantage=advantage))
    advantages, action_mask = tensor(batch.advantages), tensor(batch.mask)

    def run():
        experience = types.SimpleNamespace(advantages=advantages, action_mask=action_mask)
        return openrlhf.normalize_advantages(args, [experience])[0].advantages

    return run


def ours_moments(batch: Batch, backend: str):
    from ..whiten import masked_moments

    advantages, mask = batch.advantages, batch.mask
    return lambda: masked_moments(advantages, mask=mask, backend=backend)


def moments_outputs(moments) -> dict[str, np.ndarray]:
    return {
        "count": np.array(moments.count),
        "sum": np.array(moments.sum),
        "sum_sq": np.array(moments.sum_sq),
    }


# clipped_surrogate, value_loss --------------------------------------------------------------


def ours_policy_loss(batch: Batch, backend: str):
    from ..loss import clipped_surrogate

    logp, old, adv, mask = batch.logprobs, batch.old_logprobs, batch.advantages, batch.mask
    return lambda: clipped_surrogate(
        logp,
        old,
        adv,
        mask=mask,
        clip_low=CLIP,
        dual_clip=DUAL_CLIP,
        log_ratio_clamp=LOG_RATIO_CLAMP,
        backend=backend,
    )


def ours_value_loss(batch: Batch, backend: str):
    from ..loss import value_loss

    values, old, returns, mask = batch.values, batch.old_values, batch.returns, batch.mask
    return lambda: value_loss(values, old, returns, mask=mask, clip=VALUE_CLIP, backend=backend)


def loss_outputs(result) -> dict[str, np.ndarray]:
    return {"loss": np.array(result.loss), "grad": result.grad}


def backward(loss_of: Callable, leaf_array: np.ndarray):
    """loss_of(leaf) -> loss; returns a call doing forward + backward on a fresh leaf."""
    leaf = tensor(leaf_array)

    def run():
        trained = leaf.detach().requires_grad_(True)
        loss = loss_of(trained)
        loss.backward()
        return loss.detach(), trained.grad

    return run


@functools.cache
def torch_compiled(function: Callable) -> Callable:
    return torch_module().compile(function)


def trl_policy_loss(compiled: bool):
    def prepare(batch: Batch, threads: int):
        trl = peer_copy("trl_0_29_1")
        loss = (
            torch_compiled(trl.ppo_trainer_policy_loss) if compiled else trl.ppo_trainer_policy_loss
        )
        args = types.SimpleNamespace(cliprange=CLIP)
        old, adv = tensor(batch.old_logprobs), tensor(batch.advantages)
        padding_mask = tensor(~batch.mask)
        return backward(
            lambda logp: loss(args, logp, old, adv, padding_mask, slice(None)), batch.logprobs
        )

    return prepare


# The policy-loss family: GPG (REINFORCE), CISPO, SAPO, GSPO, the geometric mean, DPPO and
# KL-Cov, as verl 0.9.1 registers them.
SAPO_TAU_POS, SAPO_TAU_NEG = 1.0, 1.05  # verl's defaults
FAMILY_AGG = {
    "reinforce": "token-mean",
    "cispo": "token-mean",
    "sapo": "seq-mean-token-mean",
    "gspo": "seq-mean-token-mean",  # what verl recommends for GSPO
    "geo_mean": "seq-mean-token-mean",  # verl's mean over the rows (its loss_agg_mode unread)
    "dppo": "token-mean",
    "kl_cov": "token-mean",
}
FAMILY_VERL = {
    "reinforce": "compute_policy_loss_gpg",
    "cispo": "compute_policy_loss_cispo",
    "sapo": "compute_policy_loss_sapo",
    "gspo": "compute_policy_loss_gspo",
    "geo_mean": "compute_policy_loss_geo_mean",
    "dppo": "compute_policy_loss_dppo_kl",
    "kl_cov": "compute_policy_loss_kl_cov",
}
# DPPO-KL's settings on verl's ActorConfig (clip_ratio 0.2 as the divergence bound, its cap
# clip_ratio_c = 3) and KL-Cov's PolicyLossConfig defaults (kl_cov_ratio, ppo_kl_coef).
DPPO_CAP = 3.0
KL_COV_RATIO, KL_COV_COEF = 0.0002, 0.1


def ours_policy_family(loss: str):
    """ppo_fast's loss of the family with verl's settings (log-ratio clamp 20 where verl has
    one, GSPO's at 10 on the sequence log-ratio), aggregated as verl aggregates it."""

    def prepare(batch: Batch, backend: str):
        from .. import policy

        logp, old, adv, mask = batch.logprobs, batch.old_logprobs, batch.advantages, batch.mask
        options: dict[str, Any] = {"agg": FAMILY_AGG[loss], "backend": backend, "mask": mask}
        if loss == "cispo":
            options.update(clip_low=CLIP, log_ratio_clamp=LOG_RATIO_CLAMP)
        elif loss == "sapo":
            options.update(tau_pos=SAPO_TAU_POS, tau_neg=SAPO_TAU_NEG, log_ratio_clamp=20.0)
        elif loss == "gspo":
            options.update(form="detached", clip_low=CLIP, log_ratio_max=10.0)
        elif loss == "geo_mean":  # every row counted, as verl's torch.mean
            options.update(clip_low=CLIP, num_seqs=float(mask.shape[0]))
        elif loss == "dppo":
            options.update(
                divergence="kl", divergence_low=CLIP, ratio_cap=DPPO_CAP, log_ratio_clamp=20.0
            )
        elif loss == "kl_cov":
            from .. import covariance

            def run():  # the selection is part of the loss, as in verl's function
                picked = covariance.kl_cov_selection(
                    logp, adv, ratio=KL_COV_RATIO, mask=mask, backend=backend
                )
                return policy.kl_cov_loss(logp, old, adv, picked, coef=KL_COV_COEF, **options)

            return run
        function = getattr(policy, f"{loss}_loss")
        return lambda: function(logp, old, adv, **options)

    return prepare


def verl_policy_family(loss: str, compiled: bool):
    """verl's registered loss, forward + backward (torch.compile'd when ``compiled``)."""

    def prepare(batch: Batch, threads: int):
        verl = peer_copy("verl_0_9_1")
        function = getattr(verl, FAMILY_VERL[loss])
        if compiled:
            function = torch_compiled(function)
        old, adv = tensor(batch.old_logprobs), tensor(batch.advantages)
        response_mask = tensor(batch.mask.astype(np.int64))
        config = verl.ActorConfig(
            clip_ratio=CLIP,
            clip_ratio_low=CLIP,
            clip_ratio_high=CLIP,
            tau_pos=SAPO_TAU_POS,
            tau_neg=SAPO_TAU_NEG,
        )
        return backward(
            lambda logp: function(old, logp, adv, response_mask, FAMILY_AGG[loss], config)[0],
            batch.logprobs,
        )

    return prepare


def verl_policy_loss(batch: Batch, threads: int):
    verl = peer_copy("verl_0_9_1")
    old, adv = tensor(batch.old_logprobs), tensor(batch.advantages)
    response_mask = tensor(batch.mask.astype(np.int64))
    config = verl.ActorConfig(
        clip_ratio=CLIP, clip_ratio_low=CLIP, clip_ratio_high=CLIP, clip_ratio_c=DUAL_CLIP
    )
    return backward(
        lambda logp: verl.compute_policy_loss_vanilla(
            old, logp, adv, response_mask, "token-mean", config
        )[0],
        batch.logprobs,
    )


def trl_value_loss(compiled: bool):
    def prepare(batch: Batch, threads: int):
        trl = peer_copy("trl_0_29_1")
        loss = (
            torch_compiled(trl.ppo_trainer_value_loss) if compiled else trl.ppo_trainer_value_loss
        )
        args = types.SimpleNamespace(cliprange_value=VALUE_CLIP)
        old, returns = tensor(batch.old_values), tensor(batch.returns)
        padding_mask_p1 = tensor(~batch.mask)
        return backward(
            lambda values: loss(args, values, old, returns, padding_mask_p1, slice(None))[0],
            batch.values,
        )

    return prepare


def verl_value_loss(batch: Batch, threads: int):
    verl = peer_copy("verl_0_9_1")
    old, returns = tensor(batch.old_values), tensor(batch.returns)
    response_mask = tensor(batch.mask.astype(np.int64))
    return backward(
        lambda values: verl.compute_value_loss(values, returns, old, response_mask, VALUE_CLIP)[0],
        batch.values,
    )
