"""A config file checked as ``initialize`` checks it, as a report for people:
``zerotrain config check FILE`` and ``python -m zerotrain.config FILE``."""

import warnings
from pathlib import Path

from zerotrain.config.errors import ConfigError
from zerotrain.config.files import read_config_file
from zerotrain.config.load import check_config, has_auto, load_config

__all__ = ["check_file"]


def check_file(path: str, world_size: int | None = None) -> tuple[bool, str]:
    """(whether ``path`` passes, the report to print): every problem with its key path, or
    what the config asks for. With ``world_size`` the batch keys are resolved as the engine
    resolves them for that many data-parallel ranks."""
    with warnings.catch_warnings(record=True) as notes:
        warnings.simplefilter("always")
        try:
            raw = read_config_file(Path(path))
            unfilled = has_auto(raw)
            config = check_config(raw, unfilled=unfilled)
            if world_size is not None and not unfilled:
                config = load_config(raw, world_size=world_size)
        except ConfigError as error:
            return False, f"{path}: {len(str(error).splitlines())} problem(s)\n{error}"
    lines = [f"{path}: valid"]
    lines += [f"  note: {str(note.message).removeprefix('zerotrain config: ')}" for note in notes]
    zero = config.zero_optimization
    precision = "bf16" if config.bf16.enabled else "fp16" if config.fp16.enabled else "fp32"
    optimizer = config.optimizer.type if config.optimizer is not None else "none (the script's)"
    lines.append(
        f"  ZeRO stage {zero.stage}, {precision}, optimizer {optimizer}, offload: optimizer "
        f"{zero.offload_optimizer.device}, parameters {zero.offload_param.device}"
    )
    if unfilled:
        lines.append(
            '  "auto" values are left for HuggingFace\'s Trainer to fill; the batch keys are '
            "checked when it has"
        )
    elif world_size is None:
        lines.append("  batch keys: checked at initialize; --world-size N checks them now")
    else:
        sizes = config.batch_sizes()
        lines.append(
            f"  batch: train_batch_size {sizes.train_batch_size} = micro-batch "
            f"{sizes.train_micro_batch_size_per_gpu} x accumulation "
            f"{sizes.gradient_accumulation_steps} x {world_size} data-parallel rank(s)"
        )
    return True, "\n".join(lines)
