"""A long solve shows its progress and stops on Ctrl-C (docs/how-it-works.md,
"Long chains").

Note [Stopping a solve]
-----------------------
The C solver runs on a worker thread (cffi lets go of the GIL around the
call), and the calling thread waits on it in short joins, in which Python
delivers a KeyboardInterrupt. On one, it sets the solve's
``remat_control.cancel``, which the C tables read between rows (a few
milliseconds apart), waits for the worker to return ``REMAT_E_CANCELLED``,
and raises the KeyboardInterrupt again: the solve leaves nothing behind (the
plan is cached only once ``solve`` returns, remat/runtime/chain_call.py
``plan_for``), and the next call solves again. Small tables (below
``INLINE_WORK``) run on the calling thread: they end before a person could
press Ctrl-C.

Once a solve has run ``SHOW_AFTER`` seconds (from the outermost ``solving``
block, the whole of ``remat.solve``), the C call then running shows a tqdm bar
on stderr, the table's rows done out of its total, and the steps between
tables (a long chain's, on groups) say a line each (``phase``).
"""

import contextlib
import sys
import threading
import time

__all__ = ["solving", "phase", "run", "SHOW_AFTER", "POLL"]

SHOW_AFTER = 2.0    # seconds of a solve before its progress shows
POLL = 0.05         # seconds between looks at a running C solve
INLINE_WORK = 1e8   # L^3 x slots below which a C call runs on the calling thread

_state = threading.local()
_clock = time.monotonic


@contextlib.contextmanager
def solving(what):
    """Time a solve (``what``: how a bar names it) from here; nested blocks keep the
    outermost start."""
    outer = getattr(_state, "start", None)
    if outer is None:
        _state.start, _state.what = _clock(), what
    try:
        yield
    finally:
        if outer is None:
            _state.start = None


def phase(text):
    """Say on stderr that a solve past ``SHOW_AFTER`` seconds is now at ``text`` (the
    steps between C tables, which show their own bars)."""
    start = getattr(_state, "start", None)
    if start is not None and _clock() - start >= SHOW_AFTER:
        print(f"{_state.what}: {text}", file=sys.stderr, flush=True)


def run(call, control, work, phase):
    """``call()`` (a C solve reporting into ``control``, a ``remat_control *``), on a
    worker thread where ``work`` (about L^3 x slots) is large; Note [Stopping a solve].
    ``phase`` names the table on a progress bar. Returns what ``call`` returns."""
    if work < INLINE_WORK:
        return call()
    start = getattr(_state, "start", None)
    start = _clock() if start is None else start
    what = getattr(_state, "what", None) or "remat: solving"
    done = []

    def work():
        try:
            done.append((call(), None))
        except BaseException as exc:   # (raised again on the calling thread)
            done.append((None, exc))

    worker = threading.Thread(target=work, name="remat-solver", daemon=True)
    bar = None
    worker.start()
    try:
        while worker.is_alive():
            worker.join(POLL)
            if bar is None and worker.is_alive() and _clock() - start >= SHOW_AFTER and control.total > 0:
                bar = _bar(control.total, f"{what}: {phase}")
            if bar is not None:   # (update: tqdm redraws at most every mininterval)
                bar.update(min(control.done, bar.total) - bar.n)
    except BaseException:   # (KeyboardInterrupt: stop the C solve, then let it through)
        control.cancel = 1
        while worker.is_alive():
            try:
                worker.join(POLL)
            except KeyboardInterrupt:   # (a second Ctrl-C: the solve is stopping already)
                pass
        raise
    finally:
        if bar is not None:
            bar.close()
    value, exc = done[0]
    if exc is not None:
        raise exc
    return value


def _bar(total, desc):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False, unit=" cells", unit_scale=True,
                mininterval=0.2, bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed} < {remaining}")
