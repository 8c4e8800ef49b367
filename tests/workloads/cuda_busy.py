"""A thread that calls the stand-in runtime's cudaLaunchKernel (which calls the driver's
cuLaunchKernel inside) in a tight loop, from before an agent attaches until killed.

    python cuda_busy.py
"""

from unbroken.engine.cuda import load

s = load()
while True:
    s.launch_kernel()
