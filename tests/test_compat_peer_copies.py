"""The verbatim copies in ppo_fast._peers are the peers' code: each definition and each copied
block of inline trainer code hashes to the fingerprint recorded from the peer's release and, where
that release is installed (pip install --no-deps verl==0.9.1 openrlhf==0.11.2 trl==0.29.1
stable-baselines3==2.7.1), the installed source hashes to it too. CleanRL v1.0.0 and Spinning Up
0.2 are not on the package index at those versions: their fingerprints were taken from the
release tags' source."""

from __future__ import annotations

import inspect
import os

import peers
import pytest

from ppo_fast._peers import fingerprint

COPIES = {copy.__name__.rsplit(".", 1)[-1]: copy for copy in peers.COPIES}
DEFINITIONS = [
    (name, path, definition)
    for name, copy in COPIES.items()
    for path, definitions in copy.FINGERPRINTS.items()
    for definition in definitions
]
BLOCKS = [(name, function) for name, copy in COPIES.items() for function in copy.BLOCKS]


def _copy_definitions(copy):
    return fingerprint.definitions(inspect.getsource(copy))


@pytest.mark.parametrize(
    ("peer", "path", "definition"), DEFINITIONS, ids=[f"{p}:{d}" for p, _, d in DEFINITIONS]
)
def test_copy_matches_the_recorded_fingerprint(peer, path, definition):
    copy = COPIES[peer]
    node = _copy_definitions(copy)[definition.rsplit(".", 1)[-1]]
    assert fingerprint.fingerprint(node) == copy.FINGERPRINTS[path][definition], (
        f"the copy of {peer} {path}::{definition} differs from the peer's code"
    )


@pytest.mark.parametrize(("peer", "function"), BLOCKS, ids=[f"{p}:{f}" for p, f in BLOCKS])
def test_copied_block_matches_the_recorded_fingerprint(peer, function):
    copy = COPIES[peer]
    recorded = copy.BLOCKS[function][-1]
    statements = fingerprint.block_statements(_copy_definitions(copy)[function])
    assert fingerprint.fingerprint(statements) == recorded, (
        f"the copy of {peer} {function} differs from the peer's code"
    )


# The releases .ci/run installs (--no-deps), so that CI checks every copy against its source.
ON_THE_INDEX = {"verl_0_9_1", "openrlhf_0_11_2", "trl_0_29_1", "stable_baselines3_2_7_1"}


def _paths(copy) -> list[str]:
    return [*copy.FINGERPRINTS, *(block[0] for block in copy.BLOCKS.values())]


def _installed_label(name: str) -> str:
    distribution, version = COPIES[name].DISTRIBUTION
    found = fingerprint.installed_source(distribution, version, _paths(COPIES[name])[0])
    return f"{name}-installed" if found is not None else f"{name}-not-installed"


@pytest.mark.parametrize("peer", list(COPIES), ids=[_installed_label(n) for n in COPIES])
def test_recorded_fingerprints_match_the_installed_release(peer):
    """Where the release is installed, its source has the recorded fingerprints; where it is not,
    the recorded table must at least cover every definition and block the copy holds."""
    copy = COPIES[peer]
    distribution, version = copy.DISTRIBUTION
    copied = _copy_definitions(copy)
    for path, recorded in copy.FINGERPRINTS.items():
        text = fingerprint.installed_source(distribution, version, path)
        if text is None and os.environ.get("CI") and peer in ON_THE_INDEX:
            pytest.fail(f"CI installs {distribution}=={version} (.ci/run): it is missing")
        if text is None:
            assert {name.rsplit(".", 1)[-1] for name in recorded} <= set(copied)
            continue
        found = fingerprint.definitions(text)
        for definition, expected in recorded.items():
            assert fingerprint.fingerprint(found[definition]) == expected, (
                f"{distribution} {version} {path}::{definition}"
            )
    for function, (path, method, first, last, expected) in copy.BLOCKS.items():
        assert function in copied
        text = fingerprint.installed_source(distribution, version, path)
        if text is not None:
            statements = fingerprint.source_block(text, method, first, last)
            assert fingerprint.fingerprint(statements) == expected, (
                f"{distribution} {version} {path}::{method or 'module'} block of {function}"
            )
