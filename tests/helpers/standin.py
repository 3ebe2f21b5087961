"""A CPU stand-in for NCCL: a group that serves the CUDA device type only.

NCCL reduces CUDA tensors and nothing else: a CPU tensor given to a
collective of an NCCL group fails with "No backend type associated with
device type cpu" -- on the first machine with GPUs, never in a CPU run of
gloo.  This stand-in makes that failure happen on a CPU:

* **the group**: a backend named ``standin``, registered with
  ``dist.Backend.register_backend(..., devices=["cuda"])``, built on
  ``ProcessGroupGloo`` (real values travel between real processes).  c10d
  dispatches a collective by the tensors' device type, exactly as for NCCL:
  a CPU tensor finds no backend and fails with torch's own message.  Chosen
  over torch's fake backend because dpnb's checks (save's agreement, the
  collective check's fingerprints, the stats gather's global batch) need the
  values; the fake backend returns none.
* **the tensors**: a CPU-only torch cannot make a CUDA tensor, so
  :class:`CudaLike` is a wrapper subclass whose ``device`` *is* ``cuda:0``
  (``_make_wrapper_subclass`` sets the metadata without allocating) and
  whose data is a CPU tensor inside.  Ops run on the inner tensor and come
  back wrapped; an op mixing it with a plain CPU tensor (not a 0-dim
  scalar) fails as CUDA's "Expected all tensors to be on the same device"
  does.  A collective (``c10d.*`` ops) is redispatched to c10d's CUDA
  kernel with the inner tensors: that kernel asks the group for its CUDA
  backend -- the gloo one -- so values flow; a plain CPU tensor never gets
  there (c10d's CPU kernel fails first).
* **making them**: :class:`CudaMode`, a ``TorchFunctionMode``, turns every
  ``device="cuda..."`` factory call (``torch.tensor/zeros/empty/...``) and
  ``Tensor.to(cuda)`` / ``.cuda()`` into a CPU call whose result is wrapped.
  ``.cpu()`` / ``.to("cpu")`` / ``.item()`` / ``.tolist()`` give plain CPU
  values.
* **naming it**: dpnb forms ``init_process_group(backend="nccl",
  device_id=cuda:N)``; :func:`install` has torch's ``init_process_group``
  take ``"nccl"`` as the stand-in and drop ``device_id`` (a CPU-only torch
  refuses it: the eager NCCL init is not stood in).  ``torch.cuda``'s
  few calls that c10d makes on a CUDA tensor (capability, current device)
  and ``torch.accelerator.synchronize`` answer as one H100 would (gloo's
  collectives finish on the host, so there is nothing to wait for).

What is *not* stood in: kernels that run late (a collective here completes
before it returns), NCCL's watchdog and abort semantics (gloo's ``abort``
is the one called), streams.  Those are the GPU check's
(``benchmarks/gpu_check.py``).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

NAME = "standin"
CUDA0 = torch.device("cuda", 0)
_CUDA_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
#: ops that legitimately take a CPU tensor next to a CUDA one
_CROSS_DEVICE = {"copy_", "_to_copy", "_local_scalar_dense", "lift_fresh"}


def _is_cuda(dev) -> bool:
    if dev is None or isinstance(dev, torch.Tensor):
        return False
    if isinstance(dev, int):  # .to(0): a device index means an accelerator
        return True
    try:
        return torch.device(dev).type == "cuda"
    except (RuntimeError, TypeError):
        return False


class CudaLike(torch.Tensor):
    """A tensor that says it lives on ``cuda:0`` and holds a CPU tensor."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        r = torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, dtype=inner.dtype, device=CUDA0, strides=inner.stride(),
            storage_offset=inner.storage_offset(), requires_grad=inner.requires_grad)
        r.inner = inner
        return r

    def __repr__(self):
        return f"CudaLike({self.inner!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        back: dict = {}
        plain_cpu: list = []

        def unwrap(x):
            if isinstance(x, CudaLike):
                back[id(x.inner)] = x
                return x.inner
            if isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dim() > 0:
                plain_cpu.append(x)
            return x

        a, k = tree_map(unwrap, args), tree_map(unwrap, kwargs)
        name = func.__name__.split(".")[0]
        if func.namespace == "c10d":
            # c10d's CUDA kernel: getBackend(CUDA) is the stand-in's gloo
            out = func.redispatch(_CUDA_KEYS, *a, **k)
        else:
            if plain_cpu and name not in _CROSS_DEVICE:
                raise RuntimeError("Expected all tensors to be on the same device, but found at "
                                   "least two devices, cuda:0 and cpu! (stand-in)")
            out = func(*a, **k)
            if name == "_to_copy" and not _is_cuda(kwargs.get("device", CUDA0)):
                return out  # .cpu(), .to("cpu"): a plain CPU tensor

        def rewrap(x):
            if not isinstance(x, torch.Tensor) or isinstance(x, CudaLike):
                return x
            return back[id(x)] if id(x) in back else CudaLike(x)

        return tree_map(rewrap, out)


_TO_HOST = (torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__int__,
            torch.Tensor.__float__, torch.Tensor.__bool__, torch.Tensor.__index__)


