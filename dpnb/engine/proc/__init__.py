"""The engine process and its ways in: boot, zygote, host agent, side door.

Owns the process itself (its entry point, SIGTERM, the parent watch, the
garbage collector), the per-host agent and zygote that fork engines, what a
torchrun worker sees (environment, seeds), module preloading, each rank's
status line, and every listener's authentication (``wire``: token handshake,
bounded frames) with the owner's private folder.  May import ``state``,
``device`` and the leaves only.
"""
