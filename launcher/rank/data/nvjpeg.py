"""nvJPEG's batched decode queued on the caller's CUDA stream, without a host wait (`loader.jpeg_decoder=nvjpeg`).

torchvision.io.decode_jpeg(list, device="cuda") decodes on a stream of its own, taken from PyTorch's pool at normal
priority, and then waits for that stream on the host. Beside a training step that keeps the GPU busy, the decode's
kernels (the colour conversion after the hardware decoder) queue behind the step's kernels at the same priority: a
batch of 64 took 40-48 ms of wall time against 4 ms on an idle GPU (docs/benchmarks/README.md, section 6), about a
step's length, so the decoding thread set the input pipeline's pace. This module calls the same library (the copy
torchvision loads) through ctypes and queues the batched decode on a high-priority stream of its own, whose kernels
the GPU schedules before the step's; it returns as soon as the work is queued, with an event that the work reading
the images waits for on its own stream (a stream of its own, not the input pipeline's preparing stream: the
augmentation of earlier batches, and its host read of the box count, must not queue behind this batch's decode).

One decoder state is reused batch after batch: before it is reused, the host waits for the event recorded after its
last decode (long done by then: a step later), so that no queued copy still reads its staging buffers; the input
bytes of a decode are kept alive until that event has passed.

    decoder = NvJpeg.for_device(device)       # one per process and device; NvJpegUnavailable says why not
    images, ready = decoder.decode(list_of_uint8_cpu_tensors)  # (3, h, w) uint8 RGB, None where it declines
    torch.cuda.current_stream().wait_event(ready)  # then read them (gpu_input.wait_for also keeps their memory)

It declines (None) what its batched decode cannot take: a file whose header it cannot read, and with the hardware
backend a JPEG the hardware decoder does not support (progressive, or an unusual subsampling); the caller decodes
those another way. A batch the library fails raises NvJpegError.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import threading

import torch

MAX_COMPONENT = 4  # NVJPEG_MAX_COMPONENT
BACKEND_DEFAULT, BACKEND_HARDWARE = 0, 3  # nvjpegBackend_t
OUTPUT_RGB = 3  # nvjpegOutputFormat_t: planar RGB, as torchvision's ImageReadMode.RGB
CSS_UNKNOWN = -1  # nvjpegChromaSubsampling_t
STATUS_ARCH_MISMATCH = 7  # nvjpegCreateEx: this GPU has no hardware JPEG decoder
STATUS = ("SUCCESS", "NOT_INITIALIZED", "INVALID_PARAMETER", "BAD_JPEG", "JPEG_NOT_SUPPORTED", "ALLOCATOR_FAILURE",
          "EXECUTION_FAILED", "ARCH_MISMATCH", "INTERNAL_ERROR", "IMPLEMENTATION_NOT_SUPPORTED",
          "INCOMPLETE_BITSTREAM")


class NvJpegUnavailable(RuntimeError):
    """No usable libnvjpeg in this process (not found, or it would not start on this device)."""


class NvJpegError(RuntimeError):
    """A call of the library failed; the message names the call and its status."""


class Image(ctypes.Structure):
    """nvjpegImage_t: one pointer and pitch per plane."""

    _fields_ = [("channel", ctypes.c_void_p * MAX_COMPONENT), ("pitch", ctypes.c_size_t * MAX_COMPONENT)]


def status_name(status: int) -> str:
    return f"NVJPEG_STATUS_{STATUS[status]}" if 0 <= status < len(STATUS) else f"status {status}"


def loaded_library() -> str | None:
    """The libnvjpeg this process has mapped (torchvision's image extension links it), if any."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "libnvjpeg" in os.path.basename(path):
                    return path
    except OSError:  # no /proc: not Linux
        pass
    return None


def library_candidates() -> list[str]:
    """Where libnvjpeg may be, best first: the copy torchvision loaded, the one its wheel ships, NVIDIA's pip
    packages, the system's."""
    found = [loaded_library()]
    try:
        import torchvision

        site = os.path.dirname(os.path.dirname(torchvision.__file__))
        for pattern in ("torchvision.libs/libnvjpeg*.so*", "nvidia/nvjpeg/lib/libnvjpeg.so*",
                        "nvidia/cu*/lib/libnvjpeg.so*"):
            found += sorted(glob.glob(os.path.join(site, pattern)))
    except ImportError:
        pass
    found.append(ctypes.util.find_library("nvjpeg"))
    return list(dict.fromkeys(p for p in found if p))


def load_library(candidates: list[str] | None = None) -> tuple[ctypes.CDLL, ctypes.PyDLL]:
    """The first candidate that loads and has the batched decode, twice, with the signatures this module calls
    declared: as a CDLL, whose calls release the GIL (the batched decode: the training thread runs meanwhile), and as
    a PyDLL, whose calls keep it (the header reads, microseconds each: released and taken back 200 times a batch,
    the decoding thread would wait for the GIL behind the other threads' Python work each time)."""
    tried = []
    for path in library_candidates() if candidates is None else candidates:
        try:
            lib, quick = ctypes.CDLL(path), ctypes.PyDLL(path)
            _declare(lib)
            _declare(quick)
            return lib, quick
        except (OSError, AttributeError) as e:
            tried.append(f"{path}: {e}")
    raise NvJpegUnavailable("no libnvjpeg with nvjpegDecodeBatched found" + (f" ({'; '.join(tried)})" if tried
                                                                              else " (torchvision loads none)"))


def _declare(lib: ctypes.CDLL) -> None:
    p, size, i32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    ip = ctypes.POINTER(i32)
    signatures = {
        "nvjpegCreateEx": (i32, p, p, ctypes.c_uint, ctypes.POINTER(p)),
        "nvjpegJpegStateCreate": (p, ctypes.POINTER(p)),
        "nvjpegJpegStreamCreate": (p, ctypes.POINTER(p)),
        "nvjpegGetImageInfo": (p, p, size, ip, ip, ip, ip),
        "nvjpegJpegStreamParseHeader": (p, p, size, p),
        "nvjpegDecodeBatchedSupported": (p, p, ip),
        "nvjpegDecodeBatchedInitialize": (p, p, i32, i32, i32),
        "nvjpegDecodeBatched": (p, p, ctypes.POINTER(p), ctypes.POINTER(size), ctypes.POINTER(Image), p),
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = list(argtypes), i32


class NvJpeg:
    """A handle, a decoder state and a header parser of libnvjpeg for one device. Not thread-safe: one thread
    decodes at a time (the input pipeline's decoding thread; the start-up's warm-up before it)."""

    _instances: dict[int, NvJpeg] = {}
    _lock = threading.Lock()

    def __init__(self, device: torch.device):
        if device.type != "cuda":
            raise NvJpegUnavailable(f"nvJPEG decodes on CUDA devices, not {device}")
        self.device = device
        self.lib, self.quick = load_library()  # the long call releases the GIL; the quick ones keep it
        with torch.cuda.device(device):  # the library's runtime takes the thread's current context
            torch.cuda.init()
            self.handle = ctypes.c_void_p()
            status = self.lib.nvjpegCreateEx(BACKEND_HARDWARE, None, None, 0, ctypes.byref(self.handle))
            self.hardware = status != STATUS_ARCH_MISMATCH  # else a GPU without the JPEG engine: the CUDA decoder
            if not self.hardware:
                status = self.lib.nvjpegCreateEx(BACKEND_DEFAULT, None, None, 0, ctypes.byref(self.handle))
            if status:
                raise NvJpegUnavailable(f"nvjpegCreateEx failed on {device}: {status_name(status)}")
            self.state, self.parser = ctypes.c_void_p(), ctypes.c_void_p()
            self._check(self.lib.nvjpegJpegStateCreate(self.handle, ctypes.byref(self.state)), "nvjpegJpegStateCreate")
            self._check(self.lib.nvjpegJpegStreamCreate(self.handle, ctypes.byref(self.parser)),
                        "nvjpegJpegStreamCreate")
            self.stream = torch.cuda.Stream(device, priority=-1)  # the decodes' own (the highest priority)
        self._last: torch.cuda.Event | None = None  # recorded after the last decode that used the state
        self._held: tuple = ()  # what that decode reads until the event: the input bytes, the pointer arrays

    @classmethod
    def for_device(cls, device: torch.device) -> NvJpeg:
        """The process's decoder for `device`, made on first use (NvJpegUnavailable: why there is none)."""
        index = torch.device(device).index
        index = torch.cuda.current_device() if index is None else index
        with cls._lock:
            if index not in cls._instances:
                cls._instances[index] = cls(torch.device("cuda", index))
            return cls._instances[index]

    def _check(self, status: int, call: str) -> None:
        if status:
            raise NvJpegError(f"{call} failed: {status_name(status)}")

    def shape(self, data: torch.Tensor) -> tuple[int, int] | None:
        """(height, width) of a JPEG that the batched decode can take, else None."""
        components, subsampling = ctypes.c_int(), ctypes.c_int()
        widths, heights = (ctypes.c_int * MAX_COMPONENT)(), (ctypes.c_int * MAX_COMPONENT)()
        ptr, n = data.data_ptr(), data.numel()
        if self.quick.nvjpegGetImageInfo(self.handle, ptr, n, ctypes.byref(components), ctypes.byref(subsampling),
                                         widths, heights) or subsampling.value == CSS_UNKNOWN:
            return None
        if self.hardware:  # the hardware decoder takes baseline JPEGs of the common subsamplings only
            supported = ctypes.c_int(-1)
            if (self.quick.nvjpegJpegStreamParseHeader(self.handle, ptr, n, self.parser)
                    or self.quick.nvjpegDecodeBatchedSupported(self.handle, self.parser, ctypes.byref(supported))
                    or supported.value != 0):
                return None
        return heights[0], widths[0]

    def decode(self, payloads: list[torch.Tensor]) -> tuple[list[torch.Tensor | None], torch.cuda.Event]:
        """Each (n,) uint8 CPU tensor of JPEG bytes as a (3, h, w) uint8 RGB image on the device (None for a file the
        batched decode does not take), queued on the decoder's stream without a host wait, and the event after which
        the images are written. The images' memory belongs to that stream: a reader on another stream records it
        (Tensor.record_stream) so that the allocator keeps it for that stream's work."""
        data = [p if p.is_contiguous() else p.contiguous() for p in payloads]
        shapes = [self.shape(d) for d in data]
        take = [i for i, s in enumerate(shapes) if s is not None]
        out: list[torch.Tensor | None] = [None] * len(data)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            ready = torch.cuda.Event()
            if not take:
                ready.record(self.stream)
                return out, ready
            sizes = [3 * shapes[i][0] * shapes[i][1] for i in take]
            flat = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)  # on the decoder's stream
            images = (Image * len(take))()
            offset = 0
            for k, (i, size) in enumerate(zip(take, sizes)):
                h, w = shapes[i]
                out[i] = flat[offset : offset + size].view(3, h, w)
                for c in range(3):
                    images[k].channel[c] = flat.data_ptr() + offset + c * h * w
                    images[k].pitch[c] = w
                offset += size
            pointers = (ctypes.c_void_p * len(take))(*[data[i].data_ptr() for i in take])
            lengths = (ctypes.c_size_t * len(take))(*[data[i].numel() for i in take])
            if self._last is not None and not self._last.query():  # (a wait releases the GIL: only when needed)
                self._last.synchronize()  # the state's buffers are free again
            self._held = ()
            self._check(self.quick.nvjpegDecodeBatchedInitialize(self.handle, self.state, len(take), 1, OUTPUT_RGB),
                        "nvjpegDecodeBatchedInitialize")
            self._check(self.lib.nvjpegDecodeBatched(self.handle, self.state, pointers, lengths, images,
                                                     self.stream.cuda_stream), "nvjpegDecodeBatched")
            ready.record(self.stream)
            self._last, self._held = ready, (data, pointers, lengths, images)
        return out, ready
