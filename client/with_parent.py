"""``python -m client.with_parent PROGRAM ARGS…``: run a program that cannot
watch its launcher itself (etcd) so that it ends when the launcher is gone,
however it went (a ``kill -9`` included), as the SBP servers do by
themselves (``SBP_EXIT_WITH_PARENT``, ``net.service``).

SIGTERM and SIGINT are passed on to the program; once the launcher is gone
the program gets SIGTERM, then SIGKILL if it has not exited within
``STOP_TIMEOUT_S``. The exit status is the program's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from types import FrameType
from typing import Final

from net.service import PARENT_CHECK_S, PARENT_ENV

STOP_TIMEOUT_S: Final = 10.0


def main(argv: Sequence[str] | None = None) -> int:
    command = list(sys.argv[1:] if argv is None else argv)
    if not command:
        print("usage: python -m client.with_parent PROGRAM [ARGS…]", file=sys.stderr)
        return 2
    parent = os.environ.get(PARENT_ENV, "")
    launcher = int(parent) if parent.isdigit() else os.getppid()
    try:
        child = subprocess.Popen(command)
    except OSError as error:
        print(f"cannot run {command[0]}: {error}", file=sys.stderr)
        return 127

    def pass_on(signum: int, _frame: FrameType | None) -> None:
        child.send_signal(signum)

    signal.signal(signal.SIGTERM, pass_on)
    signal.signal(signal.SIGINT, pass_on)
    while child.poll() is None:
        if os.getppid() != launcher:
            child.terminate()
            try:
                child.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                child.kill()
            break
        time.sleep(min(PARENT_CHECK_S, 0.5))
    code = child.wait()
    if code < 0:
        # ended by a signal: end the same way (the launcher counts an etcd
        # ended by SIGTERM as a clean stop)
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
