"""``dpnb doctor``: what this environment gives dpnb, one line a fact, to paste into an issue.

Each line is a :class:`Finding`: OK, a WARN with the fix, or a FAIL where
dpnb cannot run at all (no torch, no ipyparallel, too old a Python) -- the
only case that exits non-zero.  It runs in this process only: no engine is
started, CUDA is not initialised (GPUs are counted and sized with NVML, as
``%dp start`` counts them), and nothing is written except dpnb's private
folder, which ``%dp start`` would make the same way.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import resource
import shutil
import sys
from dataclasses import asdict, dataclass
from typing import Callable

OK, WARN, FAIL = "OK", "WARN", "FAIL"
SHM_MIN_BYTES = 1 << 30  # DataLoader workers and NCCL's shared memory want more than Docker's 64 MB
NOFILE_MIN = 4096  # what 64 ranks' rank 0 needs (engine/proc/process.py: 4 per rank + 256), and more


@dataclass(frozen=True)
class Finding:
    """One fact about the environment: what was checked, what was found, and what to do."""

    check: str
    status: str  # OK | WARN | FAIL
    found: str
    fix: str = ""

    def line(self) -> str:
        tail = f"  -> {self.fix}" if self.fix else ""
        return f"{self.status:<4}  {self.check:<20} {self.found}{tail}"


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _declared(dist: str) -> str:
    """dpnb's declared requirement on ``dist`` (e.g. ``torch>=2.6``), from its metadata."""
    for req in md.requires("dpnb") or []:
        name = req.split(";")[0].strip()
        if name.lower().startswith(dist.lower()) and not name[len(dist):][:1].isalnum():
            return name
    return dist


def _dpnb() -> list[Finding]:
    v = _version("dpnb")
    where = os.path.dirname(os.path.abspath(__file__))
    if v is None:
        return [Finding("dpnb", WARN, f"imported from {where}, but not installed",
                        'pip install . (or pip install -e ".[test,agent]" to develop)')]
    return [Finding("dpnb", OK, f"{v} ({where})")]


def _python() -> list[Finding]:
    v = ".".join(map(str, sys.version_info[:3]))
    if sys.version_info < (3, 10):
        return [Finding("python", FAIL, f"{v} ({sys.executable})", "dpnb needs Python 3.10 or newer")]
    return [Finding("python", OK, f"{v} ({sys.executable})")]


def _gpus() -> list[Finding]:
    """GPUs as NVML sees them (no CUDA context), with their memory."""
    try:
        import pynvml  # noqa: PLC0415  (ships with torch's CUDA builds as nvidia-ml-py)
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return [Finding("gpus", OK, f"none usable through NVML ({e})")]
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else name
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            out.append(Finding(f"gpu {i}", OK, f"{name}, {mem.total / 2**30:.1f} GiB "
                                               f"({mem.free / 2**30:.1f} GiB free)"))
        return out
    finally:
        pynvml.nvmlShutdown()


def _torch() -> list[Finding]:
    """torch, its CUDA and NCCL, and so the backend ``%dp start`` picks: the GPUs
    are counted once, with NVML, for both lines."""
    try:
        import torch  # noqa: PLC0415  (only here: the other checks run without it)
    except Exception as e:  # noqa: BLE001  (any import failure is the finding)
        return [Finding("torch", FAIL, f"cannot import ({type(e).__name__}: {e})",
                        f"pip install '{_declared('torch')}' (CPU: add -c constraints-cpu.txt)")]
    out = [Finding("torch", OK, f"{torch.__version__} (dpnb declares {_declared('torch')})")]
    cuda = torch.version.cuda
    if cuda is None:
        out.append(Finding("cuda", OK, "a CPU build of torch: ranks use gloo"))
        return out + [_backend(0)]
    nccl = "unknown"
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as e:  # noqa: BLE001  (a build without NCCL)
        nccl = f"none ({type(e).__name__})"
    from dpnb.engine import device  # noqa: PLC0415  (torch is importable by now)

    n = device.device_count()
    out.append(Finding("cuda", OK if n else WARN, f"CUDA {cuda}, NCCL {nccl}, {n} GPU(s) visible",
                       "" if n else "no GPU visible: check the driver (nvidia-smi) and "
                                    "CUDA_VISIBLE_DEVICES; ranks will use gloo"))
    return out + [_backend(n)] + _gpus()


def _backend(gpus: int) -> Finding:
    if gpus:
        return Finding("backend", OK, f"%dp start -n N picks nccl for N <= {gpus} on this host "
                                      f"(one GPU per engine), gloo beyond")
    return Finding("backend", OK, "%dp start picks gloo (CPU engines)")


def _ipyparallel() -> list[Finding]:
    v = _version("ipyparallel")
    if v is None:
        return [Finding("ipyparallel", FAIL, "not installed", f"pip install '{_declared('ipyparallel')}'")]
    from .ippcompat import check_ipyparallel  # noqa: PLC0415

    try:
        probs = check_ipyparallel()
    except Exception as e:  # noqa: BLE001  (an import inside ipyparallel failed)
        probs = [f"{type(e).__name__}: {e}"]
    if probs:
        return [Finding("ipyparallel", WARN, f"{v}: {'; '.join(probs)}",
                        f"install a version dpnb is tested with ({_declared('ipyparallel')})")]
    return [Finding("ipyparallel", OK, f"{v}, every internal dpnb reads is present")]


