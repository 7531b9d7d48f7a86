"""Device memory for CPU processes: which tensors "live on the GPU".

    with device_memory():
        place(model.parameters())          # as if the model had been loaded onto the GPU
        p.is_cuda                          # True; p.cpu() is a host copy (is_cuda False)
        torch.zeros_like(p).is_cuda        # True: results of device tensors stay on the device
        host.to("cuda").is_cuda            # True: an explicit move makes a device copy

Code that decides by `tensor.is_cuda` where state lives (Megatron's
HybridDeviceOptimizer: which parameters it offloads, which optimizer owns which
state, where `_move_new_state_to_right_device` puts it) runs its GPU branches on
CPU tensors. The tensors stay CPU tensors (`.device` says cpu); a tag on each
tensor object says where it would be on a GPU, and a torch-function mode carries
it as CUDA would: every result of an operation on a device tensor is on the
device, `.cpu()`/`.to("cpu")` make a host copy, `.cuda()`/`.to("cuda")` and a
factory given `device="cuda"` make a device tensor. Only inside `device_memory()`.
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

TAG = "_rlstream_on_device"
_active = 0


def active() -> bool:
    """Inside `device_memory()`: device placement is this module's to answer."""
    return _active > 0


def on_device(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, TAG, False)


def place(tensors) -> None:
    """Put `tensors` on the device (a model loaded onto the GPU)."""
    for t in tensors:
        setattr(t, TAG, True)


def _is_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda" if isinstance(device, (str, torch.device))\
        else False


def _target(func, args, kwargs):
    """The device an explicit move names: "cuda", "cpu" or None (no move)."""
    if func in (torch.Tensor.cuda,):
        return "cuda"
    if func in (torch.Tensor.cpu,):
        return "cpu"
    if func is torch.Tensor.to:
        for a in list(args[1:]) + [kwargs.get("device")]:
            if isinstance(a, (str, torch.device)):
                return torch.device(a).type
            if isinstance(a, torch.Tensor):
                return "cuda" if on_device(a) else "cpu"
        return None
    d = kwargs.get("device")
    return torch.device(d).type if isinstance(d, (str, torch.device)) else None


class _Carry(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:  # the legacy type string
            text = func(*args)
            return text.replace("torch.", "torch.cuda.", 1) if on_device(args[0]) else text
        target = _target(func, args, kwargs)
        if target == "cuda":  # a device the CPU build does not have: the tensor stays here, tagged
            if func is torch.Tensor.cuda:
                func, args = torch.Tensor.clone, args[:1]
                kwargs = {}
            elif func is torch.Tensor.to:
                args = tuple("cpu" if isinstance(a, (str, torch.device)) and torch.device(a).type == "cuda" else a
                             for a in args)
                if "device" in kwargs:
                    kwargs["device"] = "cpu"
            else:
                kwargs["device"] = "cpu"
        out = func(*args, **kwargs)
        src = args[0] if args else None
        if target == "cuda":
            out = _fresh(out, src)
            setattr(out, TAG, True)
        elif target == "cpu":
            if on_device(src):
                out = _fresh(out, src)
            _untag(out)
        elif target is None and any(on_device(a) for a in tree_flatten((args, kwargs))[0]):
            for o in tree_flatten(out)[0]:
                if isinstance(o, torch.Tensor) and o is not src or (o is src and on_device(src)):
                    setattr(o, TAG, True)
        return out


def _fresh(out, src):
    """A move between memories copies (on CPU, `.to("cpu")` of a CPU tensor returns itself)."""
    return out.clone() if out is src or (isinstance(src, torch.Tensor) and out.data_ptr() == src.data_ptr()) else out


def _untag(t) -> None:
    if isinstance(t, torch.Tensor) and TAG in t.__dict__:
        delattr(t, TAG)


@contextlib.contextmanager
def device_memory():
    """Tensors may live on the stand-in device for the duration (see the module docstring)."""
    global _active
    saved = torch.Tensor.__dict__.get("is_cuda")
    torch.Tensor.is_cuda = property(lambda self: on_device(self))
    _active += 1
    try:
        with _Carry():
            yield
    finally:
        _active -= 1
        if saved is None:
            del torch.Tensor.is_cuda
        else:
            torch.Tensor.is_cuda = saved
