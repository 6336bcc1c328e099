"""Results on reused memory (``ppo_fast._result_arrays``, ``ppo_fast.set_result_cache``).

A result of at least 1 MiB is made on a block that an earlier result used once nothing refers to
that one: the same bits as a fresh array, and never memory that a live array or tensor still
uses (a view of a result, a torch tensor made from it).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import ppo_fast
from ppo_fast import _result_arrays

SHAPE = (256, 1024)  # float32: 1 MiB, the smallest pooled result


def _batch() -> dict[str, Any]:
    rng = np.random.default_rng(11)
    arrays = {name: (0.1 * rng.standard_normal(SHAPE)).astype(np.float32) for name in "abc"}
    arrays["mask"] = rng.random(SHAPE) < 0.8
    arrays["lengths"] = rng.integers(1, SHAPE[1] + 1, SHAPE[0])
    arrays["scores"] = rng.standard_normal(SHAPE[0])
    return arrays


def _rows4(array: np.ndarray) -> np.ndarray:
    return np.tile(array, (4, 1))


# Every stage's allocation of its results: the fast paths (a bool mask) and the general way
# (lengths, or a layout the fast path does not take).
CALLS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "gae": lambda d: ppo_fast.gae(d["a"], d["b"], mask=d["mask"]),
    "gae general": lambda d: ppo_fast.gae(d["a"], d["b"], lengths=d["lengths"], gamma=0.99),
    "gae general bootstrap": lambda d: ppo_fast.gae(d["a"], d["b"], bootstrap=d["scores"]),
    "whiten": lambda d: ppo_fast.whiten(d["a"], mask=d["mask"]),
    "whiten general": lambda d: ppo_fast.whiten(d["a"], lengths=d["lengths"]),
    "kl_penalty": lambda d: ppo_fast.kl_penalty(d["a"], d["b"], "k3"),
    "shape_rewards": lambda d: ppo_fast.shape_rewards(
        d["scores"], d["a"], d["b"], kl_coef=0.1, mask=d["mask"]
    ),
    "discounted_returns": lambda d: ppo_fast.discounted_returns(d["a"], mask=d["mask"]),
    "clipped_surrogate": lambda d: ppo_fast.clipped_surrogate(
        d["a"], d["b"], d["c"], mask=d["mask"]
    ),
    "clipped_surrogate general": lambda d: ppo_fast.clipped_surrogate(
        d["a"], d["b"], d["c"], lengths=d["lengths"]
    ),
    "value_loss": lambda d: ppo_fast.value_loss(d["a"], d["b"], d["c"], mask=d["mask"], clip=0.2),
    "value_loss general": lambda d: ppo_fast.value_loss(
        d["a"], d["b"], d["c"], lengths=d["lengths"], clip=0.2
    ),
    "cispo_loss": lambda d: ppo_fast.cispo_loss(d["a"], d["b"], d["c"], mask=d["mask"]),
    "cispo_loss general": lambda d: ppo_fast.cispo_loss(
        d["a"], d["b"], d["c"], lengths=d["lengths"]
    ),
    # bool (B, T) results: four times the rows, for 1 MiB
    "kl_cov_selection": lambda d: ppo_fast.kl_cov_selection(
        _rows4(d["a"]), _rows4(d["c"]), mask=_rows4(d["mask"])
    ),
    "kl_cov_selection general": lambda d: ppo_fast.kl_cov_selection(
        _rows4(d["a"]), _rows4(d["c"]), lengths=np.tile(d["lengths"], 4)
    ),
    "broadcast_to_tokens": lambda d: ppo_fast.broadcast_to_tokens(
        d["scores"].astype(np.float32), mask=d["mask"]
    ),
}


def _arrays(result: Any) -> list[np.ndarray]:
    if isinstance(result, np.ndarray):
        return [result]
    if isinstance(result, tuple) and all(isinstance(x, np.ndarray) for x in result):
        return list(result)
    return [result.grad]


@pytest.fixture(autouse=True)
def _fresh_pool():
    """Each test starts with an empty pool at the default limit, and leaves it so."""
    ppo_fast.set_result_cache(0)
    ppo_fast.set_result_cache(_result_arrays.DEFAULT_CACHE_BYTES)
    yield
    ppo_fast.set_result_cache(0)
    ppo_fast.set_result_cache(None)  # back to PPO_FAST_RESULT_CACHE, or the default


def _pooled(array: np.ndarray) -> bool:
    return isinstance(array.base, _result_arrays._Block)


@pytest.mark.parametrize("name", CALLS)
def test_results_reuse_freed_memory_with_the_same_bits_and_never_live_memory(name):
    call, batch = CALLS[name], _batch()
    ppo_fast.set_result_cache(0)
    expected = [a.copy() for a in _arrays(call(batch))]
    assert not any(_pooled(a) for a in _arrays(call(batch)))
    ppo_fast.set_result_cache(_result_arrays.DEFAULT_CACHE_BYTES)

    first = _arrays(call(batch))
    assert all(_pooled(a) for a in first), "a result of 1 MiB is made on a pooled block"
    assert [a.tobytes() for a in first] == [a.tobytes() for a in expected]
    kept = first[0][1:, ::3]  # a view outlives the result it was made from
    kept_bytes = kept.tobytes()
    freed = {a.ctypes.data for a in first[1:]}
    del first
    second = _arrays(call(batch))
    assert [a.tobytes() for a in second] == [a.tobytes() for a in expected]
    for array in second:
        assert not np.shares_memory(array, kept)
    assert {a.ctypes.data for a in second} >= freed  # the blocks nothing refers to: reused
    second[0][...] = 7  # writing a new result leaves the view's memory alone
    assert kept.tobytes() == kept_bytes
    del kept
    third = _arrays(call(batch))
    assert [a.tobytes() for a in third] == [a.tobytes() for a in expected]


def test_a_torch_tensor_made_from_a_result_keeps_its_memory():
    torch = pytest.importorskip("torch")
    batch = _batch()
    advantages, returns = ppo_fast.gae(batch["a"], batch["b"], mask=batch["mask"])
    tensor = torch.from_numpy(advantages)
    saved = tensor.clone()
    address = advantages.ctypes.data
    del advantages, returns
    for _ in range(3):
        result = ppo_fast.gae(batch["b"], batch["a"], mask=batch["mask"])
        assert address not in {a.ctypes.data for a in result}
        del result
    assert torch.equal(tensor, saved)
    del tensor
    result = ppo_fast.gae(batch["b"], batch["a"], mask=batch["mask"])
    assert address in {a.ctypes.data for a in result}


def test_small_results_are_plain_arrays():
    x = np.ones((255, 1024), np.float32)  # a byte under 1 MiB
    assert ppo_fast.whiten(x).flags.owndata
    assert _pooled(ppo_fast.whiten(np.ones((256, 1024), np.float32)))


def test_a_block_serves_results_of_its_size_down_to_half_of_it():
    dtype = np.dtype(np.float32)
    block = _result_arrays.empty((1024, 1024), dtype)  # 4 MiB
    address = block.ctypes.data
    del block
    bigger = _result_arrays.empty((1025, 1024), dtype)
    assert bigger.ctypes.data != address
    under_half = _result_arrays.empty((511, 1024), dtype)
    assert under_half.ctypes.data != address
    half = _result_arrays.empty((512, 1024), dtype)
    assert half.ctypes.data == address and half.shape == (512, 1024)
    assert half.flags.c_contiguous and half.flags.writeable and half.flags.aligned


def test_the_limit_keeps_the_most_recently_freed_and_0_keeps_none():
    dtype = np.dtype(np.float64)
    results = [_result_arrays.empty((128, 1024), dtype) for _ in range(4)]  # 1 MiB each
    addresses = [a.ctypes.data for a in results]
    ppo_fast.set_result_cache(3 << 20)
    for k in range(4):  # freed in order: the first is the least recently freed
        results[k] = None
    pool = _result_arrays._pool
    assert pool.free_bytes == 3 << 20
    assert [b.ctypes.data for b in pool.free] == addresses[1:]
    ppo_fast.set_result_cache(1 << 20)  # a smaller limit gives back the excess now
    assert [b.ctypes.data for b in pool.free] == addresses[3:]
    bigger = _result_arrays.empty((256, 1024), dtype)  # 2 MiB, over the limit: dropped alone
    del bigger
    assert [b.ctypes.data for b in pool.free] == addresses[3:]
    exact = _result_arrays.empty((128, 1024), dtype)  # takes the kept block; at the limit, kept
    assert exact.ctypes.data == addresses[3] and pool.free == []
    del exact
    assert [b.ctypes.data for b in pool.free] == addresses[3:] and pool.free_bytes == 1 << 20
    ppo_fast.set_result_cache(0)
    assert pool.free == [] and pool.free_bytes == 0
    assert _result_arrays.empty((128, 1024), dtype).flags.owndata


def test_a_result_freed_while_the_pool_is_locked_is_kept_by_the_next_call():
    dtype = np.dtype(np.float32)
    result = _result_arrays.empty((256, 1024), dtype)
    address = result.ctypes.data
    pool = _result_arrays._pool
    with pool.lock:  # as a garbage collection inside the pool's locked section would
        del result
        assert [b.ctypes.data for b in pool.returned] == [address]
    assert _result_arrays.empty((256, 1024), dtype).ctypes.data == address
    assert not pool.returned


def test_a_child_forked_while_the_pool_is_locked_reuses_memory():
    """A fork while another thread holds the pool's lock: the child gets a lock of its own."""
    if not hasattr(os, "fork"):
        pytest.skip("no fork on this platform")
    dtype = np.dtype(np.float32)
    result = _result_arrays.empty((256, 1024), dtype)
    address = result.ctypes.data
    del result
    read, write = os.pipe()
    with _result_arrays._pool.lock:
        pid = os.fork()
        if pid == 0:  # the child: report whether it reuses the block, and exit at once
            signal.alarm(20)  # a child stuck on the parent's lock dies: no answer, a failure
            reused = _result_arrays.empty((256, 1024), dtype).ctypes.data == address
            os.write(write, b"1" if reused else b"0")
            os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.close(read)
    os.waitpid(pid, 0)
    assert answer == b"1"


