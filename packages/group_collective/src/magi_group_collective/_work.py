"""Work handle returned by every collective of the package."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class Work:
    """Handle of a GroupCast / GroupReduce in flight.

    ``wait()`` waits for the communication and then runs the post-processing (un-permute into
    ``output``, or the reduction into ``output``); only after it returns is ``output`` final. Calling
    ``wait()`` again is a no-op. The handle keeps the communication buffers alive until then.
    """

    __slots__ = ("_buffers", "_done", "_post", "_works")

    def __init__(self, works: Sequence[object] = (), post: Callable[[], None] | None = None, buffers=()):
        self._works = list(works)
        self._post = post
        self._buffers = tuple(buffers)
        self._done = False

    @staticmethod
    def completed() -> Work:
        """A handle whose work is already done (returned by synchronous calls)."""
        work = Work()
        work._done = True
        return work

    def wait(self) -> None:
        """Block until the data is in ``output`` (communication + post-processing)."""
        if self._done:
            return
        for w in self._works:
            w.wait()
        if self._post is not None:
            self._post()
        self._done = True
        self._works, self._post, self._buffers = [], None, ()

    def is_completed(self) -> bool:
        """True once ``wait()`` has run (post-processing included)."""
        return self._done

    def __repr__(self) -> str:
        return f"Work(completed={self._done})"
