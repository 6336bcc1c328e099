"""pyarrow, or an ImportError that says how to install it (``ppo_fast.data`` is an extra)."""

from __future__ import annotations

try:
    import pyarrow as pa
    import pyarrow.compute as pc
except ImportError as error:  # pragma: no cover - the data extra is installed in the tests
    raise ImportError(
        f"ppo_fast.data needs pyarrow ({error}): pip install 'ppo_fast[data]'"
    ) from error

__all__ = ["pa", "pc"]
