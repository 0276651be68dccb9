"""The optimizers a DeepSpeed ``optimizer`` section can name, and how each is built.

``OPTIMIZERS`` is the one list: the config accepts the names and ``params`` keys written here
(zerotrain.config.params), and ``build_optimizer`` builds from the same entries. Adam and AdamW
are :class:`FusedAdam` (DeepSpeed's class, also ``zerotrain.ops.adam``) where torch's fused
kernel runs, which FusedAdam steps with (it runs on CPU at the speed of DeepSpeed's C++
CPU-Adam), and without bias correction; otherwise (``torch_adam``, ``amsgrad``, ``fused:
false``, ``foreach``, tensors the kernel does not take) torch's own Adam/AdamW. SGD is torch's;
Lamb is :class:`Lamb`, which also computes per-parameter trust ratios on ZeRO shards.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from zerotrain.optim.adagrad import Adagrad
from zerotrain.optim.adam import FusedAdam
from zerotrain.optim.lamb import Lamb
from zerotrain.optim.lion import Lion
from zerotrain.optim.muon import Muon
from zerotrain.optim.onebit import OneBitAdam, ZeroOneAdam

__all__ = [
    "DEEPSPEED_ONLY_OPTIMIZERS",
    "OPTIMIZERS",
    "PARAM_ALIASES",
    "REFUSED_PARAMS",
    "OptimizerSpec",
    "build_optimizer",
    "find_optimizer",
]

NormAllreduce = Callable[[Tensor], None]
Builder = Callable[
    [dict[str, Any], list[dict[str, Any]], NormAllreduce | None], torch.optim.Optimizer
]


@dataclass(frozen=True)
class OptimizerSpec:
    """One ``optimizer.type`` zerotrain builds."""

    name: str
    """DeepSpeed's spelling of the type (any capitalisation is read as it, as DeepSpeed
    lower-cases the names it knows)."""
    params: tuple[str, ...]
    """The ``optimizer.params`` keys it takes: DeepSpeed's constructor arguments for the type
    (FusedAdam plus the engine's adam_w_mode/torch_adam, torch's SGD, FusedLamb) and torch's
    kernel switches ``fused``/``foreach``."""
    build: Builder
    """``build(params, param_groups, norm_allreduce)``: the optimizer over ``param_groups``."""
    doc: str
    """What the type builds (docs/config.md shows it)."""


def _build_adam(
    options: dict[str, Any],
    param_groups: list[dict[str, Any]],
    norm_allreduce: NormAllreduce | None,
    *,
    always_decoupled: bool,
) -> torch.optim.Optimizer:
    adam_w_mode = bool(options.pop("adam_w_mode", True))
    decoupled = always_decoupled or adam_w_mode  # DeepSpeed: "AdamW" forces decoupled decay
    torch_adam = bool(options.pop("torch_adam", False))
    # torch's optimizers always return None gradients after zero_grad(); nothing to choose.
    options.pop("set_grad_none", None)
    bias_correction = options.pop("bias_correction", True)
    fused, foreach = _kernel_choice(options, _tensors(param_groups), default_auto=not torch_adam)
    options.setdefault("lr", 1e-3)
    options.setdefault("betas", (0.9, 0.999))
    options.setdefault("eps", 1e-8)
    if not torch_adam:
        options.setdefault("weight_decay", 0.0)  # FusedAdam's default; torch AdamW's is 0.01
    if not bias_correction:  # torch has no kernel for it: DeepSpeed's FusedAdam update
        if options.pop("amsgrad", False):
            raise ValueError(
                "optimizer.params.amsgrad: not supported together with bias_correction false"
            )
        return FusedAdam(param_groups, **options, bias_correction=False, adam_w_mode=decoupled)
    if fused and not torch_adam and not options.get("amsgrad"):
        # DeepSpeed's class, which client code checks with isinstance; its step is torch's
        # fused kernel, so the update is torch.optim.AdamW(fused=True)'s bit for bit
        return FusedAdam(param_groups, **options, adam_w_mode=decoupled)
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    return cls(param_groups, **options, fused=fused, foreach=foreach)


def _build_fusable(
    cls: Callable[..., torch.optim.Optimizer],
    options: dict[str, Any],
    param_groups: list[dict[str, Any]],
    norm_allreduce: NormAllreduce | None,
) -> torch.optim.Optimizer:
    """One of torch's optimizers with a fused kernel (SGD, Adagrad), chosen as Adam's is."""
    fused, foreach = _kernel_choice(options, _tensors(param_groups), default_auto=True)
    return cls(param_groups, **options, fused=fused, foreach=foreach)


def _build_plain(
    cls: type[torch.optim.Optimizer],
    options: dict[str, Any],
    param_groups: list[dict[str, Any]],
    norm_allreduce: NormAllreduce | None,
) -> torch.optim.Optimizer:
    return cls(param_groups, **options)


def _build_lamb(
    options: dict[str, Any],
    param_groups: list[dict[str, Any]],
    norm_allreduce: NormAllreduce | None,
) -> torch.optim.Optimizer:
    return Lamb(param_groups, **options, norm_allreduce=norm_allreduce)


_ADAM_PARAMS = (
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "amsgrad",
    "torch_adam",
    "fused",
    "adam_w_mode",
    "bias_correction",
    "foreach",
    "set_grad_none",
)

OPTIMIZERS: dict[str, OptimizerSpec] = {
    spec.name: spec
    for spec in (
        OptimizerSpec(
            "Adam",
            _ADAM_PARAMS,
            partial(_build_adam, always_decoupled=False),
            "DeepSpeed's Adam, built as its FusedAdam (zerotrain.ops.adam.FusedAdam, stepping "
            "with torch's fused kernel; torch.optim.Adam/AdamW with `torch_adam`, `amsgrad`, "
            "`fused: false` or `foreach`): `adam_w_mode` (default true) selects decoupled "
            "weight decay (AdamW), false L2 regularisation (Adam); `bias_correction: false` "
            "steps without bias correction.",
        ),
        OptimizerSpec(
            "AdamW",
            _ADAM_PARAMS,
            partial(_build_adam, always_decoupled=True),
            "As Adam, with decoupled weight decay whatever `adam_w_mode` says, as in DeepSpeed.",
        ),
        OptimizerSpec(
            "SGD",
            ("lr", "momentum", "dampening", "weight_decay", "nesterov", "fused", "foreach"),
            partial(_build_fusable, torch.optim.SGD),
            "torch.optim.SGD.",
        ),
        OptimizerSpec(
            "Lamb",
            (
                "lr",
                "betas",
                "eps",
                "weight_decay",
                "max_coeff",
                "min_coeff",
                "bias_correction",
                "eps_inside_sqrt",
                "amsgrad",
            ),
            _build_lamb,
            "DeepSpeed's FusedLamb (arXiv:1904.00962).",
        ),
        OptimizerSpec(
            "Lion",
            ("lr", "betas", "weight_decay"),
            partial(_build_plain, Lion),
            "Lion (arXiv:2302.06675), DeepSpeed's FusedLion: the sign of an interpolated "
            "momentum, decoupled weight decay; one state per element (`exp_avg`). Defaults lr "
            "1e-3, betas [0.9, 0.999], weight_decay 0.",
        ),
        OptimizerSpec(
            "Adagrad",
            (
                "lr",
                "eps",
                "weight_decay",
                "lr_decay",
                "initial_accumulator_value",
                "fused",
                "foreach",
            ),
            partial(_build_fusable, Adagrad),
            "torch.optim.Adagrad's update (its fused kernel where the tensors allow it), weight "
            "decay as L2 on the gradient; DeepSpeed's DeepSpeedCPUAdagrad defaults lr 1e-2, eps "
            "1e-10.",
        ),
        OptimizerSpec(
            "Muon",
            (
                "lr",
                "muon_lr",
                "adam_lr",
                "momentum",
                "nesterov",
                "betas",
                "eps",
                "weight_decay",
                "ns_steps",
                "ns_coefficients",
                "ns_dtype",
                "ns_eps",
                "adjust_lr_fn",
            ),
            partial(_build_plain, Muon),
            "Muon (Newton-Schulz orthogonalised momentum, torch.optim.Muon's update) for the 2-D "
            "hidden weights, AdamW for the rest, as DeepSpeed's: a parameter is Muon's when its "
            "real shape is 2-D and its name contains neither `embed` nor `lm_head`, unless it "
            "has a `use_muon` attribute. `muon_lr` / `adam_lr` override `lr` (default 1e-3) for "
            "each half; `momentum` 0.95 with `nesterov`; `betas` [0.9, 0.999] and `eps` 1e-8 "
            "are AdamW's; `weight_decay` (default 0) is decoupled in both. Newton-Schulz runs "
            '`ns_steps` 5 iterations in fp32 (`ns_dtype: "bf16"` as torch does); '
            '`adjust_lr_fn` "original" scales by sqrt(max(1, rows/cols)), '
            '"match_rms_adamw" by Moonlight\'s 0.2 sqrt(max(rows, cols)). On ZeRO shards each '
            "matrix is orthogonalised by one rank (docs/precision-and-optimizers.md).",
        ),
        OptimizerSpec(
            "OneBitAdam",
            (
                "lr",
                "freeze_step",
                "betas",
                "eps",
                "weight_decay",
                "eps_inside_sqrt",
                "bias_correction",
                "amsgrad",
                "cuda_aware",
                "comm_backend_name",
            ),
            partial(_build_plain, OneBitAdam),
            "1-bit Adam (arXiv:2102.02888), DeepSpeed's update: Adam for `freeze_step` steps, "
            "then the variance frozen and the gradients sent as signs with error feedback, at "
            "ZeRO stages 0-2 (docs/compression.md).",
        ),
        OptimizerSpec(
            "ZeroOneAdam",
            (
                "lr",
                "bias_correction",
                "betas",
                "eps",
                "eps_inside_sqrt",
                "weight_decay",
                "var_freeze_step",
                "var_update_scaler",
                "local_step_scaler",
                "local_step_clipper",
                "amsgrad",
                "cuda_aware",
                "comm_backend_name",
            ),
            partial(_build_plain, ZeroOneAdam),
            "0/1 Adam (arXiv:2202.06009), DeepSpeed's update: the variance updated with exactly "
            "averaged gradients every 1, 2, 4, ... steps (the interval doubling after "
            "`var_update_scaler` updates) until `var_freeze_step`, every other step's gradients "
            "sent as signs with error feedback, at ZeRO stages 0-2. At stage 0, "
            "`local_step_clipper` above 1 (zerotrain's default is 1, DeepSpeed's 16) turns on "
            "its local steps after the freeze: synchronizations every 1, 2, 4, ... up to "
            "`local_step_clipper` steps, doubling every `local_step_scaler` "
            "(docs/compression.md).",
        ),
    )
}
"""The optimizers zerotrain builds, by DeepSpeed's name."""

