"""A workload with a known call plan on the stand-in CUDA libraries.

    python cuda_plan.py GO_FILE DONE_FILE [linger_s]

Loads the libraries, waits for GO_FILE, makes the calls below, writes DONE_FILE, lingers.
"""

import os
import sys
import time

from unbroken.engine.cuda import Fn, load

PLAN = {  # function: (calls, seconds each)
    "cudaLaunchKernel": (300, 200e-6),
    "cuLaunchKernel": (120, 0.0),
    "cudaGraphLaunch": (7, 1.5e-3),
    "cudaStreamSynchronize": (3, 20e-3),
}

go, done = sys.argv[1], sys.argv[2]
linger = float(sys.argv[3]) if len(sys.argv) > 3 else 30.0
s = load()
while not os.path.exists(go):
    time.sleep(0.005)
s.set_delay(Fn.CU_LAUNCH_KERNEL, 200e-6)
for _ in range(300):
    s.launch_kernel()
s.set_delay(Fn.CU_LAUNCH_KERNEL, 0.0)
for _ in range(120):
    s.driver_launch_kernel()
s.set_delay(Fn.CU_GRAPH_LAUNCH, 1.5e-3)
for _ in range(7):
    s.graph_launch()
s.set_delay(Fn.CU_STREAM_SYNCHRONIZE, 20e-3)
for _ in range(3):
    s.synchronize()
with open(done, "w") as f:
    f.write("done")
time.sleep(linger)