def test_threads_get_separate_memory_and_the_right_results():
    batches = [_batch() for _ in range(4)]
    for k, batch in enumerate(batches):
        batch["a"] = batch["a"] + np.float32(k)
    ppo_fast.set_result_cache(0)
    expected = [[a.copy() for a in ppo_fast.gae(b["a"], b["b"], mask=b["mask"])] for b in batches]
    ppo_fast.set_result_cache(_result_arrays.DEFAULT_CACHE_BYTES)
    failures: list[str] = []

    def work(k: int) -> None:
        held = []
        for step in range(12):
            result = ppo_fast.gae(batches[k]["a"], batches[k]["b"], mask=batches[k]["mask"])
            held.append(result)
            if step % 3 == 2:
                held.clear()
            for got, want in zip(result, expected[k], strict=True):
                if got.tobytes() != want.tobytes():
                    failures.append(f"thread {k} step {step}")
        for old in held:  # still intact after the other threads' calls
            for got, want in zip(old, expected[k], strict=True):
                if got.tobytes() != want.tobytes():
                    failures.append(f"thread {k}: a held result changed")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


@pytest.mark.parametrize(
    ("value", "error", "pattern"),
    [
        (1.5, TypeError, "max_bytes must be an int or None, got float"),
        (True, TypeError, "max_bytes must be an int or None, got bool"),
        ("512", TypeError, "max_bytes must be an int or None, got str"),
        (-1, ValueError, "max_bytes must be >= 0, got -1"),
    ],
)
def test_set_result_cache_rejects_a_bad_limit(value, error, pattern):
    with pytest.raises(error, match=pattern):
        ppo_fast.set_result_cache(value)
    assert _result_arrays._pool.limit == _result_arrays.DEFAULT_CACHE_BYTES


