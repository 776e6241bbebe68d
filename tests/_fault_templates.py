"""Templates that make rank 1 of a trial fail mid-training: the runners' fault injection goes
through the same extension point users have (a template module), not through test hooks."""

from __future__ import annotations

import os
import signal
import time

import torch.distributed as dist

from search_spaces.gpt2 import GPT2Template

FAULT_AFTER_CALLS = 6  # block-0 forwards before the fault: past the warm-up step


class _Faulty(GPT2Template):
    def fault(self) -> None:
        raise NotImplementedError

    def schedule(self, model, point, topology=None):
        sch = super().schedule(model, point, topology)
        calls = [0]

        def hook(*_):
            calls[0] += 1
            if dist.get_rank() == 1 and calls[0] == FAULT_AFTER_CALLS:
                self.fault()

        sch.mod.get_submodule(self.blocks).get_submodule("0").register_forward_pre_hook(hook)
        return sch


class Raises(_Faulty):
    def fault(self) -> None:
        raise RuntimeError("injected failure in block 0")


class Hangs(_Faulty):
    def fault(self) -> None:
        time.sleep(3600)


class KilledMidStep(_Faulty):
    def fault(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


_LEAKED: list = []
LEAKED_BYTES = 128 * 2**20


class LeaksMemoryAndThreads(GPT2Template):
    """Each rank keeps 128 MiB it never frees and starts a thread that never ends."""

    def schedule(self, model, point, topology=None):
        import threading

        import torch

        _LEAKED.append(torch.ones(LEAKED_BYTES // 4))  # touched, so resident
        threading.Thread(target=time.sleep, args=(3600,), daemon=False).start()
        return super().schedule(model, point, topology)
