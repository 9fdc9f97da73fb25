"""A pre-emption for tests: ``--trainer.callbacks+=interrupt.KillAfterStep --trainer.callbacks.step K``
SIGKILLs the process (every rank kills its own) right after optimizer step K, before any checkpoint
of that step is written: nothing is flushed, closed or cleaned up, as when a machine is taken away.
"""

import os
import signal

from lightning.pytorch import Callback


class KillAfterStep(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)
