"""An agent's view of a live cluster: ``dpnb mcp``, a Model Context Protocol server.

:mod:`.server` attaches to a kept cluster and serves :mod:`.tools` over MCP
(the ``mcp`` SDK, installed with ``pip install "dpnb[agent]"``);
:mod:`.policy` decides what an agent may do, caps what it reads and writes
the audit log.  Importing this package loads neither ``mcp`` nor the cluster.
"""
