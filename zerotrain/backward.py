"""A micro-step's backward pass: one life cycle for ``engine.backward(loss)`` and for the
PyTorch habit ``loss.backward()``.

[Note: loss.backward() without engine.backward]
A backward needs three things from the engine: the division by the accumulation steps, the fp16
loss scale on the loss before autograd starts (so that small gradients survive in float16), and
the reducer opened and closed around it: told that a backward starts (stages 0-1 reduce only in
the accumulation boundary's backward), then, once autograd is done, the epilogue that launches
what is left and waits for every reduction. ``engine.backward`` does all of it around its own
``(loss * loss_scale / accumulation_steps).backward()``. For ``loss.backward()`` the engine sees
only its forward's outputs, so it acts there, as DeepSpeed does since 0.18 (PR #7665):
* every forward under grad puts a hook on each output tensor that requires grad;
* the first such hook to fire in a backward that will accumulate into the model's parameters
  (a ``torch.autograd.grad`` for a gradient penalty does not) opens the reducer and queues its
  epilogue as autograd's final callback of that backward;
* the reducer multiplies each parameter's gradient by 1/accumulation steps as it takes it
  (``GradientReduction.begin_backward``). Scaling the parameters' gradients rather than the
  outputs' keeps every term of the loss divided exactly once: DeepSpeed divides each output's
  gradient, so a loss computed inside the model from another output (HuggingFace's ``loss``
  from ``logits``) is divided twice there, and a term that reads parameters without passing an
  output (a regulariser on ``engine.module``'s weights, a gradient penalty's double backward)
  not at all.
Backward is linear in the factor, so the model gets the same gradients as with
``engine.backward``; bit for bit when it is a power of two (accumulation steps 1, 2, 4, ...),
else within rounding. The fp16 loss scale cannot move to the parameters (it must act before
autograd, and with the same magnitude as in ``engine.backward`` for overflows to fall on the same
steps) and no output hook can apply it exactly once for every shape of loss, so under fp16 a
bare ``loss.backward()`` is refused at its first output hook, before any gradient exists, naming
``engine.backward(loss)`` and ``engine.scale(loss).backward()`` (as in DeepSpeed; ``scale``
applies both factors to the loss, and the backward it starts divides nothing). Inside
``engine.backward`` the hooks do nothing. Reentrant activation checkpointing reaches the
parameters only in a nested backward, started after the output hooks fired: the reducer opens
there, at the first parameter gradient, and closes with the outer backward.
A gradient that reaches the parameters while none of this engine's backwards is open is, during
another engine's backward (a GAN's generator loss through the discriminator's raw module), left
in ``.grad`` as torch leaves it: this engine's next backward reduces it with its own,
``zero_grad()`` drops it, ``step()`` refuses it unreduced. With no zerotrain backward running
(the loss came from ``engine.module(...)`` alone) it is refused. An engine without an optimizer
(a frozen critic) leaves every gradient in ``.grad``. ``step()`` refuses to update after an
accumulation whose boundary micro-step had no reduced backward.
"""

from __future__ import annotations

import contextlib
import enum
import time
from collections.abc import Callable, Iterator

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.autograd.graph import get_gradient_edge

from zerotrain.zero import ZeroOptimizer

# The zerotrain backwards running in this process, for gradients that reach one engine during
# another's backward: engine.backward calls in progress, and the autograd graph tasks of the
# loss.backward() calls that passed through an engine's outputs.
_managed_running: list[MicroStepBackward] = []
_direct_running: set[int] = set()


class BackwardState(enum.Enum):
    IDLE = "idle"
    MANAGED = "managed"  # inside engine.backward
    DIRECT = "direct"  # a loss.backward() that passed through the engine's outputs


