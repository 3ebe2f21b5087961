"""Fail when a tier this machine can run was skipped.

    python tests/require_tiers.py OUTCOMES TIER [TIER ...]

``OUTCOMES`` is what a pytest run wrote to ``$DPNB_TEST_OUTCOMES``
(``tests/conftest.py``).  Each TIER named must have run: at least one of its
tests passed, and none skipped.  A tier skips when what it needs is missing --
an install that failed, a daemon that did not start, a user that is not root
-- and pytest's ``-ra`` only lists that and exits 0; ``.ci/run`` names the
tiers it has installed for, so a skip there is a failure that says which tier
and why.  The GPU tiers are never required: CI has no GPU.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def tier_of(nodeid: str) -> str:
    parts = nodeid.split("::", 1)[0].split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else ""


def problems(outcomes: list[dict], required: list[str]) -> list[str]:
    passed: dict[str, int] = defaultdict(int)
    skipped: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for rec in outcomes:
        tier = tier_of(rec["nodeid"])
        if rec["outcome"] == "skipped":
            skipped[tier].append((rec["nodeid"], rec.get("reason", "")))
        elif rec["when"] == "call" and rec["outcome"] == "passed":
            passed[tier] += 1
    out = []
    for tier in required:
        for nodeid, why in skipped[tier]:
            out.append(f"tier {tier} must run here, but {nodeid} skipped: {why}")
        if not passed[tier] and not skipped[tier]:
            out.append(f"tier {tier} must run here, but none of its tests ran")
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[2].strip())
        return 2
    with open(argv[0]) as fh:
        outcomes = [json.loads(ln) for ln in fh if ln.strip()]
    bad = problems(outcomes, argv[1:])
    for line in bad:
        print(line)
    if not bad:
        print(f"every required tier ran: {', '.join(argv[1:])}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
