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
from dataclasses import dataclass
from types import TracebackType
from typing import Literal

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