DEEPSPEED_ONLY_OPTIMIZERS = frozenset("onebitlamb muadam muadamw musgd".split())
"""DeepSpeed's other optimizer names (lower case, as DeepSpeed compares them), which zerotrain
does not implement yet."""

REFUSED_PARAMS = {
    "max_grad_norm": "not an optimizer parameter; use the top-level `gradient_clipping` instead",
}
"""``params`` keys DeepSpeed refuses for every optimizer, with the fix."""

PARAM_ALIASES = {
    # HuggingFace TrainingArguments and torch/optax habits -> DeepSpeed's constructor argument
    "adam_eps": "eps",
    "adam_epsilon": "eps",
    "epsilon": "eps",
    "adam_beta1": "betas",
    "adam_beta2": "betas",
    "beta1": "betas",
    "beta2": "betas",
    "b1": "betas",
    "b2": "betas",
    "learning_rate": "lr",
    "wd": "weight_decay",
    "decay": "weight_decay",
}
"""``params`` keys other frameworks spell differently -> DeepSpeed's key, suggested when the
key is unknown (a did-you-mean by spelling would miss most of them)."""


def find_optimizer(name: str) -> OptimizerSpec | None:
    """The optimizer ``optimizer.type`` names, in any capitalisation; None if there is none."""
    return {spec.name.lower(): spec for spec in OPTIMIZERS.values()}.get(name.lower())


