"""tests/test_rank_zygote.py's script: ends the way argv[1] says, after printing what a rank sees of itself."""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time


def main(how: str) -> None:
    print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} session leader {os.getsid(0) == os.getpid()} "
          f"main {__name__} argv {sys.argv[1:]}", flush=True)
    atexit.register(lambda: print("atexit ran", flush=True))
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread joined", flush=True))).start()
    if how == "exit3":
        sys.exit(3)
    if how == "raise":
        raise ValueError("from the script")
    if how == "hang":
        time.sleep(600)


if __name__ == "__main__":
    main(sys.argv[1])
