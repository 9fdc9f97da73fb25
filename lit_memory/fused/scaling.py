"""fp16 dynamic loss scaling (torch's ``GradScaler``) inside the fused step: `LossScaling`, the scaler's view
for the framework (`ScalerView`), and GradScaler's unscaling (`unscale`)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.optim import Optimizer

from lit_memory.errors import UserError
from lit_memory.fused.messages import UNSCALED


def unscale(grads: list[torch.Tensor], inv_scale: torch.Tensor) -> None:
    """GradScaler's unscaling (its kernel, per device and dtype), in place; whether they overflowed was decided
    by the measuring backward."""
    kinds: dict[tuple, list[torch.Tensor]] = {}
    for grad in grads:
        if grad.numel():
            kinds.setdefault((grad.device, grad.dtype), []).append(grad)
    for (device, _), same in kinds.items():
        torch._amp_foreach_non_finite_check_and_unscale_(same, torch.zeros((), device=device), inv_scale.to(device))


class LossScaling:
    """fp16 dynamic loss scaling (torch's ``GradScaler``, as 16-mixed uses it) with the fused step, with the
    unfused step's results: each step either applies the same unscaled gradients (clipped after unscaling,
    as Lightning orders it) or is skipped exactly where GradScaler skips it, and the scale follows the same
    trajectory. `BucketHooks.backward` first runs a backward that only checks (LOMO's method; the pass clipping
    by norm measures in): each gradient is unscaled in place by GradScaler's own kernel, checked and freed; an
    overflow on any rank skips that optimizer's step; at the end of backward the scaler's own ``update`` takes
    the result (`update`). The steps, and their cost: docs/fused.md, "fp16 with loss scaling".

    ``view`` is the scaler the framework (Lightning's or Fabric's precision plugin, a plain loop) calls
    afterwards: its ``unscale_``/``step``/``update`` see that this backward already did their work.
    """

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler
        self.view = ScalerView(self)
        self.skipped: Optional[set[int]] = None  # the last fused backward's skipped optimizers, until update()

    @classmethod
    def of(cls, scaler: Any) -> Optional["LossScaling"]:
        """For a precision's ``scaler``: None without one (or a disabled one)."""
        if isinstance(scaler, ScalerView):
            scaler = scaler.scaling.scaler
        if scaler is None or not scaler.is_enabled():
            return None
        return cls(scaler)

    def inv_scale(self) -> torch.Tensor:
        """As GradScaler's ``unscale_`` computes it (the reciprocal in fp64)."""
        return self._scale().double().reciprocal().float()

    @property
    def scale_device(self) -> torch.device:
        return self._scale().device

    def _scale(self) -> torch.Tensor:
        scale = self.scaler._scale  # made by scaler.scale(loss), which every framework calls before backward
        if scale is None:
            raise UserError(UNSCALED)
        return scale

    def update(self, found_inf: torch.Tensor, skipped: set[int]) -> None:
        """The scale updated by the scaler's own rule, once this backward is over (the scaled loss's graph reads
        the scale: it changes only after the last backward through it); ``skipped``: the optimizers (by id)
        whose step GradScaler would skip."""
        found = found_inf.max() if found_inf.numel() else found_inf.new_zeros(())
        self.scaler._per_optimizer_states[id(self)]["found_inf_per_device"] = {found.device: found}
        self.scaler.update()
        self.skipped = skipped


class ScalerView:
    """The user's GradScaler as the framework sees it while the fused step scales: after a fused backward
    (which unscaled, stepped or skipped, and updated the scale) ``unscale_`` does nothing, ``step`` calls the
    optimizer's own step only if GradScaler would have (it finds no gradient left) and ``update`` nothing;
    without one (gradients set by hand) each is the scaler's own. Everything else is the scaler's (``scale``,
    ``get_scale``, ``state_dict``: checkpoints keep its format)."""

    def __init__(self, scaling: LossScaling) -> None:
        self.scaling = scaling

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scaling.scaler, name)

    def unscale_(self, optimizer: Optimizer) -> None:
        if self.scaling.skipped is None:
            self.scaling.scaler.unscale_(optimizer)

    def step(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any:
        skipped = self.scaling.skipped
        if skipped is None:
            return self.scaling.scaler.step(optimizer, *args, **kwargs)
        return None if id(optimizer) in skipped else optimizer.step(*args, **kwargs)

    def update(self, new_scale: Any = None) -> None:
        skipped, self.scaling.skipped = self.scaling.skipped, None
        if skipped is None or new_scale is not None:
            self.scaling.scaler.update(new_scale)
