# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""A wall-clock deadline for a block of code.

PRIVATE to the collection: this is not a public API and may change at any time.
Only the modules of llmserve.vllm may import it.
"""

import contextlib
import signal
from collections.abc import Iterator
from types import FrameType
from typing import NoReturn, Optional


class DeadlinePassed(BaseException):
    """The time given to a `deadline` block ran out.

    A BaseException, as KeyboardInterrupt is, so that no `except Exception` in the
    libraries the block calls (urllib, http.client, ssl) can swallow it and carry on.
    """


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Interrupt the block with DeadlinePassed once `seconds` (> 0) of wall time have passed.

    It works by SIGALRM, so it ends what a socket timeout or a clock read between
    reads cannot: a server that sends its headers or body a byte at a time (each
    byte restarts a socket timeout) and a regular expression that backtracks
    without end (re has no timeout, but checks for signals while it matches).
    Main thread only; blocks must not nest.
    """

    def expire(signum: int, frame: Optional[FrameType]) -> NoReturn:
        raise DeadlinePassed()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
        finally:
            # Restored even when the alarm fires between the block's end and the line above.
            signal.signal(signal.SIGALRM, previous)
