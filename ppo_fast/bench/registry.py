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
  timed, so that a benchmark never compares different computations.

Times are of whole calls, with inputs already in each implementation's own layout: conversions
are not timed, output allocation is. torch, scipy and torchrl are imported only when a row needs
them.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _backend, _spec
from .._peers import copy as peer_copy
from .batch import Batch
from .roofline import COPY_BYTES, COPY_REPEATS, Copy

OURS, PEER, FLOOR = "ours", "peer", "floor"
BENCH_EXTRA = "pip install 'ppo_fast[bench]'"

# Hyperparameters of every row: verl's defaults for language models.
GAMMA, LAM = 1.0, 0.95
KL_COEF, KL_CLAMP = 0.05, 10.0
CLIP, DUAL_CLIP, LOG_RATIO_CLAMP, VALUE_CLIP = 0.2, 3.0, 20.0, 0.2

# The oracle is a Python loop per token: it runs on batches up to this size only.
PYTHON_MAX_TOKENS = 1 << 16

# Relative tolerance of a peer against ppo_fast, on the scale of the output (as in tests/).
CHECK_RTOL = {np.dtype(np.float32): 2e-4, np.dtype(np.float64): 1e-9}

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


def _torch():
    import torch

    return torch


def _tensor(array: np.ndarray):
    return _torch().from_numpy(array)


def _pair(result) -> dict[str, np.ndarray]:
    advantages, returns = result
    return {"advantages": _numpy(advantages), "returns": _numpy(returns)}


def _pair_time_major(result) -> dict[str, np.ndarray]:
    advantages, returns = result
    return {"advantages": _numpy(advantages).T, "returns": _numpy(returns).T}


def _numpy(x) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    return x.detach().numpy()


def _loss_and_grad(result) -> dict[str, np.ndarray]:
    loss, grad = result
    return {"loss": np.array(float(loss)), "grad": _numpy(grad)}


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


# kl_penalty ---------------------------------------------------------------------------------


def _ours_kl(batch: Batch, backend: str):
    from ..rewards import kl_penalty

    logp, ref = batch.logprobs, batch.ref_logprobs
    return lambda: kl_penalty(logp, ref, "k3", KL_CLAMP, backend=backend)


def _verl_kl(batch: Batch, threads: int):
    logp, ref = _tensor(batch.logprobs), _tensor(batch.ref_logprobs)
    verl = peer_copy("verl_0_9_1")
    return lambda: verl.kl_penalty(logp, ref, "low_var_kl")


# shape_rewards ------------------------------------------------------------------------------


def _ours_shape_rewards(batch: Batch, backend: str):
    from ..rewards import shape_rewards

    scores, logp, ref, mask = batch.scores, batch.logprobs, batch.ref_logprobs, batch.mask
    return lambda: shape_rewards(
        scores, logp, ref, kl_coef=KL_COEF, estimator="k3", mask=mask, backend=backend
    )


def _trl_shape_rewards(batch: Batch, threads: int):
    trl = peer_copy("trl_0_29_1")
    args = types.SimpleNamespace(kl_estimator="k3", kl_coef=KL_COEF)
    scores = _tensor(batch.scores)
    logp, ref = _tensor(batch.logprobs), _tensor(batch.ref_logprobs)
    values = _tensor(batch.values)
    responses = _tensor(batch.mask)  # only its shape is read
    # TRL's sequence_lengths: the index of the last valid token
    lengths = _tensor(batch.lengths)
    sequence_lengths = lengths - 1
    return lambda: (
        trl.ppo_trainer_rewards(args, responses, sequence_lengths, logp, ref, values, scores),
        lengths,
    )


def _trl_rewards_outputs(result) -> dict[str, np.ndarray]:
    """TRL adds the score one token past the last valid one (at the last column when the row is
    full): moved back onto the last valid token, where ppo_fast puts it."""
    block, lengths = result
    rewards, lengths = _numpy(block.rewards).copy(), _numpy(lengths)
    rows = np.flatnonzero(lengths < rewards.shape[1])
    rewards[rows, lengths[rows] - 1] += rewards[rows, lengths[rows]]
    rewards[rows, lengths[rows]] = 0
    return {"rewards": rewards}


# gae ----------------------------------------------------------------------------------------


def _ours_gae(batch: Batch, backend: str):
    from ..gae import gae

    rewards, values, mask = batch.rewards, batch.values, batch.mask
    return lambda: gae(rewards, values, gamma=GAMMA, lam=LAM, mask=mask, backend=backend)


