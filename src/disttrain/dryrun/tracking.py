"""The memory trackers of the dry run: torch's `MemTracker`/`FSDPMemTracker`, taught what a training step
of this framework does that they do not expect (a pipeline stage's many forwards, DDP's buckets, FSDP2's
accumulated gradients, several FSDP roots per rank). Used on fake and on real tensors alike."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed._tools.mod_tracker import ModTracker

from disttrain.train.phases import PhaseEvent, Subscriber


class TrackerPhases(Subscriber):
    """The trackers follow the engine's phases. A pipeline stage runs its root module once per micro-batch
    before any backward; the trackers take a second root forward for a new iteration and refuse it unless
    that module's statistics are dropped first (the peak is kept). After each backward the gradients FSDP2
    accumulates are filed as gradients; between a whole model's micro-batches the per-module statistics are
    cleared too."""

    def __init__(self, tracker, model):
        self.tracker, self.model = tracker, model

    def enter(self, event: PhaseEvent) -> None:
        if event.name == "forward" and event.module is not None:  # a pipeline chunk
            self.tracker.memory_tracking.pop(event.module, None)

    def exit(self, event: PhaseEvent) -> None:
        if event.name != "backward":
            return
        if event.module is not None:
            file_grads(self.tracker, event.module)
        elif event.depth == 0:
            self.tracker.reset_mod_stats()
            file_grads(self.tracker, self.model)


def file_grads(tracker, model) -> None:
    """The unsharded gradients FSDP2 accumulates between micro-batches are gradients (created in
    backward, the tracker first called them temporaries)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType

    if isinstance(tracker, FSDPMemTracker):
        from disttrain.observe.model_bytes import unsharded_grads

        for grad in unsharded_grads(model):
            tracker._update_and_maybe_create_winfos(grad, _FSDPRefType.UNSHARDED_GRAD)


class DDPBuckets:
    """DDP's bucket all-reduce as a comm hook (the fake group's futures carry no tensor; DDP needs one
    back) that also files each bucket under gradients: the tracker first sees a bucket's storage
    inside backward and would call it a temporary, but gradients are views into it for the whole run.
    On fake tensors the reducer's per-parameter views into the bucket (made in C++ at wrap time) do not
    share the bucket's storage object, so the tracker would count a second bucket-sized temporary that a
    real run does not have: `phantom` names it (tests/test_dryrun.py compares with real tensors)."""

    def __init__(self):
        self.tracker = None  # set once the step runs under a tracker
        self.sizes: set[int] = set()  # bytes of each bucket
        self.storages: set[int] = set()  # the buckets' own storages
        self.stand_ins: dict[int, list[torch.Tensor]] = {}  # bytes -> stand-ins for buckets not yet seen

    def stand_in(self, reducer) -> None:
        """DDP allocates its buckets when it wraps the model, outside any op the tracker sees: until the first
        gradient is copied into a bucket (the second micro-batch of the first step, after no_sync's first), a
        tracker would not count it, while autograd's fresh gradients already exist beside it on a GPU. Count
        a zero copy of each bucket (made in the active tensor mode) as gradients until the bucket itself appears."""
        from torch.distributed._tools.mem_tracker import _MemRefType

        for bucket in reducer._get_zeros_like_grad_buckets():
            buffer = bucket.buffer()
            self.stand_ins.setdefault(buffer.untyped_storage().nbytes(), []).append(buffer)
            self.tracker._update_and_maybe_create_winfos(buffer, _MemRefType.GRAD)

    def adopt(self, t: torch.Tensor) -> bool:
        """`t` is written by a copy into storage the tracker has not seen: if that is a bucket's size, it is the
        bucket, and its stand-in goes (True)."""
        st = t.untyped_storage()
        waiting = self.stand_ins.get(st.nbytes())
        if not waiting or st._cdata in self.storages or st in self.tracker._WINFO:
            return False
        waiting.pop()
        return True

    def all_reduce(self, group, bucket):
        from torch.distributed._tools.mem_tracker import _MemRefType

        buffer = bucket.buffer()
        dist.all_reduce(buffer, group=group)
        if self.tracker is not None:
            self.tracker._update_and_maybe_create_winfos(buffer, _MemRefType.GRAD)
            self.sizes.add(buffer.untyped_storage().nbytes())
            self.storages.add(buffer.untyped_storage()._cdata)
        done = torch.futures.Future()
        done.set_result(buffer)
        return done

    def phantom(self, t: torch.Tensor) -> bool:
        from torch._subclasses.fake_tensor import is_fake

        if not self.storages or not is_fake(t):
            return False
        st = t.untyped_storage()
        return st.nbytes() in self.sizes and st._cdata not in self.storages


class Tracker(MemTracker):
    """torch's MemTracker, blind to the fake-only copies of DDP buckets and counting the buckets from the start
    (see `DDPBuckets`)."""

    def __init__(self, buckets: DDPBuckets):
        super().__init__()
        self._buckets = buckets
        self._op = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._op = func
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _track(self, reftype, t: torch.Tensor) -> None:
        from torch.distributed._tools.mem_tracker import _MemRefType

        if self._buckets.phantom(t):
            return
        if self._op is torch.ops.aten.copy_.default and self._buckets.adopt(t):
            reftype = _MemRefType.GRAD
        super()._track(reftype, t)

    def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
        """A frozen module's parameters (a reference or teacher model's) get no gradient hook: torch refuses one on
        a tensor that needs no gradient, and none ever comes."""
        frozen = not all(p.requires_grad for p in module.parameters())
        return super()._track_module_params_and_buffers(module, install_grad_hooks and not frozen)


