"""reader-spin on vLLM's own SpinCondition: run in a vLLM venv with the plugin's site on
PYTHONPATH and VFLEET_SM75 / VFLEET_SM75_SPIN_S set as the test wants. Loads the plugin the way
vLLM does (load_general_plugins), makes a real writer and reader pair on a zmq ipc socket, and
prints JSON: the reader's window after a wait, the writer's, and how long a wait with a 100 ms
timeout took 0.3 s after the last read (inside vLLM's 1 s window it returns at once; past a
shorter window it waits for a notification, here the timeout)."""

import json
import sys
import time

import zmq
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
from vllm.plugins import load_general_plugins

load_general_plugins()
ctx = zmq.Context()
address = f"ipc://{sys.argv[1]}"
writer = SpinCondition(is_reader=False, context=ctx, notify_address=address)
reader = SpinCondition(is_reader=True, context=ctx, notify_address=address)
reader.record_read()
time.sleep(0.3)
t0 = time.monotonic()
reader.wait(timeout_ms=100)
waited = time.monotonic() - t0
print(
    json.dumps(
        {
            "reader": reader.busy_loop_s,
            "writer": writer.busy_loop_s,
            "waited_s": waited,
            "hooked": getattr(SpinCondition, "_vfleet_reader_spin", None),
        }
    )
)
