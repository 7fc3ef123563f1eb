"""A job for ckptshard's worker processes that never ends (importable by a spawned worker): each worker notes
its pid in $SLOW_WORKER_PIDS, so a test can interrupt a run while its workers write and see them all gone."""

import os
import time


def never_done(job, *args):
    with open(os.path.join(os.environ["SLOW_WORKER_PIDS"], str(os.getpid())), "w"):
        pass
    while True:
        time.sleep(1)
