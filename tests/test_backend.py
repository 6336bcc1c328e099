"""Backend selection, lazy loading, the thread policy and bit-for-bit determinism."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import COMPILED

import ppo_fast
from ppo_fast import _backend, _threads
from ppo_fast._spec import GAE_CHUNKS, KERNELS


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )


def test_import_is_lazy():
    """import ppo_fast loads no compiled backend and no torch: those cost seconds."""
    out = run_python("""
        import sys, ppo_fast
        print(sorted(m for m in ("numba", "torch", "ppo_fast._numba_kernels") if m in sys.modules))
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_environment_variable_selects_the_backend():
    out = run_python("import ppo_fast; print(ppo_fast.get_backend())", PPO_FAST_BACKEND="python")
    assert out.stdout.strip() == "python", out.stderr
    out = run_python(
        "import ppo_fast, numpy as n; ppo_fast.gae(n.zeros((1, 1)), n.zeros((1, 1)))",
        PPO_FAST_BACKEND="fortran",
    )
    assert "PPO_FAST_BACKEND must be one of" in out.stderr


def test_forced_backend_that_cannot_load_raises_and_auto_moves_on():
    out = run_python("""
        import sys
        sys.modules["numba"] = None  # numba missing, or failing to import
        import numpy as np, ppo_fast
        try:
            ppo_fast.gae(np.zeros((1, 2)), np.zeros((1, 2)), backend="numba")
        except ppo_fast.BackendUnavailableError as error:
            print("raised:", error)
        print("auto:", ppo_fast.get_backend())
        print("available:", ppo_fast.available_backends())
    """)
    assert out.returncode == 0, out.stderr
    assert "raised: the numba backend cannot be used: ModuleNotFoundError" in out.stdout
    assert "auto: numba" not in out.stdout and "numba" not in out.stdout.split("available:")[1]


