# The MIT License
#
# Copyright (c) 2018 OpenAI (http://openai.com)
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
"""A verbatim copy of Spinning Up's GAE: SciPy's lfilter as the discounted cumulative sum.

Source: https://github.com/openai/spinningup, release 0.2 (commit e76f3cc1; Spinning Up is not
on the package index):
  spinup/algos/pytorch/ppo/core.py  discount_cumsum
  spinup/algos/pytorch/ppo/ppo.py   PPOBuffer.finish_path, here a function that takes the buffer
                                    as ``self`` (flat rew_buf, val_buf, adv_buf, ret_buf,
                                    path_start_idx, ptr, gamma, lam), called once per trajectory
``core`` is a stand-in for the module finish_path reads discount_cumsum from. The bodies are
Spinning Up's, byte for byte apart from formatting; their fingerprints are in ``FINGERPRINTS``
(ppo_fast._peers.fingerprint), taken from the release. Spinning Up's value targets
(``ret_buf``) are the rewards-to-go, not advantages + values.
"""

# Third-party code, kept verbatim: not linted.
# ruff: noqa
from __future__ import annotations

import types

import numpy as np
import scipy.signal


# spinup/algos/pytorch/ppo/core.py
def discount_cumsum(x, discount):
    """
    magic from rllab for computing discounted cumulative sums of vectors.

    input:
        vector x,
        [x0,
         x1,
         x2]

    output:
        [x0 + discount * x1 + discount^2 * x2,
         x1 + discount * x2,
         x2]
    """
    return scipy.signal.lfilter([1], [1, float(-discount)], x[::-1], axis=0)[::-1]


core = types.SimpleNamespace(discount_cumsum=discount_cumsum)


# spinup/algos/pytorch/ppo/ppo.py (PPOBuffer)
def finish_path(self, last_val=0):
    """
    Call this at the end of a trajectory, or when one gets cut off
    by an epoch ending. This looks back in the buffer to where the
    trajectory started, and uses rewards and value estimates from
    the whole trajectory to compute advantage estimates with GAE-Lambda,
    as well as compute the rewards-to-go for each state, to use as
    the targets for the value function.

    The "last_val" argument should be 0 if the trajectory ended
    because the agent reached a terminal state (died), and otherwise
    should be V(s_T), the value function estimated for the last state.
    This allows us to bootstrap the reward-to-go calculation to account
    for timesteps beyond the arbitrary episode horizon (or epoch cutoff).
    """

    path_slice = slice(self.path_start_idx, self.ptr)
    rews = np.append(self.rew_buf[path_slice], last_val)
    vals = np.append(self.val_buf[path_slice], last_val)

    # the next two lines implement GAE-Lambda advantage calculation
    deltas = rews[:-1] + self.gamma * vals[1:] - vals[:-1]
    self.adv_buf[path_slice] = core.discount_cumsum(deltas, self.gamma * self.lam)

    # the next line computes rewards-to-go, to be targets for the value function
    self.ret_buf[path_slice] = core.discount_cumsum(rews, self.gamma)[:-1]

    self.path_start_idx = self.ptr


DISTRIBUTION = ("spinup", "0.2")
FINGERPRINTS = {
    "spinup/algos/pytorch/ppo/core.py": {"discount_cumsum": "ea03b9f1d8fed7d2"},
    "spinup/algos/pytorch/ppo/ppo.py": {"PPOBuffer.finish_path": "07662323a785e0dc"},
}
BLOCKS: dict = {}
