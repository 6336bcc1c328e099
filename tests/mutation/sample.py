"""Keep a deterministic sample of a cosmic-ray session's pending mutants; mark the rest skipped.

    python tests/mutation/sample.py SESSION.sqlite CONFIG.toml

The sample size is ``keep`` under ``[cosmic-ray.filters.sample]`` in the config (absent: keep
all). Mutants are ranked by the SHA-1 of (module, position, operator, occurrence), so the same
source and config give the same sample on every machine, and a change elsewhere in a module
does not reshuffle it.
"""

from __future__ import annotations

import hashlib
import sys

from cosmic_ray.config import load_config
from cosmic_ray.work_db import WorkDB, use_db
from cosmic_ray.work_item import WorkerOutcome, WorkResult


def _key(item) -> str:
    m = item.mutations[0]
    text = f"{m.module_path}:{tuple(m.start_pos)}:{m.operator_name}:{m.occurrence}"
    return hashlib.sha1(text.encode()).hexdigest()


def main(session: str, config_path: str) -> None:
    keep = load_config(config_path).sub("filters", "sample").get("keep")
    with use_db(session, WorkDB.Mode.open) as db:
        pending = sorted(db.pending_work_items, key=_key)
        if keep is None:
            return
        for item in pending[int(keep) :]:
            db.set_result(
                item.job_id,
                WorkResult(output="Not in the sample", worker_outcome=WorkerOutcome.SKIPPED),
            )
        print(f"{session}: {min(len(pending), int(keep))} of {len(pending)} mutants kept")


if __name__ == "__main__":
    main(*sys.argv[1:])