def test_auto_takes_the_cython_build_first_and_numba_without_it():
    """Cython has nothing to compile at first use (short-lived processes and workers pay no JIT);
    without its build, auto takes numba."""
    out = run_python("""
        import ppo_fast
        print(ppo_fast.get_backend(), ppo_fast.available_backends())
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "cython", out.stdout
    out = run_python("""
        import sys
        sys.modules["ppo_fast._cython_kernels"] = None  # not built
        import ppo_fast
        print(ppo_fast.get_backend(), ppo_fast.available_backends())
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "numba", out.stdout
    assert "cython" not in out.stdout


def test_precedence_call_over_set_backend_over_auto():
    try:
        ppo_fast.set_backend("python")
        assert ppo_fast.get_backend() == "python"
        assert ppo_fast.get_backend(COMPILED[0]) == COMPILED[0]
        ppo_fast.set_backend(None)
        assert ppo_fast.get_backend() == COMPILED[0]
        with pytest.raises(ValueError, match="backend must be one of"):
            ppo_fast.set_backend("gpu")
    finally:
        ppo_fast.set_backend(None)


def test_num_threads_setting_and_environment():
    try:
        ppo_fast.set_num_threads(3)
        assert ppo_fast.get_num_threads() == 3
        for bad in (0, -1, 1.5, True, "2"):
            with pytest.raises(ValueError, match="num_threads must be a positive integer"):
                ppo_fast.set_num_threads(bad)
    finally:
        ppo_fast.set_num_threads(None)
    out = run_python(
        "import ppo_fast; print(ppo_fast.get_num_threads())",
        PPO_FAST_NUM_THREADS="5",
        OMP_NUM_THREADS="7",
    )
    assert out.stdout.strip() == "5", out.stderr
    out = run_python(
        "import ppo_fast; print(ppo_fast.get_num_threads())",
        PPO_FAST_NUM_THREADS="",
        OMP_NUM_THREADS="7",
    )
    assert out.stdout.strip() == "7", out.stderr
    out = run_python("import ppo_fast; ppo_fast.get_num_threads()", PPO_FAST_NUM_THREADS="x")
    assert "PPO_FAST_NUM_THREADS must be a positive integer" in out.stderr


def test_omp_num_threads_nested_takes_the_first_level(monkeypatch):
    monkeypatch.delenv("PPO_FAST_NUM_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "4,2")
    assert ppo_fast.get_num_threads() == 4
    monkeypatch.setenv("OMP_NUM_THREADS", " 3 , 1 ")
    assert ppo_fast.get_num_threads() == 3
    result = ppo_fast.gae(np.zeros((2, 3)), np.zeros((2, 3)))
    assert result.advantages.shape == (2, 3)


@pytest.mark.parametrize("garbage", ["auto", "0", "-2", "4,x", "4,,2", "1.5", "+4"])
def test_omp_num_threads_garbage_is_ignored_with_one_warning(monkeypatch, garbage):
    monkeypatch.delenv("PPO_FAST_NUM_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", garbage)
    _threads._warn_ignored_omp.cache_clear()
    with pytest.warns(RuntimeWarning, match="OMP_NUM_THREADS=.* ppo_fast ignores it") as caught:
        assert ppo_fast.get_num_threads() == _threads._cpu_count()
    assert caught[0].filename == __file__  # the warning points at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per value: the second call is silent
        assert ppo_fast.get_num_threads() == _threads._cpu_count()
        ppo_fast.gae(np.zeros((2, 3)), np.zeros((2, 3)))


@pytest.mark.parametrize("garbage", ["x", "0", "4,2", "+4"])
def test_ppo_fast_num_threads_garbage_is_an_error_naming_it(monkeypatch, garbage):
    monkeypatch.setenv("PPO_FAST_NUM_THREADS", garbage)
    with pytest.raises(ValueError, match="PPO_FAST_NUM_THREADS must be a positive integer"):
        ppo_fast.get_num_threads()


def test_small_batches_stay_on_one_thread():
    try:
        ppo_fast.set_num_threads(8)
        assert _threads.threads_for(1000, 1000 * 16) == 1
        assert _threads.threads_for(1, 10**8) == 1
        assert _threads.threads_for(64, 64 * 32768) == 8
        # GAE's units are its rows and its long rows' chunks: one row of 2^18 positions is 17
        # units, and takes the 4 threads its size allows.
        gae_units = KERNELS["gae"].parallel_units(1, 1 << 18)
        assert gae_units == 1 + (1 << 18) // GAE_CHUNKS.size
        assert _threads.threads_for(gae_units, 1 << 18) == 4
        assert KERNELS["whiten"].parallel_units(1, 1 << 18) == 1
    finally:
        ppo_fast.set_num_threads(None)


def big_batch():
    rng = np.random.default_rng(11)
    shape = (16, 1 << 14)  # 4 x MIN_POSITIONS_PER_THREAD: parallel on 2+ threads
    mask = rng.random(shape) < 0.9
    return (
        rng.normal(size=shape).astype(np.float32),
        rng.normal(size=shape).astype(np.float32),
        mask,
    )


def everything(backend, rewards, values, mask):
    shaped = ppo_fast.shape_rewards(
        np.ones(rewards.shape[0]),
        rewards,
        values,
        kl_coef=0.1,
        estimator="k3",
        mask=mask,
        backend=backend,
    )
    result = ppo_fast.gae(shaped, values, gamma=0.99, mask=mask, backend=backend)
    return [
        shaped,
        result.advantages,
        result.returns,
        ppo_fast.whiten(result.advantages, mask=mask, backend=backend),
        ppo_fast.kl_penalty(rewards, values, "k3", backend=backend),
    ]


def test_leaving_one_core_caps_this_thread_only():
    import threading

    big = 64 * 32768
    try:
        ppo_fast.set_num_threads(4)
        seen = {}
        with _threads.leaving_one_core():
            seen["inside"] = _threads.threads_for(64, big)
            other = threading.Thread(
                target=lambda: seen.update(other=_threads.threads_for(64, big))
            )
            other.start()
            other.join()
            with _threads.leaving_one_core():  # nested: one fewer again, restored after
                seen["nested"] = _threads.threads_for(64, big)
            seen["after nested"] = _threads.threads_for(64, big)
        seen["outside"] = _threads.threads_for(64, big)
        assert seen == {"inside": 3, "other": 4, "nested": 2, "after nested": 3, "outside": 4}
        ppo_fast.set_num_threads(1)
        with _threads.leaving_one_core():
            assert _threads.threads_for(64, big) == 1  # never fewer than one
    finally:
        ppo_fast.set_num_threads(None)


@pytest.mark.numba_dtype("float32")  # its arrays' dtype
def test_results_do_not_depend_on_threads_bit_for_bit(compiled_backend):
    rewards, values, mask = big_batch()
    outputs = {}
    try:
        for n in (1, 2, 4):
            ppo_fast.set_num_threads(n)
            outputs[n] = everything(compiled_backend, rewards, values, mask)
    finally:
        ppo_fast.set_num_threads(None)
    for n in (2, 4):
        for a, b in zip(outputs[1], outputs[n], strict=True):
            np.testing.assert_array_equal(a, b)
    again = everything(compiled_backend, rewards, values, mask)
    for a, b in zip(outputs[1], again, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.numba_dtype("float32")  # its arrays' dtype
def test_calls_from_several_python_threads_at_once(compiled_backend):
    rewards, values, mask = big_batch()
    expected = everything(compiled_backend, rewards, values, mask)
    with ThreadPoolExecutor(4) as pool:
        results = list(
            pool.map(lambda _: everything(compiled_backend, rewards, values, mask), range(8))
        )
    for result in results:
        for a, b in zip(result, expected, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.numba_dtype("float32")  # its arrays' dtype
@pytest.mark.skipif("numba" not in COMPILED, reason="numba is not installed here")
def test_numbas_parallel_builds_start_their_threads_only_at_their_prange_loops():
    """Under parallel=True numba makes a parallel loop of an array expression too (np.zeros, a
    whole-array assignment), each a start of the threads: 20-40 us where they sleep between
    calls (OMP_WAIT_POLICY=PASSIVE). The builds compiled from a source of their own (KL-Cov's
    selection, GAE's long rows) have a parallel loop for each prange of it, and no other."""
    import inspect

    from ppo_fast import _numba_covariance, _numba_gae, _numba_kernels

    rewards, values, mask = big_batch()
    long_row = np.ones((1, 1 << 18), np.float32)  # chunks: four threads' worth
    try:
        ppo_fast.set_num_threads(2)
        ppo_fast.kl_cov_selection(rewards, values, mask=mask, backend="numba")
        ppo_fast.gae(long_row, long_row, gamma=0.99, backend="numba")
    finally:
        ppo_fast.set_num_threads(None)
    builds = [
        (_numba_kernels.kl_cov_top_k.parallel, _numba_covariance._kl_cov_top_k_shared),
        (_numba_kernels.gae.chunked.parallel, _numba_gae._gae_chunked),
    ]
    for build, source in builds:
        assert build.overloads, source.__name__  # compiled by the calls above
        loops = inspect.getsource(source).count("prange(")
        for overload in build.overloads.values():
            parfors = overload.metadata["parfor_diagnostics"].initial_parfors
            assert len(parfors) == loops, (source.__name__, len(parfors), loops)


@pytest.mark.slow  # installs, or runs fresh processes: the fast lane (-m "not slow") skips it
def test_warmup_compiles_ahead_of_time():
    """After warmup, the public calls of the usual layouts compile nothing (numba's compile
    events): no mask, a bool mask, a 0/1 mask of int64, int32 or float numbers, lengths, packed
    rows, and a row long enough for GAE's chunks. In a fresh process, on one thread (the
    parallel builds cost as much again; test_warmup_runs_the_large_batches_when_threads_are_used
    covers that branch), for one dtype, and for the kernels these calls run: warmup's loop over
    the table is the same for every kernel, and compiling all of them took 50 s of the suite."""
    out = run_python("""
        import numpy as np
        import ppo_fast
        from numba.core import event
        from ppo_fast import _groups, _loops, _warmup, _numba_kernels as k
        from ppo_fast._spec import KERNELS
        used = ("gae", "moments", "whiten", "clipped_surrogate")
        _warmup.KERNELS = {name: KERNELS[name] for name in used}
        before = len(k.gae.whole_rows.serial.signatures)
        ppo_fast.set_num_threads(1)
        with event.install_recorder("numba:compile") as warming:
            ppo_fast.warmup("numba", dtypes=("float32",))
        hash_table = _groups._hash_factorizer()
        print(before, len(k.gae.whole_rows.serial.signatures),
              len(k.gae.chunked.serial.signatures), len(k.whiten.serial.signatures),
              len(hash_table.signatures), len(warming.buffer) > 0)
        loops = ("add_by_group", "centre_by_group", "take_by_group", "broadcast_by_mask",
                 "broadcast_by_lengths")
        print(*(bool(_loops.compiled(name).signatures) for name in loops))
        rng = np.random.default_rng(0)
        x, y, z = rng.normal(size=(3, 8, 128)).astype(np.float32)
        valid = rng.random((8, 128)) < 0.9
        layouts = [{"mask": None}, {"mask": valid}, {"lengths": np.full(8, 100)}]
        layouts += [{"mask": valid.astype(t)} for t in ("int64", "int32", "float32")]
        compiled = []
        for layout in layouts:
            with event.install_recorder("numba:compile") as calls:
                ppo_fast.gae(x, y, backend="numba", **layout)
                ppo_fast.whiten(x, backend="numba", **layout)
                ppo_fast.clipped_surrogate(x, y, z, backend="numba", **layout)
            compiled += [e.data["dispatcher"].py_func.__qualname__ for _, e in calls.buffer]
        with event.install_recorder("numba:compile") as calls:  # packed rows
            cu = np.array([0, 100, 100, 1024])
            ppo_fast.gae(x.ravel(), y.ravel(), backend="numba", cu_seqlens=cu)
            ppo_fast.whiten(x.ravel(), backend="numba", cu_seqlens=cu.astype(np.int32))
            ppo_fast.clipped_surrogate(x.ravel(), y.ravel(), z.ravel(), backend="numba",
                                       cu_seqlens=cu)
        compiled += [e.data["dispatcher"].py_func.__qualname__ for _, e in calls.buffer]
        with event.install_recorder("numba:compile") as calls:
            long_row = np.zeros((1, KERNELS["gae"].chunks.long_row + 1), np.float32)
            ppo_fast.gae(long_row, long_row, backend="numba")
        compiled += [e.data["dispatcher"].py_func.__qualname__ for _, e in calls.buffer]
        print("compiled after warmup:", sorted(set(compiled)))
    """)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["0", "1", "1", "1", "1", "True"]
    assert lines[1].split() == ["True"] * 5
    assert lines[2] == "compiled after warmup: []"


def _recording_entries(monkeypatch, calls: dict[tuple, set]) -> None:
    """The backend's entries (``_backend.run``, ``table_kernel``, ``common`` and
    ``packed_common``) replaced by stubs that record the numba types of the arguments each
    kernel's entry is called with, by (entry, kernel, variant: packed rows or not for a common
    entry, the estimator's code for a one-thread build), and run nothing."""
    import numba

    def record(entry, name, variant=None):
        kernel = KERNELS[name]

        def call(*arguments):
            types = tuple(numba.typeof(a) for a in arguments)
            calls.setdefault((entry, name, variant), set()).add(types)
            if entry != "common":  # outputs of 1 (a count of 1): every stage goes on
                outputs = {a.name for a in (*kernel.outputs, *kernel.row_outputs)}
                for argument_name, argument in zip(kernel.arguments, arguments, strict=True):
                    if argument_name in outputs:
                        argument[...] = 1
                return None
            if kernel.aggregates:  # one valid token, totals of 1: every stage goes on
                return (1.0, *[1.0] * len(kernel.row_outputs))
            return tuple([1.0] * len(kernel.row_outputs)) if kernel.row_outputs else None

        return call

    def run(name, backend, **arguments):
        record("table", name)(*KERNELS[name].bind({**arguments, "n_threads": 1}))

    def table_kernel(name, backend, n_threads=0, dtype=None, masked=False, code=None):
        if n_threads != 1 or dtype is None:  # the table kernel, as run calls it
            return record("table", name)
        return record("one-thread", name, code)  # numba's one-thread build (of the estimator)

    def common(name, backend, n_threads=0, dtype=None, masked=False, packed=False):
        return record("common", name, bool(packed))

    monkeypatch.setattr(_backend, "run", run)
    monkeypatch.setattr(_backend, "table_kernel", table_kernel)
    monkeypatch.setattr(_backend, "common", common)
    monkeypatch.setattr(
        _backend, "packed_common", lambda name, *_: (common(name, 0, packed=True), 1)
    )


@pytest.mark.skipif("numba" not in COMPILED, reason="numba is not installed here")
def test_warmup_calls_each_kernel_with_the_types_the_public_calls_do(monkeypatch):
    """numba compiles an overload for each set of argument types, so warmup must call each
    kernel's entries with what the public calls pass them, or a first call after warmup
    compiles again (until 0.8.33: DPPO's divergence code in the token dtype, 0.7-2.1 s;
    KL-Cov's selection as bytes, 1.1 s; the one-thread builds of kl_penalty's and
    shape_rewards' estimators, 0.1-0.5 s). Every stage with a fast path in its common cases
    (tests/test_fast_path.py's), without a mask, with a bool one and packed, and the general
    way (Fortran-ordered arrays, weights, the returns), both dtypes, on one thread: each
    entry's argument types are among those warmup gives it. The entries are stubs that record
    (``_recording_entries``): nothing compiles or runs."""
    from test_fast_path import FAMILY, masks, outcome, the_stages, token_arrays

    from ppo_fast import _warmup

    warmed: dict[tuple, set] = {}
    _recording_entries(monkeypatch, warmed)
    monkeypatch.setattr(_warmup, "_warm_group_estimators", lambda dtypes: None)
    monkeypatch.setattr(_warmup, "_warm_mask_conversion", lambda dtypes, sizes: None)
    monkeypatch.setattr(_threads, "get_num_threads", lambda: 1)
    ppo_fast.warmup("numba", ("float32", "float64"))

    public: dict[tuple, set] = {}
    _recording_entries(monkeypatch, public)
    monkeypatch.setattr(_threads, "threads_for", lambda *_: 1)
    rng = np.random.default_rng(5)
    shape = (4, 16)
    for dtype in ("float32", "float64"):
        arrays = token_arrays(rng, shape, np.dtype(dtype))
        for mask in masks(rng, shape)[:2]:  # none and a bool one
            for call, kwargs in the_stages(arrays):
                outcome(call, **kwargs, mask=mask, backend="numba")
        flat = {k: v.ravel() if v.shape == shape else v for k, v in arrays.items()}
        cu_seqlens = np.array([0, 10, 10, 64])
        for call, kwargs in the_stages(flat):
            outcome(call, **kwargs, cu_seqlens=cu_seqlens, backend="numba")
        # the general way: Fortran-ordered arrays, weights, and the stages without a fast path
        fortran = {k: np.asfortranarray(v) if v.shape == shape else v for k, v in arrays.items()}
        for call, kwargs in the_stages(fortran):
            outcome(call, **kwargs, mask=np.asfortranarray(mask), backend="numba")
        lp, old, adv, r = (arrays[k] for k in ("lp", "old", "a", "r"))
        weights, uids = np.abs(arrays["v"]), np.array([0, 0, 1, 1])
        policy = dict(logprobs=lp, old_logprobs=old, advantages=adv, weights=weights)
        for loss, _ in FAMILY:
            loss(**policy, mask=mask, backend="numba")
        ppo_fast.dppo_loss(**policy, divergence="kl", backend="numba")
        ppo_fast.kl_cov_loss(**policy, selected=arrays["selected"], backend="numba")
        ppo_fast.clipped_surrogate(**policy, backend="numba")
        ppo_fast.discounted_returns(r, mask=mask, gamma=0.9, backend="numba")
        ppo_fast.reinforce_plus_plus(r, mask=mask, backend="numba")
        ppo_fast.remax(r, arrays["scores"], mask=mask, backend="numba")
        ppo_fast.optimal_token_baseline(r, old, weights, uids, mask=mask, backend="numba")
        ppo_fast.masked_moments(adv, mask=mask, backend="numba")
        ppo_fast.kl_cov_selection(lp, adv, ratio=0.1, mask=mask, backend="numba")
    assert {name for _, name, _ in public} >= {k.name for k in KERNELS.values() if k.common}
    for key, types in public.items():
        assert types <= warmed.get(key, set()), (key, types - warmed.get(key, set()))


@pytest.mark.skipif("cython" not in COMPILED, reason="the Cython backend is not built here")
@pytest.mark.parametrize("n_threads", [1, 2])
def test_warmup_runs_the_large_batches_when_threads_are_used(monkeypatch, n_threads):
    """The batches warmup runs each kernel on: a small one, and with more than one thread one
    large enough to take the parallel build (each thread a share of positions). Cython: what
    is checked is warmup's choice of batches, without numba's minutes of compilation."""
    calls: dict[str, list[int]] = {}
    real_run = _backend.run

    def spy(name, backend, **arguments):
        n_positions = arguments[KERNELS[name].inputs[0].name].size
        calls.setdefault(name, []).append(n_positions)
        real_run(name, backend, **arguments)

    monkeypatch.setattr(_backend, "run", spy)
    try:
        ppo_fast.set_num_threads(n_threads)
        ppo_fast.warmup("cython", dtypes=("float32",))
    finally:
        ppo_fast.set_num_threads(None)
    assert set(calls) == set(KERNELS)
    for name, sizes in calls.items():
        large = [n for n in sizes if n >= 2 * _threads.MIN_POSITIONS_PER_THREAD]
        assert bool(large) == (n_threads > 1), (name, sizes)


def test_settings_read_per_call_follow_the_environment(monkeypatch):
    """The backend and the threads are worked out once per setting, not once per process: a
    variable changed after a call is seen by the next call, and a bad value keeps raising."""
    monkeypatch.delenv("PPO_FAST_BACKEND", raising=False)
    monkeypatch.delenv("PPO_FAST_NUM_THREADS", raising=False)
    rewards = np.zeros((2, 3))
    ppo_fast.gae(rewards, rewards)
    monkeypatch.setenv("PPO_FAST_BACKEND", "fortran")
    for _ in range(2):
        with pytest.raises(ValueError, match="PPO_FAST_BACKEND must be one of"):
            ppo_fast.gae(rewards, rewards)
    monkeypatch.delenv("PPO_FAST_BACKEND")
    monkeypatch.setenv("PPO_FAST_NUM_THREADS", "x")
    for _ in range(2):
        with pytest.raises(ValueError, match="PPO_FAST_NUM_THREADS must be a positive integer"):
            ppo_fast.gae(rewards, rewards)
    monkeypatch.setenv("PPO_FAST_NUM_THREADS", "1")
    assert ppo_fast.gae(rewards, rewards).advantages.shape == (2, 3)
    try:
        ppo_fast.set_backend("python")
        assert _backend._cached_resolve(None) is _backend._load("python")
    finally:
        ppo_fast.set_backend(None)
    assert _backend._cached_resolve(None) is _backend.resolve(None)


def test_the_resolved_backends_are_kept_per_setting_and_bounded(monkeypatch):
    """``_cached_resolve`` resolves a setting once, keeps each setting's module beside the
    others' (a program that alternates two settings resolves each once), and holds at most 65
    of them (a program whose variable never repeats)."""
    resolved: list[object] = []
    resolve = _backend.resolve

    def counted(name=None):
        resolved.append(name)
        return resolve(name)

    monkeypatch.setattr(_backend, "resolve", counted)
    monkeypatch.setattr(_backend, "_resolved", {})
    monkeypatch.delenv("PPO_FAST_BACKEND", raising=False)
    for _ in range(3):
        for name in ("python", None):
            assert _backend._cached_resolve(name) is resolve(name)
    assert resolved == ["python", None]
    for k in range(100):
        monkeypatch.setenv("PPO_FAST_BACKEND", "python" + " " * k)  # one module, new values
        assert _backend._cached_resolve(None) is _backend._load("python")
        assert len(_backend._resolved) <= 65
    assert len(resolved) == 102