def _to_cuda(x):
    return tree_map(lambda t: CudaLike(t) if isinstance(t, torch.Tensor)
                    and not isinstance(t, CudaLike) else t, x)


#: calls that legitimately mix a CPU tensor with a CUDA one
_CROSS_CALLS = {"copy_", "to", "__setitem__", "new_tensor", "type_as"}


def _has_cuda_like(tree) -> bool:
    return any(isinstance(x, CudaLike) for x in tree_flatten(tree)[0])


def _plain_cpu(tree) -> bool:
    return any(isinstance(x, torch.Tensor) and not isinstance(x, CudaLike)
               and x.device.type == "cpu" and x.dim() > 0 for x in tree_flatten(tree)[0])


class CudaMode(TorchFunctionMode):
    """Factories and moves to ``cuda`` make :class:`CudaLike` tensors; every
    other torch call on one runs on its inner CPU tensor, rewrapped (torch's
    C++ bindings take a CUDA device guard before dispatch, which a CPU-only
    torch cannot)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if (getattr(func, "__module__", None) or "").startswith("torch.distributed"):
            # a collective given a tensor: c10d's op reaches CudaLike's dispatch
            return func(*args, **kwargs)
        if name == "__get__":  # .device, .shape, ...: the wrapper's own metadata
            return func(*args, **kwargs)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
            return _to_cuda(func(*args, **kwargs))
        if not _has_cuda_like((args, kwargs)):
            if func is torch.Tensor.cuda:
                return CudaLike(args[0].clone())
            if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
                out = func(args[0], *args[2:], **kwargs)
                return CudaLike(out if out is not args[0] else out.clone())
            return func(*args, **kwargs)
        me = args[0] if args and isinstance(args[0], CudaLike) else None
        if me is not None:
            if func is torch.Tensor.cuda:
                return me
            if func is torch.Tensor.cpu:
                return me.inner.clone()
            if func is torch.Tensor.to:
                target = args[1] if len(args) > 1 else kwargs.get("device")
                if isinstance(target, (str, torch.device)) and not _is_cuda(target):
                    return me.inner.to(*args[1:], **kwargs).clone()
        if name not in _CROSS_CALLS and _plain_cpu((args, kwargs)):
            raise RuntimeError("Expected all tensors to be on the same device, but found at "
                               "least two devices, cuda:0 and cpu! (stand-in)")
        back: dict = {}

        def unwrap(x):
            if isinstance(x, CudaLike):
                back[id(x.inner)] = x
                return x.inner
            if isinstance(x, slice):  # t[a:b] with 0-dim tensors for bounds
                return slice(*(cpu(v) for v in (x.start, x.stop, x.step)))
            return x

        a, k = tree_map(unwrap, args), tree_map(unwrap, kwargs)
        if name == "to" and len(a) > 1 and _is_cuda(a[1]):
            a = (a[0],) + a[2:]
        out = func(*a, **k)
        if func in _TO_HOST:
            return out

        def rewrap(x):
            if not isinstance(x, torch.Tensor) or isinstance(x, CudaLike):
                return x
            return back[id(x)] if id(x) in back else CudaLike(x)

        return tree_map(rewrap, out)


def _creator(store, rank, size, timeout):
    return dist.ProcessGroupGloo(store, rank, size, timeout)


@functools.cache
def install() -> None:
    """Register the stand-in backend and let ``"nccl"`` name it (once per process)."""
    dist.Backend.register_backend(NAME, _creator, devices=["cuda"])
    real_init = dist.init_process_group

    def init_process_group(backend=None, *args, device_id=None, **kwargs):
        # dpnb forms an NCCL cluster as "cpu:gloo,cuda:nccl" (a script's CPU
        # collectives work, as torch gives a script naming both); the stand-in
        # serves CUDA only, stricter on purpose: dpnb's *own* collectives must
        # stay on the communication device, and a CPU tensor among them fails
        if str(backend).lower() in ("nccl", "cpu:gloo,cuda:nccl"):
            backend = NAME
        return real_init(backend, *args, **kwargs)

    dist.init_process_group = init_process_group
    real_barrier = dist.barrier

    def barrier(group=None, async_op=False, device_ids=None):
        # c10d's barrier makes its tensor in C++: on CUDA for an NCCL group,
        # on the CPU for any other backend -- which the stand-in refuses.  An
        # all_reduce of one "cuda" element is the same rendezvous.
        pg = group or dist.group.WORLD
        if [d.type for d in pg._device_types] != ["cuda"]:
            return real_barrier(group, async_op, device_ids)
        return dist.all_reduce(CudaLike(torch.zeros(1)), group=group, async_op=async_op)

    dist.barrier = barrier
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.current_device = lambda: 0
    torch.cuda.set_device = lambda *a, **k: None
    real_sync = torch.accelerator.synchronize

    def synchronize(device=None):
        if not _is_cuda(device):
            return real_sync(device)
        return None

    torch.accelerator.synchronize = synchronize


def cpu(x):
    """A :class:`CudaLike`'s values as a plain CPU tensor (anything else unchanged)."""
    return x.inner if isinstance(x, CudaLike) else x