def _gae_outputs(result) -> dict[str, np.ndarray]:
    return {"advantages": result.advantages, "returns": result.returns}


def _openrlhf_gae(batch: Batch, threads: int):
    values, rewards = _tensor(batch.values), _tensor(batch.rewards)
    action_mask = _tensor(batch.mask)
    openrlhf = peer_copy("openrlhf_0_11_2")
    # a method that never reads self
    return lambda: openrlhf.get_advantages_and_returns(
        None, values, rewards, action_mask, GAMMA, LAM
    )


def _episode_starts(batch: Batch) -> np.ndarray:
    """Time-major (T, B): 1 where a step starts a new episode, the step after each row's end."""
    starts = np.zeros((batch.shape[1], batch.shape[0]), dtype=batch.dtype)
    inside = batch.lengths < batch.shape[1]
    starts[batch.lengths[inside], np.flatnonzero(inside)] = 1
    return starts


def _cleanrl_gae(batch: Batch, threads: int):
    torch = _torch()
    cleanrl = peer_copy("cleanrl_1_0_0")
    rows, width = batch.shape
    args = types.SimpleNamespace(num_steps=width, gamma=GAMMA, gae_lambda=LAM)
    # the state after the last step is terminal: its value is never used
    agent = types.SimpleNamespace(get_value=lambda obs: torch.zeros(rows, dtype=values.dtype))
    rewards = _tensor(np.ascontiguousarray(batch.rewards.T))
    values = _tensor(np.ascontiguousarray(batch.values.T))
    dones = _tensor(_episode_starts(batch))
    next_done = torch.ones(rows, dtype=rewards.dtype)
    return lambda: cleanrl.ppo_advantages(
        args, agent, None, next_done, rewards, dones, values, "cpu"
    )


def _sb3_gae(batch: Batch, threads: int):
    torch = _torch()
    sb3 = peer_copy("stable_baselines3_2_7_1")
    rewards = np.ascontiguousarray(batch.rewards.T)
    values = np.ascontiguousarray(batch.values.T)
    episode_starts = _episode_starts(batch)
    last_values = torch.zeros(batch.shape[0], dtype=_tensor(rewards).dtype)
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


def _spinningup_gae(batch: Batch, threads: int):
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


def _flat_advantages(result) -> dict[str, np.ndarray]:
    advantages, mask = result
    padded = np.zeros(mask.shape, dtype=advantages.dtype)
    padded[mask] = advantages
    return {"advantages": padded}


def _torchrl_inputs(batch: Batch):
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
        _tensor(batch.values[..., None]),
        _tensor(next_values[..., None]),
        _tensor(batch.rewards[..., None]),
        _tensor(done[..., None]),
    )


def _torchrl_gae(vectorised: bool):
    def prepare(batch: Batch, threads: int):
        from torchrl.objectives.value import functional

        estimate = (
            functional.vec_generalized_advantage_estimate
            if vectorised
            else functional.generalized_advantage_estimate
        )
        value, next_value, reward, done = _torchrl_inputs(batch)
        return lambda: estimate(GAMMA, LAM, value, next_value, reward, done, done)

    return prepare


def _torchrl_outputs(result) -> dict[str, np.ndarray]:
    advantage, value_target = result
    return {"advantages": _numpy(advantage)[..., 0], "returns": _numpy(value_target)[..., 0]}


# gae + whiten -------------------------------------------------------------------------------


def _ours_gae_whiten(batch: Batch, backend: str):
    from ..gae import gae
    from ..whiten import whiten

    rewards, values, mask = batch.rewards, batch.values, batch.mask

    def run():
        result = gae(rewards, values, gamma=GAMMA, lam=LAM, mask=mask, backend=backend)
        return whiten(result.advantages, mask=mask, unbiased=True, backend=backend), result.returns

    return run


def _verl_gae_whiten(batch: Batch, threads: int):
    rewards, values = _tensor(batch.rewards), _tensor(batch.values)
    # verl's response_mask is a slice of the int64 attention mask.
    response_mask = _tensor(batch.mask.astype(np.int64))
    verl = peer_copy("verl_0_9_1")
    return lambda: verl.compute_gae_advantage_return(rewards, values, response_mask, GAMMA, LAM)


def _trl_gae_whiten(batch: Batch, threads: int):
    rewards, values = _tensor(batch.rewards), _tensor(batch.values)
    padding_mask = _tensor(~batch.mask)
    responses = padding_mask  # only its shape is read
    trl = peer_copy("trl_0_29_1")
    args = types.SimpleNamespace(gamma=GAMMA, lam=LAM)
    return lambda: trl.ppo_trainer_gae(args, responses, rewards, values, padding_mask)


