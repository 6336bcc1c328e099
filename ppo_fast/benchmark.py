"""One comparison table drives every benchmark: ``ppo-fast bench`` and the suites in bench/.

``KERNELS`` lists each public kernel with

- the bytes it must read and write, which define its memory roofline: a copy of the same number
  of bytes the kernel must read and write (the definition of the project's benchmark issue),
  ``np.copyto`` of reads + writes bytes into a preallocated buffer, split over the threads when
  there is more than one. The copy reads and writes each of those bytes, so it moves twice the
  kernel's compulsory traffic: 0.5x this roofline is the memory floor, 1x is "as fast as copying
  all its data once";
- our implementations, one per backend (the pure-Python oracle only on small batches);
- the peers: the code that PPO trainers run today, copied faithfully in ``_bench_peers.py`` with
  the repository, path and commit they were read from, or the real function where its package
  imports (TorchRL's GAE);
- which outputs are compared, and where: every peer's output is checked against ours before it is
  timed, so that a benchmark never compares different computations.

Every row runs on one synthetic batch (``Batch``): B responses of up to T tokens, right-padded,
with lengths drawn between T/2 and T, and 0 in every per-token array past a row's end (where
OpenRLHF's action_mask and TRL's masked_fill put 0). Times are of whole calls, with inputs
already in each implementation's own layout (torch tensors, time-major arrays for CleanRL and
Stable-Baselines3): conversions are not timed, output allocation is.

torch, scipy, torchrl and matplotlib are imported only when a row or a plot needs them;
importing this module imports numpy and ppo_fast only.
"""

from __future__ import annotations

import datetime
import functools
import gc
import importlib
import importlib.metadata
import itertools
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _backend, _threads
from . import _bench_peers as peers

OURS, PEER, ROOFLINE = "ours", "peer", "roofline"
BENCH_EXTRA = "pip install 'ppo_fast[bench]'"

# Hyperparameters of every row: verl's defaults for language models.
GAMMA, LAM = 1.0, 0.95
KL_COEF, KL_CLAMP = 0.05, 10.0
CLIP, DUAL_CLIP, LOG_RATIO_CLAMP, VALUE_CLIP = 0.2, 3.0, 20.0, 0.2

# The oracle is a Python loop per token: it runs on batches up to this size only.
PYTHON_MAX_TOKENS = 1 << 16

# Relative tolerance of a peer against ppo_fast, on the scale of the output (as in tests/).
CHECK_RTOL = {np.dtype(np.float32): 2e-4, np.dtype(np.float64): 1e-9}

DEFAULT_SHAPES = ((8, 128), (256, 1024), (1024, 4096))
ALL_SHAPES = ((8, 128), (256, 1024), (1024, 4096), (64, 32768), (4, 131072))
DEFAULT_THREADS = (1, 2)
SCALING_WIDTH = 1000  # scaling batches are (tokens / 1000, 1000)


def parse_shape(text: str) -> tuple[int, int]:
    """'256x1024' -> (256, 1024)."""
    try:
        rows, width = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"a shape is BxT, like 256x1024; got {text!r}") from None
    if rows < 1 or width < 1:
        raise ValueError(f"a shape needs B >= 1 and T >= 1, got {text!r}")
    return rows, width


def shape_name(shape: Sequence[int]) -> str:
    return f"{shape[0]}x{shape[1]}"