def build_optimizer(
    type: str,
    params: Mapping[str, Any],
    param_groups: list[dict[str, Any]],
    *,
    norm_allreduce: NormAllreduce | None = None,
) -> torch.optim.Optimizer:
    """Build the optimizer named by a DeepSpeed ``optimizer`` config section.

    DeepSpeed semantics (``engine._configure_basic_optimizer``):

    - "Adam" with ``adam_w_mode`` true (DeepSpeed's default) decays weights decoupled (AdamW);
      with ``adam_w_mode`` false it is L2-regularised Adam. "AdamW" is always decoupled,
      whatever ``adam_w_mode`` says. Both are :class:`FusedAdam`, DeepSpeed's class, unless
      ``torch_adam``, ``amsgrad`` or the kernel choice below asks for torch's own class.
    - Defaults are DeepSpeed's FusedAdam ones: lr 1e-3, betas (0.9, 0.999), eps 1e-8,
      weight_decay 0. With ``torch_adam`` true DeepSpeed calls torch's class directly, so a
      decoupled Adam then defaults to torch AdamW's weight_decay 0.01.
    - "SGD" is torch ``SGD`` with torch's defaults; "Lamb" is :class:`Lamb` (DeepSpeed FusedLamb).
    - ``max_grad_norm`` is rejected as in DeepSpeed: gradient clipping is the engine's job.

    Kernel choice: unless ``fused``/``foreach``/``torch_adam`` say otherwise, Adam, AdamW and SGD
    use torch's fused kernel when every tensor is a floating-point tensor on CPU or CUDA, and
    otherwise leave torch to choose (foreach where it supports the tensors). ``fused: true``
    forces the fused kernel, ``fused: false`` forbids it; ``torch_adam: true`` keeps torch's own
    default choice, as in DeepSpeed.

    Args:
        type: ``optimizer.type``, a name of :data:`OPTIMIZERS` in any capitalisation.
        params: ``optimizer.params``; only keys of that optimizer are accepted.
        param_groups: torch-style groups, ``[{"params": [tensors...], **overrides}]``; for Lamb
            a group may carry ``segment_ranges`` and ``num_segments`` (see :class:`Lamb`).
        norm_allreduce: for Lamb on shards, sums a 1-D tensor in place across ranks; ignored
            by the other optimizers, so the engine may always pass it.

    Raises:
        ValueError: unknown type, unknown or unsupported parameter, naming the config key.
    """
    spec = find_optimizer(type)
    if spec is None:
        raise ValueError(
            f"optimizer.type: unknown optimizer {type!r}; expected one of {sorted(OPTIMIZERS)}"
        )
    options = dict(params)
    for key in REFUSED_PARAMS.keys() & options.keys():
        raise ValueError(f"optimizer.params.{key}: {REFUSED_PARAMS[key]}")
    for key in options:
        if key not in spec.params:
            raise ValueError(
                f"optimizer.params.{key}: not a parameter of {spec.name}; "
                f"expected some of {sorted(spec.params)}"
            )
    if "betas" in options:
        options["betas"] = tuple(options["betas"])
    # Shallow copies: torch fills defaults into the group dicts it is given.
    param_groups = [{**group, "params": _group_tensors(group)} for group in param_groups]
    return spec.build(options, param_groups, norm_allreduce)


