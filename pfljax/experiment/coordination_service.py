"""jax's coordination service in a process of its own (run as a script by `peers`).

jax.distributed starts the service inside process 0; when process 0 dies, the other
processes' jax clients lose it and abort in C++ (exit 134) before they can say why. Run
apart, the service outlives process 0 for `linger` seconds, long enough for the others to
find process 0's heartbeat missing and end with one line (`peers.watch`). It ends on
SIGTERM (process 0's `shutdown`, after jax's shutdown barrier; the service's own shutdown
lets the other processes finish disconnecting) or `linger` seconds after process 0 is gone.

Usage: python coordination_service.py ADDRESS NUM_PROCESSES HEARTBEAT_S SHUTDOWN_S PARENT_PID LINGER_S
"""

import os
import signal
import sys
import time


def serve(address: str, num_processes: int, heartbeat_s: int, shutdown_s: int, parent: int, linger: float):
    """Runs the service until SIGTERM, or `linger` seconds after process `parent` is gone."""
    import jaxlib._jax as xla  # pylint: disable=import-outside-toplevel  (jaxlib alone: no jax import)

    service = xla.get_distributed_runtime_service(
        address, num_processes, heartbeat_timeout=heartbeat_s, shutdown_timeout=shutdown_s
    )

    def stop(*_):
        service.shutdown()  # lets the other processes' last calls (their disconnects) finish
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches process 0, which shuts this down
    while os.getppid() == parent:
        time.sleep(0.5)
    time.sleep(linger)
    os._exit(0)


if __name__ == "__main__":
    address, num, heartbeat, shutdown, parent_pid, linger_s = sys.argv[1:7]
    serve(address, int(num), int(heartbeat), int(shutdown), int(parent_pid), float(linger_s))
