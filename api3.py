# Ctrl-C during a long solve: within a second, nothing kept, next solve works
import os, signal, threading, time, remat
from remat import Costs, solve
c = Costs.uniform(1000, time=1e-3, size=1000, saved=5000)
def fire(): time.sleep(3); t[0] = time.time(); os.kill(os.getpid(), signal.SIGINT)
t = [0]
threading.Thread(target=fire, daemon=True).start()
try:
    solve(c, 500800)
    print("finished without interrupt?")
except KeyboardInterrupt:
    print(f"KeyboardInterrupt after {time.time()-t[0]:.2f}s from SIGINT")
t0 = time.time(); s = solve(Costs.uniform(50, time=1e-3, size=1000, saved=5000), 30000); print("next solve ok:", s.summary(), f"{time.time()-t0:.2f}s")
