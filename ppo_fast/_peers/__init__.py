"""Verbatim copies of the peers' released code: what ``ppo-fast bench`` times, what the parity
tests of ppo_fast.compat compare with, and the code that ppo_fast.compat runs wherever a peer's
function stays plain torch (its argument checks, its torch paths, its controllers), so that no
peer code is written twice.

Each module copies named definitions (or blocks of inline trainer code, as the body of a
function) of one release of one peer, byte for byte apart from formatting, and starts with the
licence and copyright notice of the files it copies. It records where each comes from and its
fingerprint (``fingerprint``: a hash of the syntax tree without docstrings and decorators) in
``DISTRIBUTION``, ``FINGERPRINTS`` and ``BLOCKS``; tests/test_compat_peer_copies.py holds every
copy to its fingerprint and, where the release is installed, the installed source to it too.

    verl_0_9_1               verl 0.9.1 (Apache-2.0)
    openrlhf_0_11_2          OpenRLHF 0.11.2 (Apache-2.0)
    trl_0_29_1               TRL 0.29.1 (Apache-2.0)
    cleanrl_1_0_0            CleanRL v1.0.0 (MIT)
    stable_baselines3_2_7_1  Stable-Baselines3 2.7.1 (MIT)
    spinningup_0_2           Spinning Up 0.2 (MIT)

The copies import torch or scipy at the top: import them with ``copy(name)`` when a row needs
them, or from a compat module (which imports torch anyway), never from ``import ppo_fast``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

COPIES = (
    "verl_0_9_1",
    "openrlhf_0_11_2",
    "trl_0_29_1",
    "cleanrl_1_0_0",
    "stable_baselines3_2_7_1",
    "spinningup_0_2",
)


def copy(name: str) -> ModuleType:
    """The copy module ``name`` (one of ``COPIES``), imported on first use."""
    if name not in COPIES:
        raise KeyError(f"no peer copy {name!r}; the copies are {', '.join(COPIES)}")
    return importlib.import_module(f"{__name__}.{name}")