# whiten, masked_moments ---------------------------------------------------------------------


def _ours_whiten(batch: Batch, backend: str):
    from ..whiten import whiten

    advantages, mask = batch.advantages, batch.mask
    return lambda: whiten(advantages, mask=mask, backend=backend)


def _openrlhf_whiten(batch: Batch, threads: int):
    openrlhf = peer_copy("openrlhf_0_11_2")
    advantage = types.SimpleNamespace(estimator="gae", no_std_norm=False)
    args = types.SimpleNamespace(algo=types.SimpleNamespace(advantage=advantage))
    advantages, action_mask = _tensor(batch.advantages), _tensor(batch.mask)

    def run():
        experience = types.SimpleNamespace(advantages=advantages, action_mask=action_mask)
        return openrlhf.normalize_advantages(args, [experience])[0].advantages

    return run


def _ours_moments(batch: Batch, backend: str):
    from ..whiten import masked_moments

    advantages, mask = batch.advantages, batch.mask
    return lambda: masked_moments(advantages, mask=mask, backend=backend)


def _moments_outputs(moments) -> dict[str, np.ndarray]:
    return {
        "count": np.array(moments.count),
        "sum": np.array(moments.sum),
        "sum_sq": np.array(moments.sum_sq),
    }


# clipped_surrogate, value_loss --------------------------------------------------------------


def _ours_policy_loss(batch: Batch, backend: str):
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


def _ours_value_loss(batch: Batch, backend: str):
    from ..loss import value_loss

    values, old, returns, mask = batch.values, batch.old_values, batch.returns, batch.mask
    return lambda: value_loss(values, old, returns, mask=mask, clip=VALUE_CLIP, backend=backend)


def _loss_outputs(result) -> dict[str, np.ndarray]:
    return {"loss": np.array(result.loss), "grad": result.grad}


def _backward(loss_of: Callable, leaf_array: np.ndarray):
    """loss_of(leaf) -> loss; returns a call doing forward + backward on a fresh leaf."""
    leaf = _tensor(leaf_array)

    def run():
        trained = leaf.detach().requires_grad_(True)
        loss = loss_of(trained)
        loss.backward()
        return loss.detach(), trained.grad

    return run


@functools.cache
def _compiled(function: Callable) -> Callable:
    return _torch().compile(function)


def _trl_policy_loss(compiled: bool):
    def prepare(batch: Batch, threads: int):
        trl = peer_copy("trl_0_29_1")
        loss = _compiled(trl.ppo_trainer_policy_loss) if compiled else trl.ppo_trainer_policy_loss
        args = types.SimpleNamespace(cliprange=CLIP)
        old, adv = _tensor(batch.old_logprobs), _tensor(batch.advantages)
        padding_mask = _tensor(~batch.mask)
        return _backward(
            lambda logp: loss(args, logp, old, adv, padding_mask, slice(None)), batch.logprobs
        )

    return prepare


def _verl_policy_loss(batch: Batch, threads: int):
    verl = peer_copy("verl_0_9_1")
    old, adv = _tensor(batch.old_logprobs), _tensor(batch.advantages)
    response_mask = _tensor(batch.mask.astype(np.int64))
    config = verl.ActorConfig(
        clip_ratio=CLIP, clip_ratio_low=CLIP, clip_ratio_high=CLIP, clip_ratio_c=DUAL_CLIP
    )
    return _backward(
        lambda logp: verl.compute_policy_loss_vanilla(
            old, logp, adv, response_mask, "token-mean", config
        )[0],
        batch.logprobs,
    )


def _trl_value_loss(compiled: bool):
    def prepare(batch: Batch, threads: int):
        trl = peer_copy("trl_0_29_1")
        loss = _compiled(trl.ppo_trainer_value_loss) if compiled else trl.ppo_trainer_value_loss
        args = types.SimpleNamespace(cliprange_value=VALUE_CLIP)
        old, returns = _tensor(batch.old_values), _tensor(batch.returns)
        padding_mask_p1 = _tensor(~batch.mask)
        return _backward(
            lambda values: loss(args, values, old, returns, padding_mask_p1, slice(None))[0],
            batch.values,
        )

    return prepare


