"""The configs the planner weighs: each a ZeRO stage, an offload device, activation
checkpointing on or off and a micro-batch, over the launch's data-parallel ranks; the keys a
user fixed in ``--config`` hold in every one."""

from __future__ import annotations

import copy
from dataclasses import dataclass

__all__ = ["Candidate", "enumerate_candidates"]

OFFLOADS = (None, "cpu", "nvme")


@dataclass(frozen=True)
class Candidate:
    """One config: ``micro_batch`` samples per rank and ``accumulation`` micro-batches per
    optimizer step, over ``world`` data-parallel ranks."""

    stage: int
    offload: str | None
    activation_checkpointing: bool
    micro_batch: int
    accumulation: int
    world: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulation * self.world

    def label(self) -> str:
        parts = [f"stage {self.stage}"]
        if self.offload:
            parts.append(f"offload {self.offload}")
        if self.activation_checkpointing:
            parts.append("checkpointing")
        parts.append(f"micro-batch {self.micro_batch} x {self.accumulation}")
        return ", ".join(parts)

    def config(self, base: dict, nvme_path: str | None = None) -> dict:
        """The ds_config: ``base`` (the user's, kept) with this candidate's keys."""
        out = copy.deepcopy(base)
        # the cost model prices Adam's state: a base without an optimizer gets DeepSpeed's
        # usual one (a script that passes its own optimizer to initialize overrides it)
        out.setdefault("optimizer", {"type": "AdamW", "params": {"lr": 1e-3}})
        out["train_micro_batch_size_per_gpu"] = self.micro_batch
        out["gradient_accumulation_steps"] = self.accumulation
        out["train_batch_size"] = self.global_batch
        zero = out.setdefault("zero_optimization", {})
        zero["stage"] = self.stage
        if self.offload:
            section = zero.setdefault("offload_optimizer", {})
            section["device"] = self.offload
            if self.offload == "nvme":
                section.setdefault("nvme_path", nvme_path or "/tmp/zerotrain-nvme")
        else:
            zero.pop("offload_optimizer", None)
        if self.activation_checkpointing:
            out.setdefault("activation_checkpointing", {})
        else:
            out.pop("activation_checkpointing", None)
        return out


def _fixed(base: dict) -> dict:
    """What ``base`` (the user's --config) fixes, by candidate field."""
    zero = base.get("zero_optimization", {})
    fixed: dict = {}
    if "stage" in zero:
        fixed["stage"] = int(zero["stage"])
    offload = zero.get("offload_optimizer", {}).get("device")
    if offload is not None:
        fixed["offload"] = None if offload == "none" else offload
    micro = base.get("train_micro_batch_size_per_gpu")
    if isinstance(micro, int):
        fixed["micro_batch"] = micro
    if "activation_checkpointing" in base:
        fixed["activation_checkpointing"] = True
    return fixed


def enumerate_candidates(
    *, world: int, global_batch: int, base: dict, nvme: bool
) -> list[Candidate]:
    """Every candidate over ``world`` ranks that trains ``global_batch`` samples a step:
    stages 0-3, offload none / cpu / nvme (``nvme``: a path is given; offload needs stage
    1-3), checkpointing off / on, and every micro-batch that divides the batch per rank;
    what ``base`` fixes is held."""
    if global_batch % world:
        raise ValueError(
            f"--global-batch {global_batch} is not a multiple of the {world} data-parallel ranks"
        )
    per_rank = global_batch // world
    fixed = _fixed(base)
    micro_batches = [m for m in range(1, per_rank + 1) if per_rank % m == 0]
    out = []
    for stage in (0, 1, 2, 3):
        for offload in OFFLOADS:
            if offload and stage == 0 or offload == "nvme" and not nvme:
                continue
            for checkpointing in (False, True):
                for micro in micro_batches:
                    candidate = Candidate(
                        stage, offload, checkpointing, micro, per_rank // micro, world
                    )
                    if all(getattr(candidate, key) == value for key, value in fixed.items()):
                        out.append(candidate)
    return out
