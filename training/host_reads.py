"""Reading a step's small values (loss, gradient norm, counters) on the host.

A device-to-host copy waits on a GPU for every host copy in flight on any stream: measured on the
H200 (benchmarks/probe_read_latency.py), a 4-byte read issued after a 30 ms step returned
only when a background checkpoint's 10 GB of host copies on a side stream had ended (195 ms),
whether those copies were issued at once or 256 MB at a time, into pageable or pinned memory. So
the step after an async save began ran at half speed: its log line's read waited for the save's
copies. Here, on CUDA, the values are written by a kernel straight into page-locked host memory
that the GPU addresses (no copy engine involved), and the host waits on an event of the current
stream only: the read returned at 30 ms in the same probe. Elsewhere (CPU, or a GPU whose mapping
does not check out) it is an ordinary copy.
"""

import itertools

import torch

_MAPPED: dict[torch.device, tuple[torch.Tensor, torch.Tensor] | None] = {}


def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Float64 CPU copies of small tensors, all on one device (shapes kept)."""
    device = tensors[0].device
    sizes = [t.numel() for t in tensors]
    mapped = _mapped(device, sum(sizes)) if device.type == "cuda" else None
    if mapped is None:
        return [t.detach().to("cpu", torch.float64) for t in tensors]
    host, on_device = mapped
    spans = [slice(end - size, end) for size, end in zip(sizes, itertools.accumulate(sizes))]
    for tensor, span in zip(tensors, spans):
        # A kernel writes the values (mul, not copy_: a copy of equal dtypes is a memcpy, which
        # the copy engine would queue behind the other host copies).
        torch.mul(tensor.detach().reshape(-1), 1, out=on_device[span])
    written = torch.cuda.Event()
    written.record()
    written.synchronize()
    return [host[span].clone().view(t.shape) for span, t in zip(spans, tensors)]


def read_float(tensor: torch.Tensor) -> float:
    """tensor.item(), without waiting for other streams' host copies (see to_host)."""
    return to_host(tensor)[0].item()


def _mapped(device: torch.device, size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(pinned host float64 buffer, the same memory as a tensor on device) of at least size
    elements, kept for the process's life; None where the GPU cannot address it."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device in _MAPPED and (_MAPPED[device] is None or _MAPPED[device][0].numel() >= size):
        return _MAPPED[device]
    host = torch.zeros(max(size, 64), dtype=torch.float64, pin_memory=True)

    class Interface:  # host memory as CUDA sees it: with unified addressing, the same pointer
        __cuda_array_interface__ = {
            "shape": tuple(host.shape), "typestr": "<f8", "data": (host.data_ptr(), False), "version": 3,
        }  # fmt: skip

    try:
        with torch.cuda.device(device):
            on_device = torch.as_tensor(Interface(), device=device)
            same_memory = on_device.device == device and on_device.data_ptr() == host.data_ptr()
            if same_memory:  # and what a kernel writes there is what the host reads
                on_device.fill_(7.0)
                torch.cuda.current_stream().synchronize()
                same_memory = bool((host == 7.0).all())
                host.zero_()
    except (RuntimeError, TypeError, ValueError):
        same_memory = False
    _MAPPED[device] = (host, on_device) if same_memory else None
    return _MAPPED[device]