def _verl_value_loss(batch: Batch, threads: int):
    verl = peer_copy("verl_0_9_1")
    old, returns = _tensor(batch.old_values), _tensor(batch.returns)
    response_mask = _tensor(batch.mask.astype(np.int64))
    return _backward(
        lambda values: verl.compute_value_loss(values, returns, old, response_mask, VALUE_CLIP)[0],
        batch.values,
    )


def _floor_implementation(kernel: Kernel) -> Implementation:
    read = ", ".join(kernel.reads)
    return Implementation(
        name="floor",
        kind=FLOOR,
        # what is timed is the copy that measures the bandwidth; the row's time is the floor
        prepare=lambda batch, threads: Copy(threads),
        source=f"the memory floor: reading {read} and writing {kernel.writes} array(s) once, at "
        f"the copy bandwidth (np.copyto over {COPY_BYTES >> 20} MiB, best of {COPY_REPEATS})",
    )


def _kernel(kernel: Kernel) -> Kernel:
    implementations = (*kernel.implementations, _floor_implementation(kernel))
    return dataclasses.replace(kernel, implementations=implementations)


VERL = "verl 0.9.1 (_peers.verl_0_9_1)"
OPENRLHF = "OpenRLHF 0.11.2 (_peers.openrlhf_0_11_2)"
TRL_PPO = "TRL 0.29.1 (_peers.trl_0_29_1) PPOTrainer.train"
_BESSEL = (
    "masked_var's Bessel factor mask_sum / (mask_sum - 1) divides two integer tensors, which "
    "torch returns in float32, so float64 results agree to float32 precision"
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
                *_ours(_ours_kl, lambda kl: {"kl": kl}, "kl_penalty(logp, ref, 'k3', 10)"),
                Implementation(
                    "verl kl_penalty",
                    PEER,
                    _verl_kl,
                    lambda kl: {"kl": _numpy(kl)},
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
                    _ours_shape_rewards,
                    lambda rewards: {"rewards": rewards},
                    "shape_rewards(scores, logp, ref, kl_coef=0.05, estimator='k3', mask=mask)",
                ),
                Implementation(
                    "trl",
                    PEER,
                    _trl_shape_rewards,
                    _trl_rewards_outputs,
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
                *_ours(_ours_gae, _gae_outputs, "gae(rewards, values, mask=mask)"),
                Implementation(
                    "openrlhf",
                    PEER,
                    _openrlhf_gae,
                    _pair,
                    f"{OPENRLHF} RemoteExperienceMaker.get_advantages_and_returns",
                    requires=("torch",),
                ),
                Implementation(
                    "cleanrl",
                    PEER,
                    _cleanrl_gae,
                    _pair_time_major,
                    "CleanRL v1.0.0 (_peers.cleanrl_1_0_0) cleanrl/ppo.py's GAE block (torch loop "
                    "over T)",
                    requires=("torch",),
                    convention="time-major (T, B) tensors; a row's end is a done flag",
                ),
                Implementation(
                    "sb3",
                    PEER,
                    _sb3_gae,
                    _pair_time_major,
                    "Stable-Baselines3 2.7.1 (_peers.stable_baselines3_2_7_1) "
                    "RolloutBuffer.compute_returns_and_advantage (NumPy loop over T)",
                    requires=("torch",),
                    convention="time-major (T, B) arrays in the batch's dtype (SB3's buffers are "
                    "float32); a row's end is an episode start",
                ),
                Implementation(
                    "scipy lfilter",
                    PEER,
                    _spinningup_gae,
                    _flat_advantages,
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
                    _torchrl_gae(vectorised=False),
                    _torchrl_outputs,
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
                    _torchrl_gae(vectorised=True),
                    _torchrl_outputs,
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
                    _ours_gae_whiten,
                    _pair,
                    "gae(...) then whiten(advantages, mask=mask, unbiased=True)",
                ),
                Implementation(
                    "verl",
                    PEER,
                    _verl_gae_whiten,
                    _pair,
                    f"{VERL} compute_gae_advantage_return (GAE, then masked_whiten)",
                    requires=("torch",),
                    convention="verl does not zero the advantages outside the mask; " + _BESSEL,
                    check_dtype=np.float32,
                ),
                Implementation(
                    "trl",
                    PEER,
                    _trl_gae_whiten,
                    _pair,
                    f"{TRL_PPO} step 6, '6. compute advantages and returns'",
                    requires=("torch",),
                    convention=_BESSEL,
                    check_dtype=np.float32,
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
                    _ours_whiten,
                    lambda whitened: {"whitened": whitened},
                    "whiten(advantages, mask=mask)",
                ),
                Implementation(
                    "openrlhf",
                    PEER,
                    _openrlhf_whiten,
                    lambda whitened: {"whitened": _numpy(whitened)},
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
                _ours(_ours_moments, _moments_outputs, "masked_moments(advantages, mask=mask)")
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
                    _ours_policy_loss,
                    _loss_outputs,
                    "clipped_surrogate(logp, old, adv, mask=mask, dual_clip=3, log_ratio_clamp=20)",
                ),
                Implementation(
                    "torch autograd",
                    PEER,
                    _trl_policy_loss(compiled=False),
                    _loss_and_grad,
                    f"{TRL_PPO} policy loss (pg_loss), forward + backward",
                    requires=("torch",),
                    convention="no dual clip or clamp: on this batch neither is active "
                    "(|log-ratio| < 1), which the check confirms",
                ),
                Implementation(
                    "torch.compile",
                    PEER,
                    _trl_policy_loss(compiled=True),
                    _loss_and_grad,
                    f"torch.compile of {TRL_PPO} policy loss (pg_loss), forward + backward",
                    requires=("torch",),
                    convention="as torch autograd; compiled on the warm-up call, not timed",
                ),
                Implementation(
                    "verl",
                    PEER,
                    _verl_policy_loss,
                    _loss_and_grad,
                    f"{VERL} compute_policy_loss_vanilla, forward + backward",
                    requires=("torch",),
                ),
            ),
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
                *_ours(_ours_value_loss, _loss_outputs, "value_loss(v, v_old, returns, clip=0.2)"),
                Implementation(
                    "torch autograd",
                    PEER,
                    _trl_value_loss(compiled=False),
                    _loss_and_grad,
                    f"{TRL_PPO} value loss (vf_loss), forward + backward",
                    requires=("torch",),
                ),
                Implementation(
                    "torch.compile",
                    PEER,
                    _trl_value_loss(compiled=True),
                    _loss_and_grad,
                    f"torch.compile of {TRL_PPO} value loss (vf_loss), forward + backward",
                    requires=("torch",),
                    convention="compiled on the warm-up call, not timed",
                ),
                Implementation(
                    "verl",
                    PEER,
                    _verl_value_loss,
                    _loss_and_grad,
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


# --------------------------------------------------------------------------------------------
# Availability and the check


@functools.cache
def unavailable(name: str, requires: tuple[str, ...], backend: str | None) -> str | None:
    """Why an implementation cannot run here, or None."""
    if backend is not None:
        try:
            _backend.get_backend(backend)
        except _backend.BackendUnavailableError as error:
            return str(error)
        return None
    for module in requires:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as error:
            return f"{error.name} is not installed ({BENCH_EXTRA})"
        except Exception as error:  # a package that installs but does not import
            return f"{module} does not import: {type(error).__name__}: {error}"
    return None


def why_not(implementation: Implementation, tokens: int | None = None) -> str | None:
    """Why ``implementation`` cannot run here, or on a batch of ``tokens`` tokens; or None."""
    reason = unavailable(implementation.name, implementation.requires, implementation.backend)
    if reason is None and tokens is not None and implementation.max_tokens is not None:
        if tokens > implementation.max_tokens:
            reason = f"runs on batches of up to {implementation.max_tokens} tokens only"
    return reason


def compare(
    kernel: Kernel,
    implementation: Implementation,
    outputs: dict[str, np.ndarray],
    reference: dict[str, np.ndarray],
    batch: Batch,
) -> str | None:
    """None when ``outputs`` equal ``reference`` within the tolerance, else what differs."""
    dtype = np.dtype(implementation.check_dtype or batch.dtype)
    rtol = CHECK_RTOL[dtype]
    for name in implementation.compare or kernel.compare:
        expected = np.asarray(reference[name], dtype=np.float64)
        actual = np.asarray(outputs[name], dtype=np.float64)
        if actual.shape != expected.shape:
            return f"{name}: shape {actual.shape}, expected {expected.shape}"
        if kernel.valid_only and expected.shape == batch.shape:
            expected, actual = expected[batch.mask], actual[batch.mask]
        scale = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
        error = np.abs(actual - expected)
        bad = ~(error <= rtol * scale + rtol * np.abs(expected))
        if np.any(bad):
            where = int(np.flatnonzero(bad)[0])
            return (
                f"{name} differs at {int(bad.sum())} of {bad.size} positions (first: "
                f"{actual.flat[where]!r} against {expected.flat[where]!r}, rtol {rtol:g})"
            )
    return None
