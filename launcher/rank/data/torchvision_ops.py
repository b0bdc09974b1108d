"""torchvision's image operators (nvJPEG's batched decode, the CPU decoders, the JPEG encoder) without importing
torchvision.

`import torchvision.io` imports the whole package, and with it torch._dynamo: seconds of a rank's start, more on a
fresh machine (docs/benchmarks/h200-time-to-model/README.md), all of it on the critical path, and as much again in a loader worker or mid-run wherever a file needs the CPU decoder. They need only
torchvision's image extension, which registers the torch.ops.image operators when it is loaded: `load` loads it
from torchvision's folder, and each function here calls the operator that the torchvision.io function it names
calls.

The reach into torchvision, named: the extension's file (image_stable in torchvision 0.29, image before it) and
three operators' schemas (0.19 to 0.29):
  image::decode_jpegs_cuda(Tensor[] encoded_images, int mode, Device device) -> Tensor[]
  image::decode_image(Tensor data, int mode, bool apply_exif_orientation) -> Tensor
  image::encode_jpeg(Tensor data, int quality) -> Tensor
Where the extension is not found, or does not define them, torchvision.io is imported instead, and registers the
same operators. Loading the extension first does not trouble a later `import torchvision`: the library is loaded
once per process.

The rank also defers torchvision's own import (`defer_package_import`, rank/worker.py): Ultralytics'
BaseValidator.__init__ imports torchvision (engine/validator.py: "so torchvision import time not recorded in
postprocess time"), and nothing else a detection rank on CUDA runs uses it. Deferred, the package's code runs when
one of its names is first read (the CPU validation's NMS, Ultralytics' own validator's), and not at all where none
is. What that saves is torchvision's own modules; the torch._dynamo they import is imported anyway, by the first call
of the optimizer (docs/benchmarks/h200-time-to-model/README.md).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import threading
import types
from pathlib import Path

import torch

RGB = 3  # torchvision.io.ImageReadMode.RGB
EXTENSIONS = ("image_stable", "image")  # torchvision's image extension, newest name first
OPERATORS = ("decode_jpegs_cuda", "decode_image", "encode_jpeg")
_lock = threading.Lock()
_loaded: str | None = None  # how the operators were registered: the extension's path, or "torchvision.io"


def decode_jpegs_cuda(data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """JPEG bytes ((n,) uint8 CPU tensors) -> (3, h, w) uint8 RGB images on `device`, in one batched nvJPEG call:
    torchvision.io.decode_jpeg(data, mode=ImageReadMode.RGB, device=device)."""
    load()
    return torch.ops.image.decode_jpegs_cuda(data, RGB, device)


def decode_image(data: torch.Tensor, apply_exif_orientation: bool = True) -> torch.Tensor:
    """Any image file's bytes ((n,) uint8 CPU tensor) -> (3, h, w) uint8 RGB on the CPU:
    torchvision.io.decode_image(data, mode=ImageReadMode.RGB, apply_exif_orientation=...)."""
    load()
    return torch.ops.image.decode_image(data, RGB, apply_exif_orientation)


def encode_jpeg(image: torch.Tensor, quality: int = 75) -> torch.Tensor:
    """A (3, h, w) uint8 CPU image as JPEG bytes: torchvision.io.encode_jpeg (its default quality, 4:2:0)."""
    load()
    return torch.ops.image.encode_jpeg(image, quality)


def load() -> str:
    """Register torchvision's image operators (once); returns how: the extension's path, or 'torchvision.io'."""
    global _loaded
    with _lock:
        if _loaded is None:
            path = _extension_path()
            if path is not None:
                try:
                    torch.ops.load_library(path)
                except OSError:
                    path = None
            if path is None or not all(hasattr(torch.ops.image, op) for op in OPERATORS):
                import torchvision.io  # noqa: F401 - registers the operators, as it does for its own functions

                path = "torchvision.io"
            _loaded = path
        return _loaded


def defer_package_import() -> bool:
    """Defer `import torchvision` in this process: its module is placed in sys.modules now, and runs its code at the
    first read of one of its names (DeferredModule). False, and nothing done, where torchvision is imported already or
    is not installed."""
    if "torchvision" in sys.modules:
        return False
    spec = _package_spec()
    if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
        return False
    module = importlib.util.module_from_spec(spec)
    module.__class__ = DeferredModule
    sys.modules["torchvision"] = module
    return True


class DeferredModule(types.ModuleType):
    """A package whose code has not run yet. An `import` statement reads only __spec__ of a module in sys.modules, and
    leaves it so (importlib.util.LazyLoader's modules run at that read); any other name (`torchvision.ops`, the
    __path__ that a submodule's import reads) runs the package's code first, once, while other threads wait."""

    def __getattribute__(self, name: str):
        if name in _READ_WITHOUT_RUNNING:
            return types.ModuleType.__getattribute__(self, name)
        with _running:  # re-entered by the package's own code while it runs (its `from torchvision import ...`)
            if type(self) is DeferredModule and self.__name__ not in _runs:
                _runs.add(self.__name__)
                try:
                    self.__spec__.loader.exec_module(self)
                except BaseException:
                    sys.modules.pop(self.__name__, None)  # as a failed import leaves it: the next import tries again
                    raise
                finally:
                    _runs.discard(self.__name__)
                self.__class__ = types.ModuleType
        return types.ModuleType.__getattribute__(self, name)


# what an import statement reads (__spec__), and inspect.getmodule of every module in sys.modules (__file__: torch's
# custom operators call it as they register, the first optimizer's among them)
_READ_WITHOUT_RUNNING = frozenset({"__spec__", "__name__", "__class__", "__loader__", "__file__", "__cached__",
                                   "__package__"})
_running = threading.RLock()
_runs: set[str] = set()  # the deferred packages whose code is running


def _package_spec():
    """torchvision's spec from the import path, never from sys.modules (a deferred module there runs when read)."""
    return importlib.machinery.PathFinder.find_spec("torchvision")


def _extension_path() -> str | None:
    spec = _package_spec()
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = str(Path(next(iter(spec.submodule_search_locations))))
    finder = importlib.machinery.FileFinder(
        folder, (importlib.machinery.ExtensionFileLoader, importlib.machinery.EXTENSION_SUFFIXES))
    for name in EXTENSIONS:
        found = finder.find_spec(name)
        if found is not None and found.origin:
            return found.origin
    return None
