"""The worked examples of ../shared/seeds/, reproduced through the public API on every backend.

Each number is compared to the seed's own rounding (half a unit in its last printed digit).
"""

import numpy as np
import pytest

import ppo_fast

# 000_6f9e75577438e6f5.txt: "The answer is", score 0.7, beta 0.2, gamma 1, lambda 0.95.
LOGPROBS = np.array([[-0.9, -1.4, -0.6]])
REF_LOGPROBS = np.array([[-1.2, -0.8, -0.7]])
VALUES = np.array([[0.3, 0.5, 0.6]])
SCORE = np.array([0.7])


def close(actual, expected, decimals):
    np.testing.assert_allclose(actual, expected, rtol=0, atol=0.5 * 10.0**-decimals + 1e-12)


def test_seed_000_kl_per_token(backend):
    close(ppo_fast.kl_penalty(LOGPROBS, REF_LOGPROBS, "k1", backend=backend), [[0.3, -0.6, 0.1]], 1)


def test_seed_000_full_pipeline(backend):
    rewards = ppo_fast.shape_rewards(SCORE, LOGPROBS, REF_LOGPROBS, kl_coef=0.2, backend=backend)
    close(rewards, [[-0.06, 0.12, 0.68]], 2)
    deltas = ppo_fast.gae(rewards, VALUES, gamma=1.0, lam=0.0, backend=backend).advantages
    close(deltas, [[0.14, 0.22, 0.08]], 2)
    result = ppo_fast.gae(rewards, VALUES, gamma=1.0, lam=0.95, backend=backend)
    close(result.advantages, [[0.421, 0.296, 0.08]], 3)
    close(result.returns, result.advantages + VALUES, 12)
    moments = ppo_fast.masked_moments(result.advantages, backend=backend)
    close(moments.mean, 0.266, 3)
    close(np.sqrt(moments.var()), 0.141, 3)
    # The seed prints -1.31 for the third token; the mathematics gives -1.3179 (even from the
    # seed's own rounded mean and sigma, (0.08 - 0.266) / 0.141 = -1.319), which rounds to -1.32.
    normalised = ppo_fast.whiten(result.advantages, backend=backend)
    close(normalised, [[1.10, 0.21, -1.32]], 2)
    close(normalised[0, 2], -1.31, 1)  # the seed's figure, to the digit it got right


def test_seed_003_example_7_shaped_rewards(backend):
    policy = np.log(np.array([[0.9, 0.5, 0.4]]))
    reference = np.log(np.array([[0.3, 0.5, 0.8]]))
    close(ppo_fast.kl_penalty(policy, reference, backend=backend), [[1.0986, 0.0, -0.6931]], 4)
    rewards = ppo_fast.shape_rewards(
        np.array([1.0]), policy, reference, kl_coef=0.2, backend=backend
    )
    close(rewards, [[-0.2197, 0.0, 1.1386]], 4)
    close(rewards.sum(), 0.9189, 4)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_seed_000_in_every_layout(backend, dtype):
    """The seed's row, padded on either side or packed beside other rows, gives the same numbers."""
    expected = [0.4212, 0.296, 0.08]
    junk = np.nan
    logp = np.array([[junk, -0.9, -1.4, -0.6], [-0.1, -0.2, junk, junk]], dtype=dtype)
    ref = np.array([[junk, -1.2, -0.8, -0.7], [-0.3, -0.1, junk, junk]], dtype=dtype)
    values = np.array([[junk, 0.3, 0.5, 0.6], [0.2, 0.1, junk, junk]], dtype=dtype)
    mask = np.array([[0, 1, 1, 1], [1, 1, 0, 0]])
    scores = np.array([0.7, 0.0])
    rewards = ppo_fast.shape_rewards(scores, logp, ref, kl_coef=0.2, mask=mask, backend=backend)
    advantages = ppo_fast.gae(rewards, values, mask=mask, backend=backend).advantages
    np.testing.assert_allclose(advantages[0, 1:], expected, atol=1e-6)
    assert advantages[0, 0] == 0.0 and advantages.dtype == dtype

    cu = np.array([0, 2, 5])
    packed = {
        "logp": np.array([-0.1, -0.2, -0.9, -1.4, -0.6], dtype=dtype),
        "ref": np.array([-0.3, -0.1, -1.2, -0.8, -0.7], dtype=dtype),
        "values": np.array([0.2, 0.1, 0.3, 0.5, 0.6], dtype=dtype),
    }
    rewards = ppo_fast.shape_rewards(
        np.array([0.0, 0.7]),
        packed["logp"],
        packed["ref"],
        kl_coef=0.2,
        cu_seqlens=cu,
        backend=backend,
    )
    advantages = ppo_fast.gae(rewards, packed["values"], cu_seqlens=cu, backend=backend).advantages
    np.testing.assert_allclose(advantages[2:], expected, atol=1e-6)