# Where torch has fused optimizer kernels that this library targets.
_FUSED_DEVICE_TYPES = frozenset({"cpu", "cuda"})


def _kernel_choice(
    options: dict[str, Any], tensors: list[Tensor], *, default_auto: bool
) -> tuple[bool | None, bool | None]:
    """``(fused, foreach)`` for a torch optimizer; pops both keys from ``options``."""
    fused = options.pop("fused", None)
    foreach = options.pop("foreach", None)
    if fused:
        bad = [t for t in tensors if not _fused_capable(t)]
        if bad:
            raise ValueError(
                "optimizer.params.fused: true needs every parameter to be a floating-point tensor "
                f"on CPU or CUDA; got one of dtype {bad[0].dtype} on {bad[0].device}. "
                "Remove the key to fall back automatically"
            )
    if fused is None and foreach is None and default_auto:
        if tensors and all(_fused_capable(t) for t in tensors):
            return True, None
        return False, None
    return fused, foreach


def _fused_capable(tensor: Tensor) -> bool:
    # Subclasses (DTensor and the like) are left to torch's generic paths, as torch itself does.
    return (
        type(tensor) in (Tensor, torch.nn.Parameter)
        and tensor.device.type in _FUSED_DEVICE_TYPES
        and tensor.is_floating_point()
    )


def _group_tensors(group: Mapping[str, Any]) -> list[Tensor]:
    params = group["params"]
    return [params] if isinstance(params, Tensor) else list(params)


def _tensors(param_groups: list[dict[str, Any]]) -> list[Tensor]:
    return [t for group in param_groups for t in group["params"]]
