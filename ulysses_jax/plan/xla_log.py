"""XLA's own messages during a compile-only plan, kept in a log file instead of the terminal.

Compiling for compile-only GPUs, XLA's C++ code writes straight to the process's standard error: buffer assignment
lines such as ``E ... exceeds the base limit ... error in the calculation`` and rematerialization warnings when a
program is larger than the device. They describe the compiler's work, not a problem with the user's command (the plan
reports the memory itself), so ``ulysses-jax plan`` sends them to a file and names it (``--xla-log``; ``-`` leaves them
on the terminal).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time


def default_path() -> str:
    return os.path.join(tempfile.gettempdir(), f"ulysses-plan-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log")


@contextlib.contextmanager
def stderr_to(path: str | None):
    """Within the block, file descriptor 2 (C++ and Python writes alike) goes to ``path`` (appended); ``None`` or
    ``"-"``: unchanged."""
    if path in (None, "-"):
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "ab") as f:
            os.dup2(f.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def summary(path: str | None) -> str | None:
    """One line naming the log when it holds anything (an empty log is removed); ``None`` otherwise."""
    if path in (None, "-") or not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        lines = f.read().decode("utf-8", "replace").splitlines()
    if not lines:
        os.remove(path)
        return None
    errors = sum(1 for ln in lines if ln.startswith("E"))
    return (f"XLA's compiler messages ({len(lines)} line{'s' if len(lines) > 1 else ''}, {errors} marked E: its notes "
            f"on buffer assignment and rematerialization for the compile-only GPUs; the plan above has the memory) are "
            f"in {path}")
