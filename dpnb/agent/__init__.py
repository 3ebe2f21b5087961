"""An agent's view of a live cluster: ``dpnb mcp``, a Model Context Protocol server.

:mod:`.server` serves a live cluster over MCP -- a running notebook's through
the door its kernel opens (:mod:`.door`, answered there by :mod:`.service`
from :mod:`.tools`), or a kept one it attaches itself --
(the ``mcp`` SDK, installed with ``pip install "dpnb[agent]"``);
:mod:`.policy` decides what an agent may do, caps what it reads and writes
the audit log.  Importing this package loads neither ``mcp`` nor the cluster.
"""
