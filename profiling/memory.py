"""Peak memory over a window (a stage, a benchmark step) and the device's total/available memory, in bytes.

CUDA: the caching allocator's own counters (`reset_peak_memory_stats` at the start, `max_memory_allocated` at the
end). That is tensor memory, not what nvidia-smi shows (no allocator slack, no CUDA context).

CPU: the peak resident set size of the whole process during the window. Linux keeps a high-water mark (VmHWM in
/proc/self/status); writing "5" to /proc/self/clear_refs resets it to the current RSS (Linux >= 4.0), so
reset-then-read gives the exact peak with no sampling cost. Where that is not allowed (other OSes, locked-down
/proc), a thread samples psutil's RSS every `interval_s` instead, which can miss spikes shorter than that.
Both count every thread of the process, and the reset is process-wide: do not nest CPU windows.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import psutil

Method = Literal["auto", "vmhwm", "sampling"]


@dataclass(frozen=True)
class DeviceMemory:
    device: str
    total_bytes: int
    available_bytes: int


@dataclass(frozen=True)
class MemorySnapshot:
    device: str
    method: str  # "cuda_allocator", "proc_vmhwm" or "rss_sampling"
    start_bytes: int
    peak_bytes: int
    end_bytes: int
    total_bytes: int
    available_bytes: int

    @property
    def peak_increase_bytes(self) -> int:
        """How far the window pushed memory above where it started."""
        return max(0, self.peak_bytes - self.start_bytes)


def _is_cuda(device: str) -> bool:
    return device.startswith("cuda")


def device_memory(device: str = "cpu") -> DeviceMemory:
    if _is_cuda(device):
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(device))
        return DeviceMemory(device, total_bytes=int(total), available_bytes=int(free))
    vm = psutil.virtual_memory()
    return DeviceMemory(device, total_bytes=int(vm.total), available_bytes=int(vm.available))


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"{field} missing from /proc/self/status")


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark; False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        # Some kernels accept the write but ignore the value; trust the reset only if it took effect.
        return _status_kib("VmHWM") <= _status_kib("VmRSS") + 4 * 1024 * 1024
    except (OSError, ValueError):
        return False


@dataclass(frozen=True)
class ProcessMemory:
    """This process's resident memory now (Linux /proc/self/status): its high-water mark, and the resident pages
    split into file-backed (a mapped file: a model used where it lies) and anonymous (allocations)."""

    peak_rss_bytes: int
    rss_bytes: int
    file_bytes: int
    anon_bytes: int


def process_memory() -> ProcessMemory | None:
    """The process's memory, None where /proc/self/status has no such fields (not Linux)."""
    try:
        return ProcessMemory(_status_kib("VmHWM"), _status_kib("VmRSS"), _status_kib("RssFile"), _status_kib("RssAnon"))
    except (OSError, ValueError):
        return None


