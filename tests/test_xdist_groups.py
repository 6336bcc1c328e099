"""conftest's xdist groups: numba's tests of one dtype share a group (so that a worker compiles
that dtype's kernels for all of them), the rest keep theirs or none."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import conftest
import numpy as np
import pytest


@dataclass
class Implementation:  # a bench implementation: what conftest reads of it is its backend
    backend: str | None


@dataclass
class Callspec:
    params: dict


@dataclass
class Item:
    """What the hook reads of a pytest item: its parameters, markers and file."""

    params: dict | None
    marks: list = field(default_factory=list)
    path: Path = Path("tests/test_gae.py")

    def __post_init__(self):
        if self.params is not None:
            self.callspec = Callspec(self.params)

    def get_closest_marker(self, name):
        return next((mark for mark in self.marks if mark.name == name), None)

    def add_marker(self, mark):
        self.marks.append(mark.mark)

    def group(self):
        mark = self.get_closest_marker("xdist_group")
        return mark.args[0] if mark else None


def groups(items, monkeypatch, workers):
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(workers))
    conftest.pytest_collection_modifyitems(None, items)
    return [item.group() for item in items]


def test_numbas_tests_of_one_dtype_share_a_group_and_others_keep_theirs(monkeypatch):
    ray = pytest.mark.xdist_group("ray").mark
    float32 = pytest.mark.numba_dtype("float32").mark
    items = [
        Item({"backend": "numba", "dtype": np.float32}),
        Item({"compiled_backend": "numba", "dtype": np.dtype(np.float64), "layout": "mask"}),
        Item({"implementation": Implementation("numba"), "dtype": "float32"}),
        Item({"dtype": np.float64}, [pytest.mark.numba.mark]),  # runs numba beside Cython
        Item(None, [conftest.NUMBA_PARALLEL.mark]),  # the parallel builds: float32's group
        Item({"backend": "cython", "dtype": np.float32}),
        Item({"implementation": Implementation("cython"), "dtype": "float64"}),
        Item({"dtype": np.float32}),  # neither a numba parameter nor the marker
        Item({"backend": "cython"}, [float32]),  # the dtype marker alone: not numba
        Item({"backend": "numba", "a": np.float32, "b": "float64"}),  # two dtypes
        Item({"backend": "numba", "dtype": np.float32}, [ray]),  # a group of its own
        Item(None),
        # no dtype among the parameters: the marker's, else NumPy's default
        Item({"backend": "numba"}, [float32]),
        Item({"backend": "numba", "dtype": np.float64}, [float32]),  # the parameter's first
        Item({"backend": "numba"}),
        Item({"backend": "numba", "dtypes": ["float32", "float64"], "x": np.zeros(2)}),
        Item(None, [pytest.mark.numba.mark]),
        Item({"backend": "numba", "dtype": np.float64}, [conftest.NUMBA_PARALLEL.mark]),
    ]
    expected = ["numba_float32", "numba_float64", "numba_float32", "numba_float64"]
    expected += ["numba_float32", *[None] * 5, "ray", None]
    expected += ["numba_float32", "numba_float64", "numba_float64", "numba_float64"]
    expected += ["numba_float64", "numba_float64"]
    assert groups(items, monkeypatch, workers=2) == expected


def test_on_more_workers_a_dtypes_tests_split_by_file(monkeypatch):
    files = [Path(f"tests/test_{name}.py") for name in ("gae", "loss", "policy", "returns")]
    made = [Item({"backend": "numba", "dtype": np.float32}, path=path) for path in files]
    split = groups(made, monkeypatch, workers=8)
    assert all(group.startswith("numba_float32_") for group in split)
    assert {int(group.rsplit("_", 1)[1]) for group in split} <= set(range(4))  # 8 // 2 groups
    again = [Item({"backend": "numba", "dtype": np.float32}, path=path) for path in files]
    assert groups(again, monkeypatch, workers=8) == split  # each worker collects the same groups
    one = [Item({"backend": "numba", "dtype": np.float32}, path=path) for path in files]
    assert groups(one, monkeypatch, workers=3) == ["numba_float32"] * len(files)
