"""Stop signals that end a training loop after its current step instead of inside it."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator, Sequence


@contextlib.contextmanager
def deferred(signals: Sequence[signal.Signals], who: str, at_once: Sequence[signal.Signals] = ()) -> Iterator[list[str]]:
    """The names of `signals` received while the block runs, which then no longer act at once: the loop checks the
    list after each step (the previous handlers come back after the block). A second signal of `at_once` (Ctrl-C
    again) raises KeyboardInterrupt where it lands. Only the main thread takes signals: elsewhere the list stays
    empty and nothing is deferred."""
    received: list[str] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def note(signum, frame):
        if received and signum in at_once:
            raise KeyboardInterrupt
        received.append(signal.Signals(signum).name)
        again = f" ({received[-1]} again stops at once)" if signum in at_once else ""
        print(f"[{who}] {received[-1]} received: stopping after this step, with its checkpoint{again}", file=sys.stderr)

    previous = {s: signal.signal(s, note) for s in signals}
    try:
        yield received
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