def _jupyter() -> list[Finding]:
    lab = _version("jupyterlab")
    if lab is None:
        return [Finding("jupyterlab", WARN, "not installed: %dp works in any IPython kernel, the "
                        "sidebar needs JupyterLab", f"pip install '{_declared('jupyterlab')}'")]
    from jupyter_core.paths import jupyter_config_path, jupyter_path  # noqa: PLC0415

    out = [Finding("jupyterlab", OK, lab)]
    ext = [os.path.join(p, "dpnb", "package.json") for p in jupyter_path("labextensions")]
    found = next((p for p in ext if os.path.isfile(p)), None)
    if found:
        with open(found) as fh:
            ver = json.load(fh).get("version", "?")
        same = ver == _version("dpnb")
        out.append(Finding("labextension", OK if same else WARN, f"dpnb {ver} ({os.path.dirname(found)})",
                           "" if same else "reinstall dpnb: the extension is another version's"))
    else:
        out.append(Finding("labextension", WARN, "not found in any labextensions folder",
                           "reinstall dpnb with pip (not from a source tree on PYTHONPATH)"))
    on = []
    for p in jupyter_config_path():
        f = os.path.join(p, "jupyter_server_config.d", "dpnb.json")
        if os.path.isfile(f):
            with open(f) as fh:
                cfg = json.load(fh)
            if cfg.get("ServerApp", {}).get("jpserver_extensions", {}).get("dpnb.lab"):
                on.append(f)
    out.append(Finding("server extension", OK if on else WARN,
                       f"dpnb.lab enabled ({on[0]})" if on else "dpnb.lab not enabled",
                       "" if on else "jupyter server extension enable dpnb.lab"))
    return out


def _kernelspec() -> list[Finding]:
    try:
        from jupyter_client.kernelspec import KernelSpecManager  # noqa: PLC0415
        specs = KernelSpecManager().find_kernel_specs()
    except Exception as e:  # noqa: BLE001  (jupyter_client missing or broken)
        return [Finding("kernelspec", WARN, f"cannot list kernels ({type(e).__name__}: {e})")]
    if "dpnb" in specs:
        return [Finding("kernelspec", OK, f"'Python 3 (dpnb)' at {specs['dpnb']}")]
    return [Finding("kernelspec", OK, "no 'Python 3 (dpnb)' kernel: %load_ext dpnb in any "
                    "Python kernel works", "")]


def _host() -> list[Finding]:
    out = []
    if os.path.isdir("/dev/shm"):
        total = shutil.disk_usage("/dev/shm").total
        small = total < SHM_MIN_BYTES
        out.append(Finding("/dev/shm", WARN if small else OK, f"{total / 2**30:.2f} GiB",
                           "DataLoader workers and NCCL need more: in Docker, --shm-size=8g"
                           if small else ""))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fmt = lambda x: "unlimited" if x == resource.RLIM_INFINITY else str(x)  # noqa: E731
    low = hard != resource.RLIM_INFINITY and hard < NOFILE_MIN
    out.append(Finding("open files", WARN if low else OK, f"soft {fmt(soft)}, hard {fmt(hard)} "
                       "(dpnb raises the soft limit on rank 0 as the world needs)",
                       f"raise the hard limit to at least {NOFILE_MIN} (limits.conf, or "
                       "ulimit -Hn as root)" if low else ""))
    try:
        from dpnb.engine.proc.private import private_dir  # noqa: PLC0415

        path = private_dir()
        mode = oct(os.stat(path).st_mode & 0o777)
        out.append(Finding("private folder", OK, f"{path} ({mode}, this user's only)"))
    except Exception as e:  # noqa: BLE001  (an unwritable /tmp, say)
        out.append(Finding("private folder", FAIL, f"cannot make it ({type(e).__name__}: {e})",
                           "set XDG_RUNTIME_DIR or TMPDIR to a folder only you can write"))
    return out


CHECKS: tuple[Callable[[], list[Finding]], ...] = (
    _dpnb, _python, _torch, _ipyparallel, _jupyter, _kernelspec, _host)


def findings() -> list[Finding]:
    out = []
    for check in CHECKS:
        try:
            out += check()
        except Exception as e:  # noqa: BLE001  (a check's own bug must not hide the others)
            out.append(Finding(check.__name__.strip("_"), WARN,
                               f"the check itself failed: {type(e).__name__}: {e}",
                               "please report it with this output"))
    return out


def main(as_json: bool = False) -> int:
    fs = findings()
    fatal = any(f.status == FAIL for f in fs)
    if as_json:
        print(json.dumps({"ok": not fatal, "findings": [asdict(f) for f in fs]}, indent=1))
    else:
        for f in fs:
            print(f.line())
        warns = sum(f.status == WARN for f in fs)
        print("dpnb cannot run here: see FAIL above" if fatal else
              f"dpnb can run here ({warns} warning{'s' if warns != 1 else ''})")
    return 1 if fatal else 0
