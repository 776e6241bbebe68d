"""Peak tensor memory of one training step, measured at the level of tensors.

The same figure as ``torch.distributed._tools.mem_tracker.MemTracker`` (every live storage
counted once, FSDP's in-place storage resizes followed), computed at constant cost per
operation, and without MemTracker's refusal of a root module called once per micro-batch.
Used alike on fake tensors (exact mode) and on real ones (measured ground truth).
"""

from __future__ import annotations

import contextlib
import threading

import torch

from ..memory import MemoryBreakdown


def tracked_step(session, batch) -> MemoryBreakdown:
    """Peak tensor memory of one training step of a :class:`~slapo_tune.session.Session` whose
    optimizer state already exists (call after a first, untracked step)."""
    tracker = PeakTracker()
    tracker.track(session.stage, session.optimizer)
    for master in session.step.masters():  # the optimizer's parameters, where they are not the stage's
        tracker._add(master, "optimizer")
    for buffer in session.step.held_buffers():  # receive buffers a pipeline kept between steps (ours: none)
        tracker._add(buffer, "activations")
    with tracker:
        session.train_step(batch)
    return tracker.breakdown()


@contextlib.contextmanager
def fake_friendly_optimizers():
    """Let Adam/AdamW step on fake tensors: their bias corrections read the step count as a Python
    number, which a fake tensor cannot provide; any value gives the same memory."""
    import torch.optim.adam as adam
    from torch._subclasses.fake_tensor import FakeTensor

    original = adam._get_value

    def value(x):
        return 1.0 if isinstance(x, FakeTensor) else original(x)

    adam._get_value = value
    try:
        yield
    finally:
        adam._get_value = original


class PeakTracker:
    """Tensor-level peak of a step, at constant cost per operation.

    Counts the bytes of every live storage (a storage shared by views counts once), the way
    ``MemTracker`` does, but keeps a running total updated by weak-reference callbacks instead of
    re-summing all tensors after every operation, which makes long steps (many micro-batches)
    affordable. Categories: parameters and buffers, optimizer state, activations (allocated in
    forward) and backward (gradients and backward temporaries), taken at the moment of the peak.
    """

    CATEGORIES = ("parameters", "optimizer", "activations", "backward")

    def __init__(self):
        self.current = dict.fromkeys(self.CATEGORIES, 0)
        self.total = 0
        self.peak = 0
        self.at_peak = dict(self.current)
        self.most = dict(self.current)  # each category's largest total over the step
        self._live: dict[int, tuple[object, int, str]] = {}
        # a collective's buffer can die in the backend's thread (gloo lets go of it when its work
        # completes): its weak-reference callback runs there, so the running totals are updated
        # under a lock (a lost update would leave the total high for the rest of the step)
        self._lock = threading.RLock()
        self._in_optimizer = False
        self._mode = None
        self._hooks = []

    def _add(self, tensor: torch.Tensor, category: str) -> None:
        import weakref

        from torch.utils._python_dispatch import is_traceable_wrapper_subclass

        if is_traceable_wrapper_subclass(tensor):  # DTensor (FSDP): count its local tensor(s)
            for attr in tensor.__tensor_flatten__()[0]:
                inner = getattr(tensor, attr)
                if isinstance(inner, torch.Tensor):
                    self._add(inner, category)
            return
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._live:
            return
        nbytes = storage.nbytes()

        def gone(_, key=key):
            with self._lock:
                entry = self._live.pop(key, None)
                if entry is not None:
                    self.current[entry[2]] -= entry[1]
                    self.total -= entry[1]

        with self._lock:
            self._live[key] = (weakref.ref(storage, gone), nbytes, category)
            self._grow(category, nbytes)

    def _grow(self, category: str, nbytes: int) -> None:
        with self._lock:
            self.current[category] += nbytes
            self.total += nbytes
            if self.total > self.peak:
                self.peak = self.total
                self.at_peak = dict(self.current)
            if self.current[category] > self.most[category]:
                self.most[category] = self.current[category]

    def _resized(self, storage, new_nbytes: int) -> None:
        """FSDP frees and refills unsharded parameters by resizing their storage in place."""
        with self._lock:
            entry = self._live.get(id(storage))
            if entry is None:
                return
            ref, old, category = entry
            self._live[id(storage)] = (ref, new_nbytes, category)
            self._grow(category, new_nbytes - old)

    def track(self, module: torch.nn.Module, optimizer=None) -> None:
        """Count what already exists: parameters, buffers, gradients and optimizer state."""
        for t in list(module.parameters()) + list(module.buffers()):
            self._add(t, "parameters")
            if isinstance(t, torch.nn.Parameter) and t.grad is not None:
                self._add(t.grad, "backward")
        if optimizer is not None:
            for state in optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        self._add(value, "optimizer")

    def _category(self) -> str:
        if self._in_optimizer:
            return "optimizer"
        return "backward" if torch._C._current_autograd_node() is not None else "activations"

    def __enter__(self) -> PeakTracker:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                category = tracker._category()
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor) and t.device.type != "meta":
                        tracker._add(t, category)
                return out

        def pre(*_):
            tracker._in_optimizer = True

        def post(*_):
            tracker._in_optimizer = False

        original_resize = torch.UntypedStorage.resize_

        def resize_(storage, size):
            out = original_resize(storage, size)
            tracker._resized(storage, storage.nbytes())
            return out

        self._original_resize = original_resize
        torch.UntypedStorage.resize_ = resize_
        self._hooks = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        torch.UntypedStorage.resize_ = self._original_resize
        for h in self._hooks:
            h.remove()

    def breakdown(self) -> MemoryBreakdown:
        at = self.at_peak
        return MemoryBreakdown(total=self.peak, parameters=at["parameters"], optimizer=at["optimizer"],
                               activations=at["activations"], gradients=at["backward"],
                               most_activations=self.most["activations"])
