"""The engine owner's private folder, for everything another user must not reach.

A predictable path in a shared ``/tmp`` is a gift to the other users of a
machine: torch's compile cache defaults to ``/tmp/torchinductor_<user>``, and
whoever creates that folder first (mode 0777, files planted in it) decides
what the engines load.  dpnb's side-door sockets need a folder nobody else
can enter, too.  So both live under one folder per user, mode 0700, checked
to be this user's own before use; if someone else made it first, a fresh
random one is used instead (and that is logged).
"""

from __future__ import annotations

import getpass
import logging
import os
import stat
import tempfile

log = logging.getLogger(__name__)

#: caches the engines' libraries write and later load from
CACHE_VARS = {"TORCHINDUCTOR_CACHE_DIR": "torchinductor", "TRITON_CACHE_DIR": "triton"}


def _is_private(path: str) -> bool:
    st = os.lstat(path)
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def private_dir() -> str:
    """``$XDG_RUNTIME_DIR/dpnb`` or ``<tmp>/dpnb-<uid>``, created 0700 and
    checked; a fresh ``mkdtemp`` folder when that one is not ours."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if runtime and os.path.isdir(runtime) and _is_private(runtime):
        path = os.path.join(runtime, "dpnb")
    else:
        path = os.path.join(tempfile.gettempdir(), f"dpnb-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    if _is_private(path):
        return path
    fresh = tempfile.mkdtemp(prefix=f"dpnb-{os.getuid()}-")
    log.warning("%s is not this user's private folder (another user may have made it); "
                "using %s", path, fresh)
    return fresh


def _torch_default(var: str) -> str | None:
    """The predictable default a kernel's torch may have exported for ``var``."""
    if var == "TORCHINDUCTOR_CACHE_DIR":
        try:
            user = getpass.getuser()
        except (KeyError, OSError):
            return None
        return os.path.join(tempfile.gettempdir(), "torchinductor_" + user.replace("\\", "_"))
    return None


def private_caches(base: str | None = None) -> dict[str, str]:
    """Point the compile caches into the private folder ``base`` (found here if
    not given), unless the user chose them (a value equal to torch's own
    ``/tmp`` default is not a choice: the kernel's torch sets it on first use,
    and the engines inherit it).  Returns what was set."""
    out = {}
    for var, sub in CACHE_VARS.items():
        cur = os.environ.get(var)
        if cur and cur != _torch_default(var):
            continue
        base = base or private_dir()
        path = os.path.join(base, sub)
        os.makedirs(path, mode=0o700, exist_ok=True)
        os.environ[var] = path
        out[var] = path
    return out