def unique_storage_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind `tensors` (views and aliases of one storage count once)."""
    import torch

    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        seen[key] = max(seen.get(key, 0), storage.nbytes())
    return sum(seen.values())


def current_rss() -> int:
    return int(psutil.Process(os.getpid()).memory_info().rss)


class _RssSampler:
    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._process = psutil.Process(os.getpid())
        self.peak = int(self._process.memory_info().rss)
        self._thread = threading.Thread(target=self._loop, name="glowplug-rss-sampler", daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.peak = max(self.peak, int(self._process.memory_info().rss))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, int(self._process.memory_info().rss))
        return self.peak


class PeakMemory:
    """`with PeakMemory("cpu") as window: ...` then `window.snapshot` (also returned by `stop()`)."""

    def __init__(self, device: str = "cpu", *, method: Method = "auto", interval_s: float = 0.002) -> None:
        if method not in ("auto", "vmhwm", "sampling"):
            raise ValueError(f"method must be auto, vmhwm or sampling (got {method!r})")
        self.device = device
        self._method = method
        self._interval_s = interval_s
        self._sampler: _RssSampler | None = None
        self._start_bytes = 0
        self._used_method = ""
        self.snapshot: MemorySnapshot | None = None

    def start(self) -> None:
        if _is_cuda(self.device):
            import torch

            dev = torch.device(self.device)
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            self._start_bytes = int(torch.cuda.memory_allocated(dev))
            self._used_method = "cuda_allocator"
            return
        self._start_bytes = current_rss()
        if self._method != "sampling" and reset_peak_rss():
            self._used_method = "proc_vmhwm"
            return
        if self._method == "vmhwm":
            raise OSError("cannot reset the RSS high-water mark (/proc/self/clear_refs); use method='sampling'")
        self._sampler = _RssSampler(self._interval_s)
        self._sampler.start()
        self._used_method = "rss_sampling"

    def stop(self) -> MemorySnapshot:
        if self._used_method == "cuda_allocator":
            import torch

            dev = torch.device(self.device)
            torch.cuda.synchronize(dev)
            peak, end = int(torch.cuda.max_memory_allocated(dev)), int(torch.cuda.memory_allocated(dev))
        elif self._used_method == "proc_vmhwm":
            end = current_rss()
            peak = max(_status_kib("VmHWM"), end)
        elif self._sampler is not None:
            peak = self._sampler.stop()
            end = current_rss()
            self._sampler = None
        else:
            raise RuntimeError("PeakMemory.stop() called before start()")
        mem = device_memory(self.device)
        self.snapshot = MemorySnapshot(
            device=self.device,
            method=self._used_method,
            start_bytes=self._start_bytes,
            peak_bytes=max(peak, self._start_bytes),
            end_bytes=end,
            total_bytes=mem.total_bytes,
            available_bytes=mem.available_bytes,
        )
        return self.snapshot

    def __enter__(self) -> PeakMemory:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


# ---------------------------------------------------------------- live tensor bytes


class LiveTensorPeak:
    """The peak of the bytes held by tensors that torch ops created inside the window, on this thread.

    Why not RSS: the allocator hands freed heap back to the next tensor without the kernel seeing it, so an RSS
    peak depends on how much heap the process had touched before (the issue's 10 MB vs 96 MB vs 109 MB for one
    forward). Counting live tensor storage instead is independent of that history: every op output is looked up
    by its storage; a storage first seen as an output (not one of the op's inputs: a view of a weight is not new
    memory) is counted once, and forgotten when the last Python tensor on it is collected (a weakref finalizer).
    Scratch memory a kernel frees before it returns is not seen: the result is a lower bound of the true peak
    that no longer depends on the process's heap history, and it is exact for the intermediates of a forward.

    The dispatch mode is per thread, so other threads' tensors (a concurrent compile) are not counted.
    """

    method = "live_tensor_bytes"

    def __init__(self) -> None:
        self._mode: Any = None
        self.live_bytes = 0
        self.peak_bytes = 0
        self._refs: dict[int, list[int]] = {}  # storage data_ptr -> [tensor refs, bytes]

    def _track(self, tensor: Any, inputs: set[int]) -> None:
        import weakref

        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        entry = self._refs.get(key)
        if entry is None:
            if key in inputs or storage.nbytes() == 0:
                return  # a view of (or in-place write into) memory that existed before the window
            entry = self._refs[key] = [0, int(storage.nbytes())]
            self.live_bytes += entry[1]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        entry[0] += 1
        weakref.finalize(tensor, self._release, key)

    def _release(self, key: int) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._refs[key]
            self.live_bytes -= entry[1]

    def __enter__(self) -> LiveTensorPeak:
        import torch

        from glowplug.base.torch_compat import TorchDispatchMode, tree_flatten

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                out = func(*args, **(kwargs or {}))
                flat_in, _ = tree_flatten((args, kwargs))
                inputs = {t.untyped_storage().data_ptr() for t in flat_in if isinstance(t, torch.Tensor)}
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor) and t.device.type != "meta":
                        tracker._track(t, inputs)
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._mode.__exit__(exc_type, exc, tb)
        self._mode = None
