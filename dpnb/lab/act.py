"""``python -m dpnb.lab.act stop|restart|restart-resume ID``: the server's hands on a kept cluster.

The Jupyter server never drives engines itself (ipyparallel clients, zmq
sockets and a cluster's atexit hooks do not belong in a long-lived server);
for a kept cluster that no kernel holds it runs this module: it attaches
(through the controller's connection files and the side doors' token in the
record, as ``%dp attach`` does), then stops the cluster for good, or
replaces its dead ranks and lets go again (the reaper's countdown restarts).
"""

from __future__ import annotations

import sys

from ..cluster import keep as keeping
from ..session import Cluster


def main(argv: list[str]) -> int:
    verb, cluster_id = argv
    c = Cluster.attach(cluster_id)
    if verb == "stop":
        pids = c.stop()
        print(f"stopped cluster {cluster_id} ({len(pids)} processes)")
    elif verb in ("restart", "restart-resume"):
        # --resume: rebuild the replaced ranks from the recorded setup cells and the
        # latest checkpoint or a survivor's replica, as %dp restart --resume does
        print(c.restart(resume=True) if verb == "restart-resume" else c.restart())
        keeping.release(c)  # free again: the reaper's countdown starts over
    else:
        print(f"unknown action {verb!r}: stop, restart or restart-resume", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
