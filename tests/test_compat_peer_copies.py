"""The verbatim copies in tests/peers are the peers' code: each definition hashes to the
fingerprint recorded from the peer's wheel and, where that wheel is installed (pip install
--no-deps verl==0.9.1 openrlhf==0.11.2 trl==0.29.1), the installed source hashes to it too."""

from __future__ import annotations

import ast
import inspect

import peers
import pytest
from peers import _source

COPIES = {copy.DISTRIBUTION[0]: copy for copy in peers.COPIES}
DEFINITIONS = [
    (name, path, definition)
    for name, copy in COPIES.items()
    for path, definitions in copy.FINGERPRINTS.items()
    for definition in definitions
]


def _copy_definitions(copy) -> dict[str, ast.AST]:
    return _source.definitions(inspect.getsource(copy))


@pytest.mark.parametrize(
    ("peer", "path", "definition"), DEFINITIONS, ids=[f"{p}:{d}" for p, _, d in DEFINITIONS]
)
def test_copy_matches_the_recorded_fingerprint(peer, path, definition):
    copy = COPIES[peer]
    found = _copy_definitions(copy)
    node = found[definition.rsplit(".", 1)[-1]]
    assert _source.fingerprint(node) == copy.FINGERPRINTS[path][definition], (
        f"tests/peers copy of {peer} {path}::{definition} differs from the peer's code"
    )


def test_trl_trainer_block_matches_the_recorded_fingerprint():
    copy = COPIES["trl"]
    recorded = copy.TRAINER_BLOCK[-1]
    function = _copy_definitions(copy)["ppo_trainer_advantages"]
    statements = function.body[1:-1]  # without the docstring and the return
    assert _source.fingerprint(statements) == recorded


def _installed_label(name: str) -> str:
    distribution, version = COPIES[name].DISTRIBUTION
    found = _source.installed_source(distribution, version, next(iter(COPIES[name].FINGERPRINTS)))
    return f"{name}-installed" if found is not None else f"{name}-not-installed"


@pytest.mark.parametrize("peer", list(COPIES), ids=[_installed_label(n) for n in COPIES])
def test_recorded_fingerprints_match_the_installed_wheel(peer):
    """Where the wheel is installed, its source has the recorded fingerprints; where it is not,
    the recorded table must at least cover every definition the compat module reproduces."""
    copy = COPIES[peer]
    distribution, version = copy.DISTRIBUTION
    for path, recorded in copy.FINGERPRINTS.items():
        text = _source.installed_source(distribution, version, path)
        if text is None:
            assert set(recorded) <= {
                *_copy_definitions(copy),
                "RemoteExperienceMaker.get_advantages_and_returns",
            }
            continue
        found = _source.definitions(text)
        for definition, fingerprint in recorded.items():
            assert _source.fingerprint(found[definition]) == fingerprint, (
                f"{distribution} {version} {path}::{definition}"
            )
        if peer == "trl" and path == copy.TRAINER_BLOCK[0]:
            _, method, first, last, block = copy.TRAINER_BLOCK
            statements = _source.statements_between(found[method], first, last)
            assert _source.fingerprint(statements) == block