class MicroStepBackward:
    """Opens and closes the reducer around each backward, however it was started (see the note
    above). ``accumulation_steps()`` gives the current divisor, ``loss_scaled()`` whether fp16
    loss scaling is on, ``at_boundary()`` whether the current micro-step ends an accumulation;
    ``on_finish(seconds)`` gets each backward's duration."""

    def __init__(
        self,
        optimizer: ZeroOptimizer,
        params: list[nn.Parameter],
        *,
        accumulation_steps: Callable[[], int],
        loss_scaled: Callable[[], bool],
        at_boundary: Callable[[], bool],
        on_finish: Callable[[float], None],
    ):
        self.optimizer = optimizer
        self.state = BackwardState.IDLE
        self.reduce = True  # False inside engine.no_sync(): no reduction even at the boundary
        # A backward of this accumulation reduced what step() needs: the boundary's at stages
        # 0-1 (the others only accumulate locally), any at stages 2-3. step() clears it.
        self.reduced = False
        self.user_scaled = False  # engine.scale(loss) was called for the next direct backward
        self._lazy_task = -1  # a backward through our outputs that did not reach parameters
        self._params = params
        self._accumulation_steps = accumulation_steps
        self._loss_scaled = loss_scaled
        self._at_boundary = at_boundary
        self._on_finish = on_finish
        self._direct_task = -1  # autograd graph task of the open direct backward
        self._started = 0.0
        self._at_boundary_now = False
        optimizer.on_stray_grad(self._on_stray_grad)

    # -- engine.backward -----------------------------------------------------------------------
    @contextlib.contextmanager
    def managed(self) -> Iterator[None]:
        """Around ``engine.backward``'s own ``backward()`` call."""
        if self.state is BackwardState.DIRECT:
            if torch._C._current_graph_task_id() != -1:
                raise RuntimeError(
                    "engine.backward was called during a loss.backward() that runs through "
                    "this engine's outputs; use one of the two per loss"
                )
            self.abort()  # that loss.backward() raised before its end
        self.user_scaled = False
        self._open(BackwardState.MANAGED)
        _managed_running.append(self)
        try:
            yield
        except BaseException:
            self.abort()
            raise
        finally:
            _managed_running.remove(self)
        self._close()

    def outside_autograd(self, run: Callable[[], None], params: list[nn.Parameter]) -> None:
        """A backward that assigns ``params``' ``.grad`` rather than accumulating it (a
        pipeline's weight-gradient step: [Note: the weight-gradient step] in comm/pipeline.py),
        opened as ``loss.backward()`` opens one: the gradients are taken after ``run``."""
        factor = 1.0 if self.user_scaled else 1.0 / self._accumulation_steps()
        self.user_scaled = False
        self._open(BackwardState.MANAGED, grad_factor=factor)
        _managed_running.append(self)
        try:
            run()
            self.optimizer.take_assigned_grads(params)
        except BaseException:
            self.abort()
            raise
        finally:
            _managed_running.remove(self)
        self._close()

    def abort(self) -> None:
        """Forget a backward that raised part-way: its accumulation's gradients are dropped, and
        the next backward starts clean (catching an out-of-memory error and moving on to the
        next batch works)."""
        self.optimizer.abort_backward()
        self._to_idle()

    # -- loss.backward() -----------------------------------------------------------------------
    def watch(self, output) -> None:
        """Hook the tensors of a training forward's ``output`` (any nesting of tuples, lists,
        dicts and registered pytree nodes such as HuggingFace's ModelOutput)."""
        if not self.optimizer.trains:  # an engine for evaluation: its gradients are plain
            return
        for tensor in pytree.tree_leaves(output):
            # not a leaf (a parameter returned as it is): a leaf's hooks would pile up
            if torch.is_tensor(tensor) and tensor.grad_fn is not None:
                tensor.register_hook(self._on_output_grad)

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        if self.state is BackwardState.MANAGED:
            return
        task = torch._C._current_graph_task_id()
        if self.state is BackwardState.DIRECT and task == self._direct_task:
            return  # opened by an earlier output of this backward
        if not self._accumulates_into_params():
            # autograd.grad / backward(inputs=...) that leaves parameters alone, or one whose
            # parameters are reached only by a nested backward (reentrant checkpointing)
            if self._lazy_task != task:
                self._lazy_task = task
                torch.autograd.Variable._execution_engine.queue_callback(self._end_lazy)
            return
        self._open_direct(task)

    def _open_direct(self, task: int) -> None:
        if self._loss_scaled() and not self.user_scaled:
            raise RuntimeError(
                "loss.backward() under fp16 loss scaling: the loss scale must multiply the loss "
                "before autograd runs. Call engine.backward(loss), or "
                "engine.scale(loss).backward(); nothing was reduced or stepped"
            )
        # engine.scale put both factors on the loss already
        factor = 1.0 if self.user_scaled else 1.0 / self._accumulation_steps()
        self.user_scaled = False
        if self.state is BackwardState.DIRECT:  # an earlier one raised before its end
            self.abort()
        self._open(BackwardState.DIRECT, grad_factor=factor)
        self._direct_task = task
        _direct_running.add(task)
        if task == self._lazy_task:  # opened from a nested backward: close with the outer one
            return
        torch.autograd.Variable._execution_engine.queue_callback(self._close)

    def _end_lazy(self) -> None:
        """The end of a backward that passed our outputs without reaching parameters at once:
        close what a nested backward opened in it."""
        if self.state is BackwardState.DIRECT and self._direct_task == self._lazy_task:
            self._close()
        self._lazy_task = -1

    def _on_stray_grad(self, name: str) -> None:
        """A gradient reached this engine's parameters while none of its backwards is open.
        During another engine's backward (a GAN's generator loss runs through the
        discriminator) it is an ordinary gradient, left in ``.grad`` as torch leaves it: the
        user's ``zero_grad`` drops it, or this engine's next backward adds to it and reduces
        the sum. With no zerotrain backward running, the loss bypassed every engine: refuse."""
        if self._lazy_task != -1:  # a nested backward of one through our outputs
            if not self.optimizer.every_backward and self._accumulation_steps() > 1:
                # this gradient is in the accumulating buffer already: too late to divide it
                raise RuntimeError(
                    "loss.backward() with reentrant activation checkpointing around every "
                    "trainable parameter, at ZeRO stage 0-1 with gradient accumulation: call "
                    "engine.backward(loss), or checkpoint with use_reentrant=False"
                )
            self._open_direct(self._lazy_task)
            return
        if not self.optimizer.trains:
            return  # an engine for evaluation: its gradients are plain .grad
        if _managed_running or torch._C._current_graph_task_id() in _direct_running:
            return
        raise RuntimeError(
            f"gradient of '{name}' computed outside a backward the engine saw: the loss did not "
            "come from engine(...)'s outputs (engine.module(...) bypasses gradient averaging). "
            "Compute the loss from engine(...), then call engine.backward(loss) or "
            "loss.backward()."
        )

    def _accumulates_into_params(self) -> bool:
        """Whether the running backward will write ``.grad`` of any trainable parameter. The
        nodes are looked up now, not kept: stage 3 changes parameter shapes between uses, and
        a kept node would keep its old shape."""
        return any(
            torch._C._will_engine_execute_node(get_gradient_edge(p).node) for p in self._params
        )

    # -- both ----------------------------------------------------------------------------------
    def _open(self, state: BackwardState, grad_factor: float = 1.0) -> None:
        self._started = time.perf_counter()
        self._at_boundary_now = self.reduce and self._at_boundary()
        self.optimizer.backward_prologue(self._at_boundary_now, grad_factor)
        self.state = state  # only once the prologue succeeded

    def _close(self) -> None:
        self.optimizer.backward_epilogue(self._at_boundary_now)
        if self._at_boundary_now or self.optimizer.every_backward:
            self.reduced = True
        self._to_idle()
        self._on_finish(time.perf_counter() - self._started)

    def _to_idle(self) -> None:
        _direct_running.discard(self._direct_task)
        self._direct_task = -1
        self.state = BackwardState.IDLE