def scaling_shape(tokens: int) -> tuple[int, int]:
    """The batch of the scaling sweep with ``tokens`` positions: rows of 1000 tokens."""
    width = min(tokens, SCALING_WIDTH)
    return max(1, tokens // width), width


# --------------------------------------------------------------------------------------------
# The batch


class Batch:
    """B right-padded responses of up to T tokens in one dtype; arrays are built on first use.

    Every per-token array is 0 past a row's length. The values drawn: log-probabilities in
    (-inf, 0], the old and reference log-probabilities within about 0.15 of them (so that about
    a fifth of the tokens are clipped at 0.2), rewards, values, returns and advantages standard
    normal-ish. Deterministic in (shape, dtype, seed).
    """

    def __init__(self, shape: Sequence[int], dtype: Any = np.float32, seed: int = 0):
        self.shape = (int(shape[0]), int(shape[1]))
        self.dtype = np.dtype(dtype)
        self.seed = seed

    @property
    def tokens(self) -> int:
        return self.shape[0] * self.shape[1]

    def _rng(self, stream: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, stream, *self.shape])

    def _normal(self, stream: int, scale: float = 1.0) -> np.ndarray:
        x = self._rng(stream).standard_normal(self.shape, dtype=self.dtype)
        if scale != 1.0:
            x *= self.dtype.type(scale)
        x *= self.mask
        return x

    @functools.cached_property
    def lengths(self) -> np.ndarray:
        width = self.shape[1]
        return self._rng(0).integers(max(1, width // 2), width + 1, self.shape[0]).astype(np.int64)

    @functools.cached_property
    def mask(self) -> np.ndarray:
        return np.arange(self.shape[1]) < self.lengths[:, None]

    @functools.cached_property
    def scores(self) -> np.ndarray:
        return self._rng(1).standard_normal(self.shape[0]).astype(self.dtype)

    @functools.cached_property
    def logprobs(self) -> np.ndarray:
        x = self._normal(2)
        np.abs(x, out=x)
        np.negative(x, out=x)
        return x

    @functools.cached_property
    def ref_logprobs(self) -> np.ndarray:
        return self.logprobs + self._normal(3, 0.15)

    @functools.cached_property
    def old_logprobs(self) -> np.ndarray:
        return self.logprobs + self._normal(4, 0.15)

    @functools.cached_property
    def rewards(self) -> np.ndarray:
        return self._normal(5, 0.1)

    @functools.cached_property
    def values(self) -> np.ndarray:
        return self._normal(6)

    @functools.cached_property
    def old_values(self) -> np.ndarray:
        return self.values + self._normal(7, 0.15)

    @functools.cached_property
    def returns(self) -> np.ndarray:
        return self._normal(8)

    @functools.cached_property
    def advantages(self) -> np.ndarray:
        return self._normal(9)

    def nbytes(self, name: str) -> int:
        return int(getattr(self, name).nbytes)


# --------------------------------------------------------------------------------------------
# The registry


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


@dataclass(frozen=True)
class Kernel:
    """A public kernel of ppo_fast, the bytes it moves, and everything it is compared with."""

    name: str
    summary: str
    reads: tuple[str, ...]  # Batch arrays it must read
    writes: int  # (B, T) arrays of the batch dtype it must write
    compare: tuple[str, ...]  # outputs checked against ours
    valid_only: bool  # compare at the valid positions only
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
    from .rewards import kl_penalty

    logp, ref = batch.logprobs, batch.ref_logprobs
    return lambda: kl_penalty(logp, ref, "k3", KL_CLAMP, backend=backend)


def _verl_kl(batch: Batch, threads: int):
    logp, ref = _tensor(batch.logprobs), _tensor(batch.ref_logprobs)
    return lambda: peers.verl_kl_penalty(logp, ref, "low_var_kl")


# shape_rewards ------------------------------------------------------------------------------


def _ours_shape_rewards(batch: Batch, backend: str):
    from .rewards import shape_rewards

    scores, logp, ref, mask = batch.scores, batch.logprobs, batch.ref_logprobs, batch.mask
    return lambda: shape_rewards(
        scores, logp, ref, kl_coef=KL_COEF, estimator="k3", mask=mask, backend=backend
    )


def _trl_shape_rewards(batch: Batch, threads: int):
    scores = _tensor(batch.scores)
    logp, ref = _tensor(batch.logprobs), _tensor(batch.ref_logprobs)
    padding_mask = _tensor(~batch.mask)
    # TRL adds the score at sequence_lengths + 1 (the token after its EOS index): pass the last
    # valid index minus one, so that the score lands where ppo_fast puts it.
    sequence_lengths = _tensor(batch.lengths - 2)
    return lambda: peers.trl_compute_rewards(
        scores, logp, ref, padding_mask, sequence_lengths, KL_COEF
    )


# gae ----------------------------------------------------------------------------------------


def _ours_gae(batch: Batch, backend: str):
    from .gae import gae

    rewards, values, mask = batch.rewards, batch.values, batch.mask
    return lambda: gae(rewards, values, gamma=GAMMA, lam=LAM, mask=mask, backend=backend)


def _gae_outputs(result) -> dict[str, np.ndarray]:
    return {"advantages": result.advantages, "returns": result.returns}


def _openrlhf_gae(batch: Batch, threads: int):
    values, rewards = _tensor(batch.values), _tensor(batch.rewards)
    action_mask = _tensor(batch.mask)
    return lambda: peers.openrlhf_get_advantages_and_returns(
        values, rewards, action_mask, GAMMA, LAM
    )


def _episode_starts(batch: Batch) -> np.ndarray:
    """Time-major (T, B): 1 where a step starts a new episode, the step after each row's end."""
    starts = np.zeros((batch.shape[1], batch.shape[0]), dtype=batch.dtype)
    inside = batch.lengths < batch.shape[1]
    starts[batch.lengths[inside], np.flatnonzero(inside)] = 1
    return starts


def _cleanrl_gae(batch: Batch, threads: int):
    torch = _torch()
    rewards = _tensor(np.ascontiguousarray(batch.rewards.T))
    values = _tensor(np.ascontiguousarray(batch.values.T))
    dones = _tensor(_episode_starts(batch))
    next_value = torch.zeros((1, batch.shape[0]), dtype=rewards.dtype)
    next_done = torch.ones(batch.shape[0], dtype=rewards.dtype)
    return lambda: peers.cleanrl_gae(rewards, values, dones, next_value, next_done, GAMMA, LAM)


def _sb3_gae(batch: Batch, threads: int):
    rewards = np.ascontiguousarray(batch.rewards.T)
    values = np.ascontiguousarray(batch.values.T)
    episode_starts = _episode_starts(batch)
    last_values = np.zeros(batch.shape[0], dtype=batch.dtype)
    dones = np.ones(batch.shape[0], dtype=bool)
    return lambda: peers.sb3_compute_returns_and_advantage(
        rewards, values, episode_starts, last_values, dones, GAMMA, LAM
    )


def _spinningup_gae(batch: Batch, threads: int):
    rewards, values, lengths = batch.rewards, batch.values, batch.lengths
    return lambda: peers.spinningup_gae(rewards, values, lengths, GAMMA, LAM)


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
    from .gae import gae
    from .whiten import whiten

    rewards, values, mask = batch.rewards, batch.values, batch.mask

    def run():
        result = gae(rewards, values, gamma=GAMMA, lam=LAM, mask=mask, backend=backend)
        return whiten(result.advantages, mask=mask, unbiased=True, backend=backend), result.returns

    return run


def _verl_gae_whiten(batch: Batch, threads: int):
    rewards, values = _tensor(batch.rewards), _tensor(batch.values)
    # verl's response_mask is a slice of the int64 attention mask.
    response_mask = _tensor(batch.mask.astype(np.int64))
    return lambda: peers.verl_compute_gae_advantage_return(
        rewards, values, response_mask, GAMMA, LAM
    )


def _trl_gae_whiten(batch: Batch, threads: int):
    rewards, values = _tensor(batch.rewards), _tensor(batch.values)
    padding_mask = _tensor(~batch.mask)
    return lambda: peers.trl_advantages_and_returns(rewards, values, padding_mask, GAMMA, LAM)


# whiten, masked_moments ---------------------------------------------------------------------


def _ours_whiten(batch: Batch, backend: str):
    from .whiten import whiten

    advantages, mask = batch.advantages, batch.mask
    return lambda: whiten(advantages, mask=mask, backend=backend)


def _openrlhf_whiten(batch: Batch, threads: int):
    advantages, mask = [_tensor(batch.advantages)], [_tensor(batch.mask)]
    return lambda: peers.openrlhf_normalize_advantages(advantages, mask)[0]


def _ours_moments(batch: Batch, backend: str):
    from .whiten import masked_moments

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
    from .loss import clipped_surrogate

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
    from .loss import value_loss

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
        loss = _compiled(peers.trl_policy_loss) if compiled else peers.trl_policy_loss
        old, adv = _tensor(batch.old_logprobs), _tensor(batch.advantages)
        padding_mask = _tensor(~batch.mask)
        return _backward(lambda logp: loss(logp, old, adv, padding_mask, CLIP), batch.logprobs)

    return prepare


def _verl_policy_loss(batch: Batch, threads: int):
    old, adv = _tensor(batch.old_logprobs), _tensor(batch.advantages)
    response_mask = _tensor(batch.mask.astype(np.int64))
    config = {"clip_ratio": CLIP, "clip_ratio_c": DUAL_CLIP}
    return _backward(
        lambda logp: peers.verl_compute_policy_loss_vanilla(
            old, logp, adv, response_mask, "token-mean", config
        )[0],
        batch.logprobs,
    )


def _trl_value_loss(compiled: bool):
    def prepare(batch: Batch, threads: int):
        loss = _compiled(peers.trl_value_loss) if compiled else peers.trl_value_loss
        old, returns = _tensor(batch.old_values), _tensor(batch.returns)
        padding_mask = _tensor(~batch.mask)
        return _backward(
            lambda values: loss(values, old, returns, padding_mask, VALUE_CLIP), batch.values
        )

    return prepare


def _verl_value_loss(batch: Batch, threads: int):
    old, returns = _tensor(batch.old_values), _tensor(batch.returns)
    response_mask = _tensor(batch.mask.astype(np.int64))
    return _backward(
        lambda values: peers.verl_compute_value_loss(
            values, returns, old, response_mask, VALUE_CLIP
        )[0],
        batch.values,
    )


# the roofline -------------------------------------------------------------------------------

_ROOFLINE_CHUNK = 1 << 20  # a copy is split over threads only above 1 MiB a thread


@functools.cache
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="ppo_fast-roofline")


class Roofline:
    """A copy of read_bytes + write_bytes bytes into a preallocated buffer (see the module).

    NumPy's copy releases the GIL, so with ``threads`` > 1 the copy is cut into that many slices
    copied at once (slices of at least 1 MiB; smaller copies stay on one thread).
    """

    def __init__(self, read_bytes: int, write_bytes: int, threads: int = 1):
        self.size = max(1, read_bytes + write_bytes)
        self.source = np.ones(self.size, dtype=np.uint8)
        self.target = np.empty_like(self.source)
        pieces = min(threads, max(1, self.size // _ROOFLINE_CHUNK))
        bounds = np.linspace(0, self.size, pieces + 1).astype(np.int64)
        self.slices = [slice(a, b) for a, b in itertools.pairwise(bounds)]

    def _copy(self, part: slice) -> None:
        np.copyto(self.target[part], self.source[part])

    def __call__(self) -> None:
        if len(self.slices) == 1:
            np.copyto(self.target, self.source)
            return
        pool = _pool(len(self.slices))
        for future in [pool.submit(self._copy, part) for part in self.slices]:
            future.result()


def _roofline_implementation(kernel: Kernel) -> Implementation:
    def prepare(batch: Batch, threads: int):
        return Roofline(*kernel.traffic(batch), threads=threads)

    read = ", ".join(kernel.reads)
    return Implementation(
        name="roofline",
        kind=ROOFLINE,
        prepare=prepare,
        source=f"np.copyto of the bytes of reading {read} and writing {kernel.writes} array(s)",
    )


def _kernel(kernel: Kernel) -> Kernel:
    implementations = (*kernel.implementations, _roofline_implementation(kernel))
    return Kernel(
        kernel.name,
        kernel.summary,
        kernel.reads,
        kernel.writes,
        kernel.compare,
        kernel.valid_only,
        implementations,
    )


VERL = "volcengine/verl"
_BESSEL = (
    "masked_var's Bessel factor mask_sum / (mask_sum - 1) divides two integer tensors, which "
    "torch returns in float32, so float64 results agree to float32 precision"
)
TRL_PPO = "huggingface/trl trl/trainer/ppo_trainer.py @ be8a0874"

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
            implementations=(
                *_ours(_ours_kl, lambda kl: {"kl": kl}, "kl_penalty(logp, ref, 'k3', 10)"),
                Implementation(
                    "verl kl_penalty",
                    PEER,
                    _verl_kl,
                    lambda kl: {"kl": _numpy(kl)},
                    f"{VERL} verl/trainer/ppo/core_algos.py @ 012be9d9 kl_penalty",
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
                    lambda rewards: {"rewards": _numpy(rewards)},
                    f"{TRL_PPO} '4. compute rewards' (k3)",
                    requires=("torch",),
                    convention="TRL puts the score one token past its EOS index; the index "
                    "passed is the last valid token's minus one, so the score lands where "
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
            implementations=(
                *_ours(_ours_gae, _gae_outputs, "gae(rewards, values, mask=mask)"),
                Implementation(
                    "openrlhf",
                    PEER,
                    _openrlhf_gae,
                    _pair,
                    "OpenRLHF/OpenRLHF openrlhf/trainer/ppo_utils/experience_maker.py @ 89308a0b "
                    "get_advantages_and_returns",
                    requires=("torch",),
                ),
                Implementation(
                    "cleanrl",
                    PEER,
                    _cleanrl_gae,
                    _pair_time_major,
                    "vwxyzjn/cleanrl cleanrl/ppo.py @ 020cf0e5 (torch loop over T)",
                    requires=("torch",),
                    convention="time-major (T, B) tensors; a row's end is a done flag",
                ),
                Implementation(
                    "sb3",
                    PEER,
                    _sb3_gae,
                    _pair_time_major,
                    "DLR-RM/stable-baselines3 stable_baselines3/common/buffers.py @ 64a0a6bb "
                    "RolloutBuffer.compute_returns_and_advantage (NumPy loop over T)",
                    convention="time-major (T, B) arrays; a row's end is an episode start",
                ),
                Implementation(
                    "scipy lfilter",
                    PEER,
                    _spinningup_gae,
                    _pair,
                    "openai/spinningup spinup/algos/pytorch/ppo/core.py @ 20921137 "
                    "discount_cumsum, one lfilter per row as PPOBuffer.finish_path",
                    requires=("scipy.signal",),
                    convention="returns are advantages + values (Spinning Up's value targets "
                    "are rewards-to-go)",
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
                    f"{VERL} verl/trainer/ppo/core_algos.py @ 012be9d9 "
                    "compute_gae_advantage_return + verl/utils/torch_functional.py masked_whiten",
                    requires=("torch",),
                    convention="verl does not zero the advantages outside the mask; " + _BESSEL,
                    check_dtype=np.float32,
                ),
                Implementation(
                    "trl",
                    PEER,
                    _trl_gae_whiten,
                    _pair,
                    f"{TRL_PPO} '6. compute advantages and returns'",
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
                    "OpenRLHF/OpenRLHF openrlhf/trainer/ppo_utils/experience_maker.py @ 89308a0b "
                    "compute_advantages_and_returns (the normalisation)",
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
                    f"{TRL_PPO} pg_loss (the plain formula), forward + backward",
                    requires=("torch",),
                    convention="no dual clip or clamp: on this batch neither is active "
                    "(|log-ratio| < 1), which the check confirms",
                ),
                Implementation(
                    "torch.compile",
                    PEER,
                    _trl_policy_loss(compiled=True),
                    _loss_and_grad,
                    f"torch.compile of {TRL_PPO} pg_loss, forward + backward",
                    requires=("torch",),
                    convention="as torch autograd; compiled on the warm-up call, not timed",
                ),
                Implementation(
                    "verl",
                    PEER,
                    _verl_policy_loss,
                    _loss_and_grad,
                    f"{VERL} verl/trainer/ppo/core_algos.py @ 012be9d9 "
                    "compute_policy_loss_vanilla, forward + backward",
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
            implementations=(
                *_ours(_ours_value_loss, _loss_outputs, "value_loss(v, v_old, returns, clip=0.2)"),
                Implementation(
                    "torch autograd",
                    PEER,
                    _trl_value_loss(compiled=False),
                    _loss_and_grad,
                    f"{TRL_PPO} vf_loss (the plain formula), forward + backward",
                    requires=("torch",),
                ),
                Implementation(
                    "torch.compile",
                    PEER,
                    _trl_value_loss(compiled=True),
                    _loss_and_grad,
                    f"torch.compile of {TRL_PPO} vf_loss, forward + backward",
                    requires=("torch",),
                    convention="compiled on the warm-up call, not timed",
                ),
                Implementation(
                    "verl",
                    PEER,
                    _verl_value_loss,
                    _loss_and_grad,
                    f"{VERL} verl/trainer/ppo/core_algos.py @ 012be9d9 compute_value_loss, "
                    "forward + backward",
                    requires=("torch",),
                ),
            ),
        ),
    )
}


# --------------------------------------------------------------------------------------------
# Availability, threads, the check


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


def why_not(implementation: Implementation) -> str | None:
    return unavailable(implementation.name, implementation.requires, implementation.backend)


def quiet_openmp() -> str:
    """Make OpenMP's idle threads sleep (OMP_WAIT_POLICY=PASSIVE) unless the user chose; the
    policy in force is returned. It must run before torch or the cython backend load libgomp.

    torch's OpenMP team, the cython backend's (the same libgomp) and numba's workers share two
    cores here: by default an idle OpenMP thread spins, and the next parallel call of another
    pool then waits for the scheduler's tick (4 ms multiples were measured: 8 ms for a 1 ms
    kernel). Sleeping idle threads cost a wake-up per parallel region instead.
    """
    return os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def start_torch_threads(threads: int) -> None:
    """Create torch's thread team at ``threads`` now, with a parallel operation.

    Measured with torch 2.13.0 and llvmlite 0.50 in one process: when torch's team first grows
    past one thread after llvmlite is loaded, every later call on two threads takes about 8 ms
    (a 13 us call included); a team started at full size first does not.
    """
    torch = _torch()
    torch.set_num_threads(threads)
    torch.ones(1 << 22).exp_()


def set_threads(threads: int) -> None:
    """The thread count of ppo_fast and, when it is loaded, torch."""
    _threads.set_num_threads(threads)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)


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
    for name in kernel.compare:
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


# --------------------------------------------------------------------------------------------
# Timing

SAMPLE_SECONDS = 2e-3  # calls are batched so that one sample lasts about this long


def time_calls(
    call: Callable[[], Any], budget: float, min_repeats: int = 3, max_repeats: int = 200
) -> tuple[list[float], int]:
    """Seconds per call, one value per sample, and the number of calls per sample.

    The garbage collector is off while timing (as in timeit). A call slower than a sample is
    its own sample; samples continue until ``budget`` seconds have passed and at least
    ``min_repeats`` were taken.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        call()
        first = time.perf_counter() - start
        number = max(1, int(SAMPLE_SECONDS / max(first, 1e-9)))
        samples = [first] if number == 1 else []
        deadline = time.perf_counter() + budget
        while len(samples) < max_repeats and (
            len(samples) < min_repeats or time.perf_counter() < deadline
        ):
            start = time.perf_counter()
            for _ in range(number):
                call()
            samples.append((time.perf_counter() - start) / number)
    finally:
        if enabled:
            gc.enable()
    return samples, number


@dataclass
class Plan:
    """What to measure."""

    kernels: tuple[str, ...] = tuple(KERNELS)
    shapes: tuple[tuple[int, int], ...] = DEFAULT_SHAPES
    dtypes: tuple[str, ...] = ("float32",)
    threads: tuple[int, ...] = DEFAULT_THREADS
    budget: float = 0.08
    min_repeats: int = 3
    scaling_tokens: tuple[int, ...] = ()
    scaling_budget: float = 0.04
    implementations: tuple[str, ...] | None = None  # None: all

    def rows(self) -> list[tuple[str, str, tuple[int, int], str, int, str]]:
        """(kernel, implementation, shape, dtype, threads, sweep) in the order they run."""
        rows = []
        for dtype in self.dtypes:
            for shape in self.shapes:
                for kernel in self.kernels:
                    for threads in self.threads:
                        rows += [
                            (kernel, implementation.name, shape, dtype, threads, "shapes")
                            for implementation in KERNELS[kernel].implementations
                            if self.implementations is None
                            or implementation.name in self.implementations
                        ]
        # The sweep runs our compiled kernels and the roofline, at the largest thread count.
        for tokens in self.scaling_tokens:
            shape, dtype, threads = scaling_shape(tokens), self.dtypes[0], max(self.threads)
            for kernel in self.kernels:
                rows += [
                    (kernel, implementation.name, shape, dtype, threads, "scaling")
                    for implementation in KERNELS[kernel].implementations
                    if implementation.kind in (OURS, ROOFLINE)
                    and implementation.backend != "python"
                ]
        return rows


class Progress:
    """A progress bar on stderr: redrawn in place on a terminal, a line every 10% elsewhere."""

    def __init__(self, total: int, stream=None, enabled: bool = True):
        self.total, self.done = max(1, total), 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.perf_counter()
        self.last_tenth = -1

    def update(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        fraction = self.done / self.total
        elapsed = time.perf_counter() - self.start
        width = 30
        bar = "#" * int(fraction * width) + "." * (width - int(fraction * width))
        text = f"[{bar}] {self.done}/{self.total} {elapsed:5.0f}s  {label}"
        if self.tty:
            self.stream.write("\r" + text[:120].ljust(120))
            if self.done == self.total:
                self.stream.write("\n")
        elif int(fraction * 10) != self.last_tenth:
            self.last_tenth = int(fraction * 10)
            self.stream.write(text + "\n")
        self.stream.flush()


def _row(
    kernel: Kernel,
    implementation: Implementation,
    batch: Batch,
    threads: int,
    sweep: str,
    **fields: Any,
) -> dict[str, Any]:
    read, written = kernel.traffic(batch)
    row = {
        "kernel": kernel.name,
        "implementation": implementation.name,
        "kind": implementation.kind,
        "shape": list(batch.shape),
        "tokens": batch.tokens,
        "dtype": batch.dtype.name,
        "threads": threads,
        "sweep": sweep,
        "bytes_read": read,
        "bytes_written": written,
        "source": implementation.source,
        "convention": implementation.convention,
        "status": "ok",
        "reason": "",
    }
    row.update(fields)
    return row


def run(plan: Plan, progress: Progress | None = None) -> list[dict[str, Any]]:
    """Measure every row of ``plan``; returns one dict per row (see ``_row``)."""
    planned = plan.rows()
    progress = progress or Progress(len(planned), enabled=False)
    quiet_openmp()
    needs_torch = {
        name
        for kernel, name, *_ in planned
        if "torch" in KERNELS[kernel].implementation(name).requires
    }
    if needs_torch and unavailable("torch", ("torch",), None) is None:
        start_torch_threads(max(plan.threads))
    results: list[dict[str, Any]] = []
    batches: dict[tuple, Batch] = {}
    # Group the rows by batch and thread count so that the reference output is computed first.
    groups: dict[tuple, list[str]] = {}
    for kernel, name, shape, dtype, threads, sweep in planned:
        groups.setdefault((kernel, shape, dtype, threads, sweep), []).append(name)
    try:
        for (kernel_name, shape, dtype, threads, sweep), names in groups.items():
            key = (shape, dtype)
            if key not in batches:
                batches.clear()  # one batch alive at a time: large sweeps stay within memory
                batches[key] = Batch(shape, dtype)
            batch = batches[key]
            kernel = KERNELS[kernel_name]
            set_threads(threads)
            reference = None
            for name in names:
                implementation = kernel.implementation(name)
                label = f"{kernel.name} {shape_name(shape)} {dtype} {threads}T {name}"
                budget = plan.scaling_budget if sweep == "scaling" else plan.budget
                row, outputs = _measure(
                    kernel, implementation, batch, threads, budget, plan, reference
                )
                row["sweep"] = sweep
                if reference is None and implementation.kind == OURS and outputs is not None:
                    reference = outputs
                results.append(row)
                progress.update(label)
    finally:
        set_threads_default()
    add_ratios(results)
    return results


def set_threads_default() -> None:
    _threads.set_num_threads(None)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(_threads.get_num_threads())


def _measure(
    kernel: Kernel,
    implementation: Implementation,
    batch: Batch,
    threads: int,
    budget: float,
    plan: Plan,
    reference: dict[str, np.ndarray] | None,
) -> tuple[dict[str, Any], dict[str, np.ndarray] | None]:
    reason = why_not(implementation)
    if reason is None and implementation.max_tokens and batch.tokens > implementation.max_tokens:
        reason = f"runs on batches of up to {implementation.max_tokens} tokens only"
    if reason is not None:
        row = _row(kernel, implementation, batch, threads, "", status="skipped", reason=reason)
        return row, None
    try:
        call = implementation.prepare(batch, threads)
        result = call()  # the warm-up call: compiles, and gives the output checked
        outputs = implementation.outputs(result) if implementation.outputs else None
        del result
        if outputs is not None and reference is not None:
            mismatch = compare(kernel, implementation, outputs, reference, batch)
            if mismatch is not None:
                row = _row(kernel, implementation, batch, threads, "", status="mismatch")
                row["reason"] = mismatch
                return row, None
        samples, number = time_calls(call, budget, plan.min_repeats)
    except Exception as error:  # a peer that breaks is reported, the run goes on
        row = _row(kernel, implementation, batch, threads, "", status="error")
        row["reason"] = f"{type(error).__name__}: {error}"
        return row, None
    row = _row(
        kernel,
        implementation,
        batch,
        threads,
        "",
        times=samples,
        number=number,
        min=min(samples),
        median=float(np.median(samples)),
        max=max(samples),
        checked=outputs is not None and reference is not None,
        # the first of our backends gives the outputs the others are checked against
        reference=implementation.kind == OURS and reference is None,
    )
    return row, outputs


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's median over the roofline's, and each of our backends' speed-up over it."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        key = (row["kernel"], tuple(row["shape"]), row["dtype"], row["threads"], row["sweep"])
        groups.setdefault(key, []).append(row)
    for group in groups.values():
        timed = {row["implementation"]: row for row in group if row["status"] == "ok"}
        roof = timed.get("roofline")
        ours = {name: row for name, row in timed.items() if row["kind"] == OURS}
        for row in timed.values():
            if roof is not None:
                row["x_roofline"] = row["median"] / roof["median"]
            row["speedup"] = {
                name: row["median"] / mine["median"]
                for name, mine in ours.items()
                if name != row["implementation"] and row["kind"] != ROOFLINE
            }


def fit_exponent(tokens: Sequence[float], seconds: Sequence[float]) -> float:
    """k in seconds ~ tokens^k: the least-squares slope of log(seconds) against log(tokens)."""
    x, y = np.log10(np.asarray(tokens, float)), np.log10(np.asarray(seconds, float))
    if x.size < 2 or np.ptp(x) == 0:
        raise ValueError("fitting an exponent needs at least two different token counts")
    slope, _ = np.polyfit(x, y, 1)
    return float(slope)


def exponents(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The fitted exponent of each (kernel, implementation, dtype, threads) of the sweep."""
    series: dict[tuple, list[tuple[int, float]]] = {}
    for row in rows:
        if row["sweep"] == "scaling" and row["status"] == "ok":
            key = (row["kernel"], row["implementation"], row["dtype"], row["threads"])
            series.setdefault(key, []).append((row["tokens"], row["median"]))
    fits = []
    for (kernel, name, dtype, threads), points in series.items():
        points.sort()
        if len({tokens for tokens, _ in points}) < 2:
            continue
        fits.append(
            {
                "kernel": kernel,
                "implementation": name,
                "dtype": dtype,
                "threads": threads,
                "exponent": fit_exponent(*zip(*points, strict=True)),
                "tokens": [tokens for tokens, _ in points],
                "median": [seconds for _, seconds in points],
            }
        )
    return fits


# --------------------------------------------------------------------------------------------
# Peak memory and start-up, in fresh processes

_PROBE = """
import json, sys
from ppo_fast import benchmark
print("PPO_FAST_PROBE " + json.dumps(benchmark.{function}(*json.loads(sys.argv[1]))))
"""

# Imports are timed in an interpreter that has imported nothing else (not even ppo_fast).
_IMPORT_PROBE = """
import json, sys, time
start = time.perf_counter()
__import__(sys.argv[1])
print("PPO_FAST_PROBE " + json.dumps({"seconds": time.perf_counter() - start}))
"""

# glibc adapts its mmap threshold upward as large blocks are freed, and then keeps freed blocks
# resident: with a fixed threshold every large buffer is mapped on allocation and unmapped on
# release, so the resident set follows what is alive.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def _probe(function: str, args: list, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``benchmark.function(*args)`` in a fresh interpreter and return its JSON answer."""
    return _answer(
        [sys.executable, "-c", _PROBE.format(function=function), json.dumps(args)], function, env
    )


def import_seconds(module: str) -> float:
    """Seconds to import ``module`` in a fresh interpreter that imports nothing before it."""
    return _answer([sys.executable, "-c", _IMPORT_PROBE, module], f"import {module}")["seconds"]


def _answer(command: list[str], what: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    out = subprocess.run(
        command,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=600,
    )
    for line in out.stdout.splitlines():
        if line.startswith("PPO_FAST_PROBE "):
            return json.loads(line.removeprefix("PPO_FAST_PROBE "))
    tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
    raise RuntimeError(f"the {what} probe failed: {' | '.join(tail)}")


def _status_kib(field_name: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field_name}")


def _reset_peak() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS; False where Linux does not let."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def memory_probe(kernel_name: str, name: str, shape: list[int], dtype: str) -> dict[str, Any]:
    """Extra peak memory of one call, measured in this (fresh) process.

    The inputs are built and put in the implementation's layout, and one warm-up call compiles
    (numba, torch.compile) and loads what it needs; its result is freed. Then the peak resident
    set size (VmHWM) is reset through /proc/self/clear_refs and read after one more call: the
    extra peak is that peak over the resident size before the call. Run it with ``MALLOC_ENV``
    so that freed buffers leave the resident set. Where the peak cannot be reset, the increase
    of getrusage's ru_maxrss stands in (a lower bound: an earlier, higher peak hides the call's).
    """
    import resource

    kernel = KERNELS[kernel_name]
    implementation = kernel.implementation(name)
    reason = why_not(implementation)
    if reason is not None:
        return {"status": "skipped", "reason": reason}
    set_threads(1)
    call = implementation.prepare(Batch(shape, dtype), 1)
    result = call()
    del result
    gc.collect()
    if _reset_peak():
        method = "peak RSS (VmHWM, reset through /proc/self/clear_refs) over RSS before the call"
        before = _status_kib("VmRSS")
        result = call()
        peak = _status_kib("VmHWM")
    else:
        method = "increase of getrusage ru_maxrss (a lower bound)"
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        result = call()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    del result
    return {"status": "ok", "extra_peak_bytes": max(0, peak - before) * 1024, "method": method}


def measure_memory(plan: Plan, shape: tuple[int, int], progress: Progress | None = None):
    """One fresh process per (kernel, implementation) at ``shape``, the plan's first dtype."""
    rows = []
    for kernel_name in plan.kernels:
        kernel = KERNELS[kernel_name]
        for implementation in kernel.implementations:
            if plan.implementations is not None and implementation.name not in plan.implementations:
                continue
            batch = Batch(shape, plan.dtypes[0])
            read, written = kernel.traffic(batch)
            row = {
                "kernel": kernel.name,
                "implementation": implementation.name,
                "kind": implementation.kind,
                "shape": list(shape),
                "dtype": batch.dtype.name,
                "bytes_read": read,
                "bytes_written": written,
            }
            reason = why_not(implementation)
            if reason is None and implementation.max_tokens is not None:
                if batch.tokens > implementation.max_tokens:
                    reason = f"runs on batches of up to {implementation.max_tokens} tokens only"
            if reason is not None:
                row.update(status="skipped", reason=reason)
            else:
                args = [kernel.name, implementation.name, list(shape), batch.dtype.name]
                try:
                    row.update(_probe("memory_probe", args, MALLOC_ENV))
                except RuntimeError as error:
                    row.update(status="error", reason=str(error))
            rows.append(row)
            if progress is not None:
                progress.update(f"memory {kernel.name} {implementation.name}")
    return rows


# The calls whose first-call time is measured: one per public stage, on an 8x128 batch, in this
# order (whiten reuses the moments kernel: it comes after masked_moments, which compiles it).
FIRST_CALL_KERNELS = (
    "kl_penalty",
    "shape_rewards",
    "gae",
    "masked_moments",
    "whiten",
    "clipped_surrogate",
    "value_loss",
)


def first_call_probe(backend: str, dtype: str = "float32") -> dict[str, Any]:
    """Seconds of the first and the second call of each stage in this (fresh) process."""
    start = time.perf_counter()
    import ppo_fast

    ppo_fast.get_backend(backend)
    load = time.perf_counter() - start
    set_threads(1)
    batch = Batch((8, 128), dtype)
    calls = {}
    for kernel_name in FIRST_CALL_KERNELS:
        call = KERNELS[kernel_name].implementation(f"ppo_fast[{backend}]").prepare(batch, 1)
        start = time.perf_counter()
        call()
        first = time.perf_counter() - start
        start = time.perf_counter()
        call()
        calls[kernel_name] = {"first": first, "second": time.perf_counter() - start}
    return {"import_and_load": load, "calls": calls}


# (what, module, the backend it loads or None, the modules it needs)
IMPORTS = (
    ("ppo_fast", "ppo_fast", None, ()),
    ("ppo_fast numba backend", "ppo_fast._numba_kernels", "numba", ()),
    ("ppo_fast cython backend", "ppo_fast._cython_backend", "cython", ()),
    ("torch", "torch", None, ("torch",)),
    ("scipy.signal", "scipy.signal", None, ("scipy.signal",)),
    (
        "torchrl",
        "torchrl.objectives.value.functional",
        None,
        ("torchrl.objectives.value.functional",),
    ),
)


def import_unavailable(what: str, backend: str | None, requires: tuple[str, ...]) -> str | None:
    if backend is not None:
        return why_not(KERNELS["gae"].implementation(f"ppo_fast[{backend}]"))
    return unavailable(what, requires, None)


def first_call_modes(cache_dir: str) -> list[tuple[str, str, dict[str, str]]]:
    """(backend, mode, environment) of the first-call probes, in the order they must run: the
    numba cache off, then cold (filling ``cache_dir``), then warm (reading it); then cython."""
    cached = {"PPO_FAST_NUMBA_CACHE": "1", "NUMBA_CACHE_DIR": cache_dir}
    return [
        ("numba", "cache off", {"PPO_FAST_NUMBA_CACHE": ""}),
        ("numba", "cache cold", cached),
        ("numba", "cache warm", cached),
        ("cython", "", {}),
    ]


def measure_startup(progress: Progress | None = None) -> dict[str, Any]:
    """Import times, and first-call times of numba (cache off, cache cold, cache warm), cython."""
    imports = []
    for what, module, backend, requires in IMPORTS:
        row = {"what": what, "module": module}
        reason = import_unavailable(what, backend, requires)
        if reason is not None:
            row.update(status="skipped", reason=reason)
        else:
            try:
                row.update(status="ok", seconds=import_seconds(module))
            except RuntimeError as error:
                row.update(status="error", reason=str(error))
        imports.append(row)
        if progress is not None:
            progress.update(f"import {what}")
    first_calls = []
    with tempfile.TemporaryDirectory(prefix="ppo_fast-numba-cache-") as cache_dir:
        for backend, mode, env in first_call_modes(cache_dir):
            row = {"backend": backend, "mode": mode}
            reason = why_not(KERNELS["gae"].implementation(f"ppo_fast[{backend}]"))
            if reason is not None:
                row.update(status="skipped", reason=reason)
            else:
                try:
                    row.update(status="ok", **_probe("first_call_probe", [backend], env))
                except RuntimeError as error:
                    row.update(status="error", reason=str(error))
            first_calls.append(row)
            if progress is not None:
                progress.update(f"first call {backend} {mode}")
    return {"imports": imports, "first_calls": first_calls}


# --------------------------------------------------------------------------------------------
# Reports


def environment() -> dict[str, Any]:
    """Date, machine and versions, for the JSON and the table's header."""
    versions = {"python": platform.python_version()}
    for module in ("numpy", "numba", "Cython", "torch", "scipy", "torchrl", "matplotlib"):
        try:
            versions[module] = importlib.metadata.version(module)
        except importlib.metadata.PackageNotFoundError:
            continue
    from . import __version__

    versions["ppo_fast"] = __version__
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": _cpu_name(),
        "cores": _threads._cpu_count(),
        "platform": platform.platform(),
        "versions": versions,
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", ""),
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def format_seconds(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def format_ratio(ratio: float | None) -> str:
    if ratio is None:
        return ""
    return f"{ratio:.3g}x" if ratio < 1000 else f"{ratio:,.0f}x"


def _table(header: Sequence[str], rows: Iterable[Sequence[str]], indent: str = "  ") -> list[str]:
    rows = [list(map(str, row)) for row in rows]
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)
    ]
    align = [str.ljust] + [str.rjust] * (len(header) - 1)
    lines = [indent + "  ".join(a(h, w) for a, h, w in zip(align, header, widths, strict=True))]
    lines.append(indent + "  ".join("-" * w for w in widths))
    lines += [
        indent + "  ".join(a(c, w) for a, c, w in zip(align, row, widths, strict=True))
        for row in rows
    ]
    return lines


def format_report(
    rows: list[dict[str, Any]],
    env: dict[str, Any] | None = None,
    memory: list[dict[str, Any]] | None = None,
    startup: dict[str, Any] | None = None,
) -> str:
    """The tables ``ppo-fast bench`` prints."""
    lines = []
    if env is not None:
        versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items())
        lines += [
            f"ppo-fast bench  {env['date']}  {env['cpu']} ({env['cores']} cores)",
            f"  {versions}; OMP_WAIT_POLICY={env.get('OMP_WAIT_POLICY') or 'unset'}",
        ]
    lines += [
        "  median / min / max: seconds per call over n samples; x roofline: median over that of",
        "  a copy moving the same bytes; speed-up: the row's median over ppo_fast's, one run.",
        "",
    ]
    # The speed-up columns: our compiled backends (the oracle is there to be checked, not raced).
    ours = [
        f"ppo_fast[{backend}]"
        for backend in _backend.BACKENDS
        if backend != "python"
        and any(r["implementation"] == f"ppo_fast[{backend}]" and r["status"] == "ok" for r in rows)
    ]
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        if row["sweep"] == "shapes":
            key = (row["kernel"], tuple(row["shape"]), row["dtype"], row["threads"])
            groups.setdefault(key, []).append(row)
    for (kernel, shape, dtype, threads), group in groups.items():
        timed = [row for row in group if row["status"] == "ok"]
        if not timed:
            continue
        read, written = group[0]["bytes_read"], group[0]["bytes_written"]
        lines.append(
            f"{kernel}  {shape_name(shape)} {dtype}, {threads} thread{'s' * (threads > 1)}"
            f"  ({KERNELS[kernel].summary}; {(read + written) / 1e6:.3g} MB moved)"
        )
        header = ["implementation", "median", "min", "max", "n", "x roofline"]
        header += [f"{name} speed-up" for name in ours]
        table = []
        for row in timed:
            cells = [
                row["implementation"],
                format_seconds(row["median"]),
                format_seconds(row["min"]),
                format_seconds(row["max"]),
                str(len(row["times"])),
                format_ratio(row.get("x_roofline")) if row["kind"] != ROOFLINE else "1x",
            ]
            cells += [format_ratio(row.get("speedup", {}).get(name)) for name in ours]
            table.append(cells)
        lines += [*_table(header, table), ""]
    lines += _format_summary(rows, ours)
    fits = exponents(rows)
    if fits:
        lines.append("scaling: time ~ tokens^k, k by least squares on log-log")
        table = [
            [
                fit["kernel"],
                fit["implementation"],
                fit["dtype"],
                str(fit["threads"]),
                f"{fit['exponent']:.2f}",
                f"{fit['tokens'][0]:.0e}..{fit['tokens'][-1]:.0e}",
                format_seconds(fit["median"][-1]),
            ]
            for fit in fits
        ]
        header = ["kernel", "implementation", "dtype", "threads", "k", "tokens", "largest"]
        lines += [*_table(header, table), ""]
    if memory:
        lines += _format_memory(memory)
    if startup:
        lines += _format_startup(startup)
    skipped = _skipped(rows)
    if skipped:
        lines.append("not run:")
        lines += [f"  {name}: {reason}" for name, reason in skipped]
    return "\n".join(lines).rstrip() + "\n"


def _format_summary(rows: list[dict[str, Any]], ours: list[str]) -> list[str]:
    """One table: our first backend's speed-up over every peer, by shape (and threads)."""
    if not ours:
        return []
    mine = ours[0]
    columns = sorted(
        {(tuple(r["shape"]), r["dtype"], r["threads"]) for r in rows if r["sweep"] == "shapes"},
        key=lambda c: (c[1], c[0][0] * c[0][1], c[2]),
    )
    entries: dict[tuple[str, str], dict[tuple, str]] = {}
    for row in rows:
        if row["sweep"] != "shapes" or row["status"] != "ok":
            continue
        column = (tuple(row["shape"]), row["dtype"], row["threads"])
        if row["kind"] == ROOFLINE:
            mine_row = next(
                (
                    r
                    for r in rows
                    if r["implementation"] == mine
                    and r["status"] == "ok"
                    and r["sweep"] == "shapes"
                    and r["kernel"] == row["kernel"]
                    and (tuple(r["shape"]), r["dtype"], r["threads"]) == column
                ),
                None,
            )
            if mine_row is not None:
                key = (row["kernel"], f"{mine} x roofline")
                entries.setdefault(key, {})[column] = format_ratio(mine_row["x_roofline"])
        elif row["kind"] == PEER and mine in row.get("speedup", {}):
            key = (row["kernel"], row["implementation"])
            entries.setdefault(key, {})[column] = format_ratio(row["speedup"][mine])
    if not entries:
        return []
    header = ["kernel", "compared with"] + [
        f"{shape_name(shape)} f{dtype[-2:]} {threads}T" for shape, dtype, threads in columns
    ]
    table = [
        [k, name] + [cells.get(c, "") for c in columns] for (k, name), cells in entries.items()
    ]
    return [
        f"summary: speed-up of {mine} over each implementation (its median / ours), and ours over",
        "the roofline (its median / the copy's); columns: shape, dtype, threads",
        *_table(header, table),
        "",
    ]


def _format_memory(memory: list[dict[str, Any]]) -> list[str]:
    done = [row for row in memory if row.get("status") == "ok"]
    if not done:
        return []
    method = done[0]["method"]
    shape, dtype = done[0]["shape"], done[0]["dtype"]
    table = [
        [
            row["kernel"],
            row["implementation"],
            f"{row['extra_peak_bytes'] / 2**20:.1f}",
            f"{row['bytes_written'] / 2**20:.1f}",
            format_ratio(row["extra_peak_bytes"] / row["bytes_written"])
            if row["bytes_written"] and row["kind"] != ROOFLINE
            else "",
        ]
        for row in done
    ]
    header = ["kernel", "implementation", "extra peak MiB", "outputs MiB", "over outputs"]
    return [
        f"extra peak memory of one call, {shape_name(shape)} {dtype}: {method}, one fresh "
        "process per row",
        *_table(header, table),
        "",
    ]


def _format_startup(startup: dict[str, Any]) -> list[str]:
    lines = [
        "import time, in a fresh interpreter each (with what the module imports: numpy, numba)"
    ]
    table = [
        [row["what"], format_seconds(row["seconds"]) if row["status"] == "ok" else row["reason"]]
        for row in startup["imports"]
    ]
    lines += [*_table(["import", "seconds"], table), ""]
    lines.append("first and second call on 8x128 float32 (fresh process each; numba cache in a")
    lines.append("temporary NUMBA_CACHE_DIR with PPO_FAST_NUMBA_CACHE=1)")
    header = ["backend", "load", *FIRST_CALL_KERNELS]
    table = []
    for row in startup["first_calls"]:
        label = f"{row['backend']} {row['mode']}".strip()
        if row["status"] != "ok":
            table.append([label, row["reason"][:60]] + [""] * len(FIRST_CALL_KERNELS))
            continue
        cells = [
            f"{format_seconds(row['calls'][k]['first'])}/{format_seconds(row['calls'][k]['second'])}"
            for k in FIRST_CALL_KERNELS
        ]
        table.append([label, format_seconds(row["import_and_load"]), *cells])
    return [*lines, *_table(header, table), ""]


def _skipped(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    seen: dict[str, str] = {}
    for row in rows:
        if row["status"] in ("skipped", "mismatch", "error"):
            name = f"{row['kernel']} / {row['implementation']}"
            if row["status"] == "skipped" and "tokens only" in row["reason"]:
                name = f"{row['implementation']} above {PYTHON_MAX_TOKENS} tokens"
            elif row["status"] == "skipped":
                name = row["implementation"]
            seen.setdefault(name, f"{row['status']}: {row['reason']}")
    return sorted(seen.items())


def plot(rows: list[dict[str, Any]], path: str, dtype: str | None = None, threads=None) -> None:
    """Time against tokens (log-log), one panel per kernel, one line per implementation."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise RuntimeError(f"--plot needs matplotlib: {BENCH_EXTRA}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [row for row in rows if row["status"] == "ok"]
    if not ok:
        raise RuntimeError("nothing was measured: there is nothing to plot")
    dtype = dtype or ok[0]["dtype"]
    threads = threads or max(row["threads"] for row in ok)
    kernels = [k for k in KERNELS if any(r["kernel"] == k for r in ok)]
    columns = min(4, len(kernels))
    lines_of = (len(kernels) + columns - 1) // columns
    figure, axes = plt.subplots(
        lines_of, columns, figsize=(4.2 * columns, 3.6 * lines_of), squeeze=False
    )
    for axis in axes.flat[len(kernels) :]:
        axis.set_visible(False)
    for axis, kernel in zip(axes.flat, kernels, strict=False):
        series: dict[str, dict[int, float]] = {}
        for row in ok:
            if row["kernel"] == kernel and row["dtype"] == dtype and row["threads"] == threads:
                points = series.setdefault(row["implementation"], {})
                points[row["tokens"]] = min(points.get(row["tokens"], math.inf), row["median"])
        for name, points in series.items():
            tokens = sorted(points)
            style = (
                {"color": "black", "linestyle": "--", "linewidth": 2} if name == "roofline" else {}
            )
            if name.startswith("ppo_fast"):
                style = {"linewidth": 2.5}
            axis.plot(
                tokens, [points[t] for t in tokens], marker="o", markersize=3, label=name, **style
            )
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_title(kernel, fontsize=10)
        axis.set_xlabel("tokens (B x T)")
        axis.set_ylabel("seconds per call")
        axis.grid(True, which="major", alpha=0.3)
        axis.legend(fontsize=6, loc="upper left")
    figure.suptitle(f"ppo_fast and peers, {dtype}, {threads} thread{'s' * (threads > 1)}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# --------------------------------------------------------------------------------------------
# ppo-fast bench


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def add_arguments(parser) -> None:
    """The options of ``ppo-fast bench``."""
    parser.add_argument(
        "--shapes",
        default=",".join(map(shape_name, DEFAULT_SHAPES)),
        help="comma-separated BxT batch shapes (default: %(default)s; the issue's full set is "
        + ",".join(map(shape_name, ALL_SHAPES))
        + ")",
    )
    parser.add_argument(
        "--threads", default=",".join(map(str, DEFAULT_THREADS)), help="thread counts (%(default)s)"
    )
    parser.add_argument(
        "--dtype", default="float32", help="float32, float64 or both, comma-separated"
    )
    parser.add_argument(
        "--kernels", default=",".join(KERNELS), help="comma-separated kernels (default: all)"
    )
    parser.add_argument(
        "--scaling",
        default="1e7",
        metavar="MAX_TOKENS",
        help="time our compiled kernels and the roofline at 1e3, 1e4, ... up to this many tokens, "
        "at the largest thread count, and fit the exponent (default %(default)s; 0: no sweep)",
    )
    parser.add_argument(
        "--budget", type=float, default=0.08, help="seconds of timing per row (%(default)s)"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="minimum samples per row (%(default)s)"
    )
    parser.add_argument(
        "--memory", action="store_true", help="also measure the extra peak memory of each row"
    )
    parser.add_argument(
        "--startup", action="store_true", help="also measure import and first-call times"
    )
    parser.add_argument("--json", metavar="PATH", help="write the raw results as JSON")
    parser.add_argument("--plot", metavar="PATH.png", help="draw time against tokens (matplotlib)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def plan_from(args) -> Plan:
    kernels = tuple(_csv(args.kernels))
    unknown = [k for k in kernels if k not in KERNELS]
    if unknown:
        raise ValueError(
            f"unknown kernel(s) {', '.join(unknown)}; choose from {', '.join(KERNELS)}"
        )
    dtypes = tuple(_csv(args.dtype))
    for dtype in dtypes:
        if dtype not in ("float32", "float64"):
            raise ValueError(f"--dtype takes float32 and/or float64, got {dtype!r}")
    try:
        threads = tuple(int(t) for t in _csv(args.threads))
    except ValueError:
        raise ValueError(f"--threads takes integers, like 1,2; got {args.threads!r}") from None
    if not threads or min(threads) < 1:
        raise ValueError(f"--threads takes positive integers, got {args.threads!r}")
    try:
        largest = float(args.scaling)
    except ValueError:
        raise ValueError(f"--scaling takes a token count like 1e7, got {args.scaling!r}") from None
    scaling = tuple(10**k for k in range(3, 9) if 10**k <= largest)
    if args.budget <= 0 or args.repeats < 1:
        raise ValueError("--budget must be > 0 and --repeats >= 1")
    return Plan(
        kernels=kernels,
        shapes=tuple(parse_shape(s) for s in _csv(args.shapes)),
        dtypes=dtypes,
        threads=threads,
        budget=args.budget,
        min_repeats=args.repeats,
        scaling_tokens=scaling,
    )


def run_command(args) -> int:
    """``ppo-fast bench``: measure, print the tables, write the JSON and the plot."""
    quiet_openmp()  # before anything loads libgomp
    try:
        plan = plan_from(args)
    except ValueError as error:
        print(f"ppo-fast bench: {error}", file=sys.stderr)
        return 2
    if not plan.shapes or not plan.dtypes or not plan.kernels:
        print("ppo-fast bench: nothing to measure", file=sys.stderr)
        return 2
    env = environment()
    total = len(plan.rows())
    if args.memory:
        total += sum(len(KERNELS[k].implementations) for k in plan.kernels)
    if args.startup:
        total += len(IMPORTS) + 4
    progress = Progress(total, enabled=not args.no_progress)
    seconds = {}
    start = time.perf_counter()
    rows = run(plan, progress)
    seconds["timing"] = time.perf_counter() - start
    memory = None
    if args.memory:
        start = time.perf_counter()
        largest = max(plan.shapes, key=lambda s: s[0] * s[1])
        memory = measure_memory(plan, largest, progress)
        seconds["memory"] = time.perf_counter() - start
    startup = None
    if args.startup:
        start = time.perf_counter()
        startup = measure_startup(progress)
        seconds["startup"] = time.perf_counter() - start
    print(format_report(rows, env, memory, startup), end="")
    if args.json:
        document = {
            "environment": env,
            "seconds": seconds,
            "plan": {
                "kernels": plan.kernels,
                "shapes": [list(s) for s in plan.shapes],
                "dtypes": plan.dtypes,
                "threads": plan.threads,
                "budget": plan.budget,
                "min_repeats": plan.min_repeats,
                "scaling_tokens": plan.scaling_tokens,
            },
            "rows": rows,
            "exponents": exponents(rows),
            "memory": memory,
            "startup": startup,
        }
        with open(args.json, "w") as f:
            json.dump(document, f, indent=1)
    if args.plot:
        try:
            plot(rows, args.plot)
        except RuntimeError as error:
            print(f"ppo-fast bench: {error}", file=sys.stderr)
            return 2
    failed = [r for r in rows if r["status"] in ("mismatch", "error")]
    return 1 if failed else 0