class LeafInputsSafe(ModTracker):
    """torch's ModTracker for pipeline stages, with two changes.

    - No backward hooks on a module's leaf inputs (a pipeline stage's received activations): autograd
      refuses them inside `autograd.grad`, which zero-bubble schedules use to split input from weight
      gradients. Those modules leave the tracked hierarchy at the end of backward instead, as modules
      without differentiable inputs do.
    - The gradient hooks it puts on each module's inputs and outputs are removed once that micro-batch's
      weight-gradient pass is done. Each hook holds the autograd nodes it waits on, and sits on one of
      them: a cycle through C++ that nothing collects. A plain backward frees the saved tensors as it
      goes, so the cycle costs nothing; zero-bubble's input-gradient pass retains the graph, and the parts
      of it the weight pass does not run (attention, rotary, the norms' input paths) would otherwise stay
      for the rest of the run: measured on `tiny`, a tracked zero-bubble step kept them, an untracked one
      freed them (the tracker alone made the dry run, and real runs measured with it, report up to twice
      the memory)."""

    def __init__(self):
        super().__init__()
        self._collecting: list | None = None
        self._per_chunk: dict[tuple[int, int], list] = {}
        self._saved = None

    def _fw_pre_hook(self, mod, input):
        detached = tuple(a.detach() if isinstance(a, torch.Tensor) and a.is_leaf and a.requires_grad else a
                         for a in (input if isinstance(input, tuple) else (input,)))
        return super()._fw_pre_hook(mod, detached)

    def watch(self, stages) -> None:
        """Collect the hooks each stage's forward of a micro-batch registers; remove them after its weight pass."""
        for stage in stages:
            forward, weight = stage.forward_one_chunk, stage.backward_weight_one_chunk

            def forward_one_chunk(fwd_chunk_id, *args, _stage=stage, _forward=forward, **kwargs):
                self._collecting = self._per_chunk.setdefault((_stage.stage_index, fwd_chunk_id), [])
                try:
                    return _forward(fwd_chunk_id, *args, **kwargs)
                finally:
                    self._collecting = None

            def backward_weight_one_chunk(bwd_chunk_id, *args, _stage=stage, _weight=weight, **kwargs):
                out = _weight(bwd_chunk_id, *args, **kwargs)
                for handle in self._per_chunk.pop((_stage.stage_index, bwd_chunk_id), []):
                    handle.remove()
                return out

            stage.forward_one_chunk, stage.backward_weight_one_chunk = forward_one_chunk, backward_weight_one_chunk

    def __enter__(self):
        from torch.distributed._tools import mod_tracker

        register = self._saved = mod_tracker.register_multi_grad_hook

        def collected(*args, **kwargs):
            handle = register(*args, **kwargs)
            if self._collecting is not None:
                self._collecting.append(handle)
            return handle

        mod_tracker.register_multi_grad_hook = collected
        return super().__enter__()

    def __exit__(self, *args):
        from torch.distributed._tools import mod_tracker

        mod_tracker.register_multi_grad_hook = self._saved
        self._per_chunk.clear()
        return super().__exit__(*args)


class StagesTracker(FSDPMemTracker):
    """torch's FSDPMemTracker over several FSDP roots (this rank's pipeline stages): it only walks the
    module tree below its root, which it otherwise insists is one FSDP module."""

    def __init__(self, stages: nn.Module, optimizer):
        from torch.utils.weak import WeakIdKeyDictionary
        from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType, _FSDPState

        MemTracker.__init__(self)
        self._root_mod, self._optm = stages, optimizer
        self._fsdp_mod_to_saved_methods = WeakIdKeyDictionary()
        self._fsdp_state = _FSDPState.PRE_FW
        self._ref_class = _FSDPRefType
        self._accumulating = False

    def _fsdp_param_group_post_backward(self, fsdp_mod, orig_fsdp_param_group_post_backward):
        """With gradient sync off between micro-batches, FSDP2's post-backward moves each unsharded gradient
        into an accumulator in the reduce dtype (fp32 under bf16 parameters), allocated there: file it as the
        unsharded gradient it is from its allocation on, not as a temporary until the backward ends (a 1F1B
        stage's first backward, with every micro-batch's activations, ends holding all of them)."""
        group = fsdp_mod._get_fsdp_state()._fsdp_param_group

        def post_backward(*args, **kwargs):
            self._accumulating = group is not None and not group.reduce_grads
            try:
                return orig_fsdp_param_group_post_backward(*args, **kwargs)
            finally:
                self._accumulating = False

        return super()._fsdp_param_group_post_backward(fsdp_mod, post_backward)

    def _track(self, reftype, t: torch.Tensor) -> None:
        from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType

        if self._accumulating and reftype in (_FSDPRefType.TEMP, _FSDPRefType.ACT):  # the only allocation there
            reftype = _FSDPRefType.UNSHARDED_GRAD
        super()._track(reftype, t)


class KeepBuckets:
    """DDP's reducer, except that it keeps its first bucket order: rebuilding copies gradient storage,
    which fake tensors do not have (same bucket sizes, so the same bytes)."""

    def __init__(self, reducer):
        self._reducer = reducer

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name):
        return getattr(self._reducer, name)
