"""One rank of a 2-rank CPU training run whose rank 1 misbehaves at a given step (run by
test_rank_faults.py as a plain subprocess, with torchrun's environment set by the test).

    python tests/distributed/fault_worker.py MODE STEP MARKER -- train.py arguments...

MODE ``stop``: rank 1 sends itself SIGSTOP before step STEP (a hung process: alive, silent);
``die``: rank 1 exits with code 9 before step STEP. Just before, rank 1 writes the wall-clock
time into MARKER. Every rank then runs ``megatron_snip.train.main`` and exits with its code.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def main() -> int:
    mode, fault_step, marker = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    argv = sys.argv[sys.argv.index("--") + 1:]
    from megatron_snip import train
    from megatron_snip.training.trainer import Trainer

    real_step = Trainer.train_step

    def train_step(self, step):
        if self.topo.rank == 1 and step == fault_step:
            with open(marker, "w") as f:
                f.write(repr(time.time()))
            if mode == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                os._exit(9)
        return real_step(self, step)

    Trainer.train_step = train_step
    return train.main(argv)


if __name__ == "__main__":
    sys.exit(main())
