"""Ctrl-C and SIGTERM stop a training run between two steps, never in the middle of one.

A run's checkpoint must be a state the uninterrupted run passed through: a run stopped and resumed is then the same
run. A KeyboardInterrupt raised wherever the signal lands breaks that (the step counter already moved on, an
evaluation half done and never logged, a critic updated without its actor), so inside a training loop the signal is
only noted, and the loop stops at its next step boundary (`stop_here_if_requested`, the first thing of each
iteration). Two kinds of work stop at once instead (`stoppable_at_once`), because waiting for them could take minutes
and their effect can be set aside exactly: waiting for people's answers (kept in the label log, the session stays
open) and a feedback session's reward update (the checkpoint holds the state from before it, and the resumed run redoes
it). Outside a training loop (setup, the final evaluation, other commands) a signal interrupts at once, as Python's
Ctrl-C does. After the first signal later ones are ignored, so that saving the checkpoint is never cut short.

SIGINT is left alone where it is ignored (a job a shell started in the background): there Ctrl-C never reaches the
process, as before. SIGTERM always stops a run like Ctrl-C (SLURM at a job's time limit, a container stopping).
"""

import contextlib
import os
import signal
import sys
import threading

_received: list[int] = []  # the stop signals of this process, in order
_deferring = 0  # > 0 inside a training loop: a signal waits for the next step boundary
_at_once = 0  # > 0 inside work that stops at once even in a training loop


def _on_stop_signal(signum, frame) -> None:
    first = not _received
    _received.append(signum)
    if not first:
        return  # the run is already stopping (saving its checkpoint): never cut that short
    if _deferring and not _at_once:
        with contextlib.suppress(OSError):  # os.write, not print: a handler may run inside a print to the same stream
            os.write(sys.stderr.fileno(), b"\nstopping after the step in progress (then saving the checkpoint)\n")
        return
    raise KeyboardInterrupt


@contextlib.contextmanager
def stop_signals_handled():
    """While it lasts, SIGTERM (and SIGINT unless ignored) stop the process as described above; the previous handlers
    come back after. Only the main thread can set handlers: elsewhere (a sweep's worker thread) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig, handler in previous.items():
        if sig == signal.SIGTERM or handler not in (signal.SIG_IGN, None):
            signal.signal(sig, _on_stop_signal)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


@contextlib.contextmanager
def stop_between_steps():
    """A training loop's scope: a stop signal waits for `stop_here_if_requested` (or `stoppable_at_once` work). It
    starts clean: a signal that stopped an earlier run of this process (a test's, a notebook's) stops nothing here."""
    global _deferring
    _received.clear()
    with stop_signals_handled():
        _deferring += 1
        try:
            yield
        finally:
            _deferring -= 1


def stop_here_if_requested() -> None:
    """The loop's step boundary: raises KeyboardInterrupt if a stop signal came since the loop began."""
    if _received:
        raise KeyboardInterrupt


@contextlib.contextmanager
def stoppable_at_once():
    """Work whose effect the checkpoint can set aside exactly, and which may take long (waiting for people, a reward
    update): a stop signal raises KeyboardInterrupt in it at once, one that came just before raises on entry."""
    global _at_once
    stop_here_if_requested()
    _at_once += 1
    try:
        yield
    finally:
        _at_once -= 1


def stopped_by() -> int | None:
    """The first stop signal this process received (signal.SIGINT or signal.SIGTERM), or None."""
    return _received[0] if _received else None
