"""``python -m ppo_fast``: the ``ppo-fast`` command without its console script on PATH (a pyenv
shim, for one, appears only after a rehash that ``python -m pip`` does not run)."""

from ppo_fast.cli import main

raise SystemExit(main())