def test_the_environment_variable_sets_the_limit_unless_set_result_cache_does(monkeypatch):
    """PPO_FAST_RESULT_CACHE (bytes) is the limit until set_result_cache gives one, and again
    after set_result_cache(None); it is read at each large result, so a change is seen by the
    next call."""
    data = _batch()

    def pooled_gae() -> bool:
        return _pooled(CALLS["gae"](data).advantages)

    ppo_fast.set_result_cache(None)
    monkeypatch.setenv("PPO_FAST_RESULT_CACHE", "0")
    assert not pooled_gae()
    assert _result_arrays._pool.limit == 0
    monkeypatch.setenv("PPO_FAST_RESULT_CACHE", f" {4 << 20} ")
    assert pooled_gae()
    assert _result_arrays._pool.limit == 4 << 20
    ppo_fast.set_result_cache(0)  # the function's limit wins over the variable
    assert not pooled_gae()
    ppo_fast.set_result_cache(None)
    assert pooled_gae()
    assert _result_arrays._pool.limit == 4 << 20
    monkeypatch.delenv("PPO_FAST_RESULT_CACHE")
    assert pooled_gae()
    assert _result_arrays._pool.limit == _result_arrays.DEFAULT_CACHE_BYTES
    ppo_fast.set_result_cache(0)  # and back to the default with the variable unset
    assert not pooled_gae()
    ppo_fast.set_result_cache(None)
    assert pooled_gae()
    assert _result_arrays._pool.limit == _result_arrays.DEFAULT_CACHE_BYTES


def test_the_default_limit_is_the_documented_512_mib(monkeypatch):
    monkeypatch.delenv("PPO_FAST_RESULT_CACHE", raising=False)
    ppo_fast.set_result_cache(None)
    assert _pooled(CALLS["gae"](_batch()).advantages)
    assert _result_arrays._pool.limit == 512 * 2**20
    assert "(default 512 MiB; 0: none)" in ppo_fast.set_result_cache.__doc__


@pytest.mark.parametrize("raw", ["abc", "-1", "1.5", "1e6", "512MiB"])
def test_a_bad_environment_variable_raises_at_each_large_result(monkeypatch, raw):
    data = _batch()
    ppo_fast.set_result_cache(None)
    monkeypatch.setenv("PPO_FAST_RESULT_CACHE", raw)
    for _ in range(2):
        with pytest.raises(ValueError, match="PPO_FAST_RESULT_CACHE must be a byte count, an int"):
            CALLS["gae"](data)
    small = np.zeros((8, 128), np.float32)
    ppo_fast.gae(small, small)  # a result under 1 MiB does not read it
    ppo_fast.set_result_cache(1 << 20)
    assert _pooled(CALLS["gae"](data).advantages)
