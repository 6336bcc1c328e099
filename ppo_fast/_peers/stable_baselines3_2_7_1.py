# The MIT License
#
# Copyright (c) 2019 Antonin Raffin
#
# Permission is hereby granted, free of charge, to any person obtaining a copy
# of this software and associated documentation files (the "Software"), to deal
# in the Software without restriction, including without limitation the rights
# to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
# copies of the Software, and to permit persons to whom the Software is
# furnished to do so, subject to the following conditions:
#
# The above copyright notice and this permission notice shall be included in
# all copies or substantial portions of the Software.
#
# THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
# IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
# FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
# AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
# LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
# OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN
# THE SOFTWARE.
"""A verbatim copy of Stable-Baselines3's GAE.

Source: https://github.com/DLR-RM/stable-baselines3, release v2.7.1 (PyPI
stable-baselines3==2.7.1), stable_baselines3/common/buffers.py:
RolloutBuffer.compute_returns_and_advantage, here a function that takes the buffer as ``self``
(buffer_size, rewards, values, episode_starts, advantages, gamma, gae_lambda: time-major
(buffer_size, n_envs) arrays). The body is SB3's, byte for byte apart from formatting; its
fingerprint is in ``FINGERPRINTS`` (ppo_fast._peers.fingerprint), taken from the wheel.
"""

# Third-party code, kept verbatim: not linted.
# ruff: noqa
from __future__ import annotations

import numpy as np
import torch as th


# stable_baselines3/common/buffers.py (RolloutBuffer)
def compute_returns_and_advantage(self, last_values: th.Tensor, dones: np.ndarray) -> None:
    """
    Post-processing step: compute the lambda-return (TD(lambda) estimate)
    and GAE(lambda) advantage.

    Uses Generalized Advantage Estimation (https://arxiv.org/abs/1506.02438)
    to compute the advantage. To obtain Monte-Carlo advantage estimate (A(s) = R - V(S))
    where R is the sum of discounted reward with value bootstrap
    (because we don't always have full episode), set ``gae_lambda=1.0`` during initialization.

    The TD(lambda) estimator has also two special cases:
    - TD(1) is Monte-Carlo estimate (sum of discounted rewards)
    - TD(0) is one-step estimate with bootstrapping (r_t + gamma * v(s_{t+1}))

    For more information, see discussion in https://github.com/DLR-RM/stable-baselines3/pull/375.

    :param last_values: state value estimation for the last step (one for each env)
    :param dones: if the last step was a terminal step (one bool for each env).
    """
    # Convert to numpy
    last_values = last_values.clone().cpu().numpy().flatten()  # type: ignore[assignment]

    last_gae_lam = 0
    for step in reversed(range(self.buffer_size)):
        if step == self.buffer_size - 1:
            next_non_terminal = 1.0 - dones.astype(np.float32)
            next_values = last_values
        else:
            next_non_terminal = 1.0 - self.episode_starts[step + 1]
            next_values = self.values[step + 1]
        delta = (
            self.rewards[step] + self.gamma * next_values * next_non_terminal - self.values[step]
        )
        last_gae_lam = delta + self.gamma * self.gae_lambda * next_non_terminal * last_gae_lam
        self.advantages[step] = last_gae_lam
    # TD(lambda) estimator, see Github PR #375 or "Telescoping in TD(lambda)"
    # in David Silver Lecture 4: https://www.youtube.com/watch?v=PnHCvfgC_ZA
    self.returns = self.advantages + self.values


DISTRIBUTION = ("stable-baselines3", "2.7.1")
FINGERPRINTS = {
    "stable_baselines3/common/buffers.py": {
        "RolloutBuffer.compute_returns_and_advantage": "37767990ae917652",
    },
}
BLOCKS: dict = {}
