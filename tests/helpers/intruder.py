"""Another user of the machine (or another host on the network), trying dpnb's sockets.

Run as ``python intruder.py [--as USER] '<json plan>'`` -- started by root,
it drops to the second unix user ``USER`` for good before any attempt -- or
in a third network namespace; prints one JSON object with
what each attempt got.  Everything here is what a stranger can do without
the cluster's secret: connect, read, write, stall.

Plan keys (each optional):

``store``: ``[addr, port]`` -- torch's own ``TCPStore`` client: list the keys,
    read the gloo address keys, rewrite one.
``raw``: ``[[addr, port], ...]`` -- connect, read what the server says first,
    send garbage, and report whether (and when) the server hung up.
``unix``: ``[path, ...]`` -- try to connect to UNIX sockets.
``hold``: ``{"targets": [[addr, port], ...], "seconds": s, "per_target": k}`` --
    per target, ``k`` silent connections, ``k`` dribbling a byte every 1.5 s,
    and one sending an endless line; held for ``s`` seconds (or until the
    server drops them).  Reports how long each kind lived.
``plant``: ``path`` -- create the folder world-writable with a file in it,
    before the victim's engines start.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time


def try_store(addr: str, port: int) -> dict:
    from datetime import timedelta

    import torch.distributed as dist

    out: dict = {}
    t0 = time.monotonic()
    try:
        s = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=3),
                          wait_for_workers=False)
    except Exception as e:  # noqa: BLE001 - reported, that is the point
        out["connect"] = f"{type(e).__name__}: {str(e)[:200]}"
        out["seconds"] = time.monotonic() - t0
        return out
    for name, fn in (("list_keys", lambda: s.list_keys()),
                     ("get", lambda: s.get("dpnb/collcheck/0")),
                     ("set", lambda: s.set("0", "10.0.0.66:1"))):
        try:
            out[name] = repr(fn())[:200]
        except Exception as e:  # noqa: BLE001
            out[name + "_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    out["seconds"] = time.monotonic() - t0
    return out


def try_raw(addr: str, port: int) -> dict:
    t0 = time.monotonic()
    try:
        s = socket.create_connection((addr, port), timeout=10)
    except OSError as e:
        return {"connect": str(e)}
    s.settimeout(10)
    out: dict = {}
    try:
        first = s.recv(64)
        out["greeting_bytes"] = len(first)
        s.sendall(os.urandom(64) + b"\n" + json.dumps({"token": "guess", "cmd": "where"}).encode()
                  + b"\n")
        rest = b""
        while True:
            chunk = s.recv(4096)
            if not chunk:
                break
            rest += chunk
        out["answer"] = rest[:200].decode(errors="replace")
        out["closed_after"] = time.monotonic() - t0
    except OSError as e:
        out["error"] = f"{type(e).__name__}: {e}"
        out["closed_after"] = time.monotonic() - t0
    finally:
        s.close()
    return out


def try_unix(path: str) -> dict:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return {"connected": True}
    except OSError as e:
        return {"connected": False, "error": type(e).__name__}
    finally:
        s.close()


def _hold_one(addr: str, port: int, kind: str, until: float, lived: list) -> None:
    t0 = time.monotonic()
    try:
        s = socket.create_connection((addr, port), timeout=5)
    except OSError:
        lived.append((kind, -1.0))
        return
    try:
        if kind == "huge":
            s.settimeout(5)
            block = b"x" * (1 << 20)
            while time.monotonic() < until:
                s.sendall(block)
        elif kind == "dribble":
            s.settimeout(1.5)
            while time.monotonic() < until:
                s.sendall(b"{")
                try:
                    if s.recv(4096) == b"" and time.monotonic() - t0 > 0.1:
                        break
                except socket.timeout:
                    pass
        else:  # silent: wait for the server to hang up
            s.settimeout(max(until - time.monotonic(), 0.1))
            while time.monotonic() < until:
                if s.recv(4096) == b"":
                    break
    except OSError:
        pass
    finally:
        lived.append((kind, time.monotonic() - t0))
        s.close()


def hold(targets: list, seconds: float, per_target: int) -> dict:
    until = time.monotonic() + seconds
    lived: list = []
    threads = []
    for addr, port in targets:
        for kind in ["silent"] * per_target + ["dribble"] * per_target + ["huge"]:
            t = threading.Thread(target=_hold_one, args=(addr, port, kind, until, lived),
                                 daemon=True)
            t.start()
            threads.append(t)
    for t in threads:
        t.join(seconds + 15)
    out: dict = {}
    for kind, s in lived:
        out.setdefault(kind, []).append(round(s, 2))
    return out


def plant(path: str) -> dict:
    os.makedirs(path, exist_ok=True)
    os.chmod(path, 0o777)
    with open(os.path.join(path, "planted"), "w") as f:
        f.write("not yours")
    return {"planted": path}


def become(user: str, plan: dict) -> None:
    """Drop from root to ``user`` for good, after importing what the plan needs
    (this interpreter's files may sit where ``user`` cannot read)."""
    import pwd

    import encodings.idna  # noqa: F401  (socket's getaddrinfo loads it lazily)

    if "store" in plan:
        import torch.distributed  # noqa: F401
    pw = pwd.getpwnam(user)
    os.setgroups([])
    os.setgid(pw.pw_gid)
    os.setuid(pw.pw_uid)


def main() -> None:
    args = sys.argv[1:]
    plan = json.loads(args[-1])
    if args[0] == "--as":
        become(args[1], plan)
    out: dict = {"uid": os.getuid()}
    if "plant" in plan:
        out["plant"] = plant(plan["plant"])
    if "store" in plan:
        out["store"] = try_store(*plan["store"])
    if "raw" in plan:
        out["raw"] = [try_raw(a, p) for a, p in plan["raw"]]
    if "unix" in plan:
        out["unix"] = [try_unix(p) for p in plan["unix"]]
    if "hold" in plan:
        h = plan["hold"]
        out["hold"] = hold(h["targets"], h["seconds"], h["per_target"])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
