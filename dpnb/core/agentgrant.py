"""What the notebook holding a cluster lets an agent do on it (pure).

An agent (``dpnb mcp``) may always read a cluster of its user: status,
where, the last error.  Changing it (interrupt, restart, reform, save) or
running code on its ranks needs two yeses: the server's command line
(``--allow-actions`` / ``--allow-code``, :mod:`dpnb.agent.policy`) and the
notebook's own (``%dp agent --allow-actions --allow-code``,
``c.allow_agent(actions=True, code=True)``), because the human at the
notebook owns the cluster and its state.  This record is the notebook's.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AgentGrant:
    """The notebook's yes to an agent's actions and code (both no by default)."""

    actions: bool = False
    code: bool = False

    def refusal(self, tool: str, needs: str) -> str | None:
        """``None`` when the notebook allows ``needs`` ("actions" or "code"); else the
        line the agent reads, naming what the human would run to allow it."""
        if (needs == "actions" and self.actions) or (needs == "code" and self.code):
            return None
        flag = "--allow-actions" if needs == "actions" else "--allow-code"
        kw = "actions=True" if needs == "actions" else "code=True"
        return (f"refused by the notebook: {tool} needs the notebook's permission, and the "
                f"notebook holding this cluster has not given it; nothing was done (its user "
                f"runs %dp agent {flag}, or c.allow_agent({kw}), to allow it)")

    def describe(self) -> str:
        allowed = [w for w, ok in (("actions", self.actions), ("code", self.code)) if ok]
        return ("reads, " + " and ".join(allowed)) if allowed else "reads only"
