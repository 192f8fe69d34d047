"""A rank whose watchdog thread is inside a store call when the script ends exits cleanly.

The watchdog's publishing thread is a daemon that calls the rendezvous store (C++) every few
seconds. If the interpreter starts finalizing while that thread is inside such a call, the
thread is ended by ``pthread_exit`` when it comes back for the GIL, and the forced unwinding
through pybind11's ``noexcept`` GIL guards calls ``std::terminate``: the process dies with
SIGABRT, "terminate called without an active exception", after all its work is done (seen in
CI on rank 1 of the pretraining example, whose rank 0 had exited with the store). The script
below holds its thread inside a slow ``add`` of a Python store while the main thread returns;
the watchdog must stop and join it at exit, so the exit status is 0.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import threading
    import time

    import torch.distributed as dist

    from deepshard.comm import CommWatchdog

    inside_add = threading.Event()


    class SlowStore(dist.Store):
        def __init__(self):
            super().__init__()
            self.data = {}

        def set(self, key, value):
            self.data[key] = value

        def get(self, key):
            return self.data[key]

        def check(self, keys):
            return all(key in self.data for key in keys)

        def add(self, key, amount):
            inside_add.set()
            time.sleep(0.02)  # the thread is (nearly always) inside a C++ store call
            self.data[key] = int(self.data.get(key, 0)) + amount
            return self.data[key]


    store = SlowStore()  # kept: pybind11 finds the Python overrides through this object
    dog = CommWatchdog(10.0, store=store, rank=0, interval_s=0.01)
    assert inside_add.wait(30)
    print("script done", flush=True)
    """
)


@pytest.mark.slow  # a subprocess importing torch (~4 s); the main run has it
def test_exit_while_the_thread_is_in_a_store_call_is_clean() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert "script done" in done.stdout, done.stderr[-2000:]
    assert "terminate called" not in done.stderr, done.stderr[-2000:]
    assert done.returncode == 0, done.stderr[-2000:]
