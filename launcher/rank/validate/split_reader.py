"""The validation split read into host memory on a thread of its own while training goes on
(FastValidator.read_ahead, rank/ultralytics/fast_validation.py)."""

from __future__ import annotations

import threading
import time

from launcher.rank.validate.store import PreloadedSplit


class SplitReader:
    """PreloadedSplit.read of a loader in a thread of its own, started now (host memory only: it makes no CUDA call
    while the training thread may be capturing a graph), then the loader's close, which joins its workers off the
    training thread; `result()` waits for it: (the groups, the seconds the read took), or raises what the thread
    raised."""

    def __init__(self, loader):
        self.loader = loader
        self._result: tuple[dict, float] | None = None
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._read, name="val-split-reader", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        started = time.perf_counter()
        try:
            self._result = PreloadedSplit.read(iter(self.loader)), time.perf_counter() - started
        except BaseException as e:  # noqa: BLE001 - raised by result(), in the validating thread
            self._error = e
        finally:
            close = getattr(self.loader, "close", None)  # InfiniteDataLoader's: its workers are done either way
            if close is not None:
                close()

    @property
    def succeeded(self) -> bool:
        """The split is read (result() returns at once)."""
        return not self.thread.is_alive() and self._result is not None

    def result(self) -> tuple[dict, float]:
        self.thread.join()
        if self._error is not None:
            raise RuntimeError("reading the validation split during training failed") from self._error
        return self._result
