"""The base of every config section and the value types its fields are checked with."""

import json
from typing import Annotated, Any, ClassVar, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from zerotrain.config.deepspeed_keys import Accepted
from zerotrain.config.errors import fail, show

__all__ = [
    "Beta",
    "Betas",
    "Fraction",
    "Int",
    "LrValue",
    "NonNegativeFloat",
    "NonNegativeInt",
    "PositiveFloat",
    "PositiveInt",
    "Section",
    "canonical_choice",
    "reject_bool",
    "section_of",
]


def reject_bool(value: Any) -> Any:
    """Refuse true/false in a number field: pydantic's lax mode reads them as 1/0, and in a
    number field that is always a slip."""
    if isinstance(value, bool):
        raise fail(f"must be a number, got {json.dumps(value)}")
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _float_or_per_group_list(value: Any) -> Any:
    if _is_number(value) or (isinstance(value, list) and value and all(map(_is_number, value))):
        return value
    raise fail(f"must be a number or a list of numbers (one per param group), got {show(value)}")


def _two_items(value: Any) -> Any:
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return value
    raise fail(f"must be a list of two numbers, got {show(value)}")


Int = Annotated[int, BeforeValidator(reject_bool)]
PositiveInt = Annotated[int, BeforeValidator(reject_bool), Field(gt=0)]
NonNegativeInt = Annotated[int, BeforeValidator(reject_bool), Field(ge=0)]
NonNegativeFloat = Annotated[float, BeforeValidator(reject_bool), Field(ge=0)]
PositiveFloat = Annotated[float, BeforeValidator(reject_bool), Field(gt=0)]
Fraction = Annotated[float, BeforeValidator(reject_bool), Field(ge=0, le=1)]
Beta = Annotated[float, BeforeValidator(reject_bool), Field(ge=0, lt=1)]
Betas = Annotated[tuple[Beta, Beta], BeforeValidator(_two_items)]
LrValue = Annotated[float | list[float], BeforeValidator(_float_or_per_group_list)]


def canonical_choice(value: Any, choices: list[str]) -> str | None:
    """The spelling of ``value`` among ``choices``, ignoring case; None if it is not one."""
    if not isinstance(value, str):
        return None
    return {c.lower(): c for c in choices}.get(value.lower())


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, values are immutable, and the
    attribute docstrings are the field descriptions (and the generated docs)."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, use_attribute_docstrings=True, allow_inf_nan=False
    )

    # DeepSpeed keys of this section accepted without a field (deepspeed_keys.py).
    _ACCEPTED: ClassVar[dict[str, Accepted]] = {}
    # DeepSpeed's older key names, still accepted: old name -> current name.
    _RENAMED: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _accept_old_names(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not cls._RENAMED.keys() & data.keys():
            return data
        data = dict(data)
        for old, new in cls._RENAMED.items():
            if old in data:
                if new in data:
                    raise fail(f"`{old}` is DeepSpeed's old name for `{new}`; set only `{new}`")
                data[new] = data.pop(old)
        return data


def section_of(annotation: Any) -> type[Section] | None:
    """The section model behind a field annotation (``X`` or ``X | None``), if any."""
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, Section):
            return candidate
    return None
