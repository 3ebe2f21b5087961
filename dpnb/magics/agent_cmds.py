"""%dp agent: what an agent (``dpnb mcp``) may do on this notebook's cluster, and what it did.

Each handler carries its parser and help (see :mod:`.options`).
"""

from __future__ import annotations

import time

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments

from .options import subcommand


class AgentCommands:
    """Mixed into :class:`dpnb.magics.DPMagics` (``self._need()``)."""

    @subcommand("agent")
    @magic_arguments()
    @argument("--allow-actions", action="store_true",
              help="let an agent started with --allow-actions interrupt, restart, reform "
                   "and save this cluster")
    @argument("--allow-code", action="store_true",
              help="let an agent started with --allow-code run code on the ranks (never "
                   "while a cell of yours runs)")
    @argument("--deny", action="store_true", help="take both back: the agent only reads")
    def agent(self, a):
        """What dpnb mcp may do on this cluster (reads always), the agents seen, their actions."""
        c = self._need()
        if a.deny and (a.allow_actions or a.allow_code):
            raise UsageError("%dp agent: --deny takes both permissions back; give it alone")
        if a.deny or a.allow_actions or a.allow_code:
            c.allow_agent(actions=a.allow_actions, code=a.allow_code)
        door = c.agent_door
        print(f"dpnb: an agent (dpnb mcp) may do {c.agent_grant.describe()} on cluster "
              f"{c.cluster_id}" + ("" if door else " (no door open: it cannot reach it)"))
        if door is None:
            return
        s = door.summary()
        for ag in s["agents"]:
            ago = time.time() - ag["last_call"]
            print(f"dpnb: agent pid {ag['pid']}: last call {ago:.0f} s ago")
        if not s["agents"]:
            print("dpnb: no agent has called yet (dpnb mcp serves this cluster to one)")
        for line in s["actions"]:
            print(line)
        door.service.unshown_lines()  # printed here: not again after the cell
