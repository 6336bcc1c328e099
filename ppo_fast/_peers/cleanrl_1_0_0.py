# MIT License
#
# Copyright (c) 2019 CleanRL developers
#
# Permission is hereby granted, free of charge, to any person obtaining a copy
# of this software and associated documentation files (the "Software"), to deal
# in the Software without restriction, including without limitation the rights
# to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
# copies of the Software, and to permit persons to whom the Software is
# furnished to do so, subject to the following conditions:
#
# The above copyright notice and this permission notice shall be included in all
# copies or substantial portions of the Software.
#
# THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
# IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
# FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
# AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
# LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
# OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE
# SOFTWARE.
"""A verbatim copy of CleanRL's GAE, from its PPO script.

Source: https://github.com/vwxyzjn/cleanrl, release v1.0.0 (commit c37a3ec4), cleanrl/ppo.py: the
block under "# bootstrap value if not done" in the training loop, here the body of
``ppo_advantages``. Time-major (num_steps, num_envs) tensors; ``dones[t]`` is 1 when step t starts
a new episode. The statements are CleanRL's, byte for byte apart from formatting;
``BLOCKS`` records their fingerprint (ppo_fast._peers.fingerprint), taken from the release.
"""

# Third-party code, kept verbatim: not linted.
# ruff: noqa
from __future__ import annotations

import torch


def ppo_advantages(args, agent, next_obs, next_done, rewards, dones, values, device):
    """cleanrl/ppo.py's GAE block, verbatim; ``args`` carries num_steps, gamma and gae_lambda,
    ``agent.get_value`` the value of the state after the last step."""
    # bootstrap value if not done
    with torch.no_grad():
        next_value = agent.get_value(next_obs).reshape(1, -1)
        advantages = torch.zeros_like(rewards).to(device)
        lastgaelam = 0
        for t in reversed(range(args.num_steps)):
            if t == args.num_steps - 1:
                nextnonterminal = 1.0 - next_done
                nextvalues = next_value
            else:
                nextnonterminal = 1.0 - dones[t + 1]
                nextvalues = values[t + 1]
            delta = rewards[t] + args.gamma * nextvalues * nextnonterminal - values[t]
            advantages[t] = lastgaelam = (
                delta + args.gamma * args.gae_lambda * nextnonterminal * lastgaelam
            )
        returns = advantages + values
    return advantages, returns


DISTRIBUTION = ("cleanrl", "1.0.0")
FINGERPRINTS: dict = {}
BLOCKS = {
    "ppo_advantages": (
        "cleanrl/ppo.py",
        "",  # the block is in the script's main block, not in a definition
        "with torch.no_grad():\n    next_value = agent.get_value(next_obs)",
        "with torch.no_grad():\n    next_value = agent.get_value(next_obs)",
        "ddbfc1c692c22a0f",
    ),
}
