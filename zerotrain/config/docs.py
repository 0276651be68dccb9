"""The Markdown reference of the config (docs/config.md), generated from the schema: each
section's fields with their docstrings, the DeepSpeed keys it accepts without a field, and the
`params` keys of each optimizer and scheduler type."""

import inspect
import json
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel

from zerotrain.config.errors import show
from zerotrain.config.params import OptimizerConfig, SchedulerConfig
from zerotrain.config.schema import ZeroTrainConfig
from zerotrain.config.section import Section, section_of

__all__ = ["config_reference_markdown"]


def _type_name(annotation: Any) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _type_name(args[0])
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(arg) for arg in args)
    if origin is Literal:
        return " | ".join(json.dumps(arg) for arg in args)
    if annotation is type(None):
        return "null"
    if annotation is Any:
        return "any"
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return "section"
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(arg) for arg in args)}]"
    return getattr(annotation, "__name__", str(annotation))


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _sections(
    section: type[Section] = ZeroTrainConfig, path: str = ""
) -> list[tuple[str, type[Section]]]:
    found = [(path, section)]
    for name, field in section.model_fields.items():
        subsection = section_of(field.annotation)
        if subsection is not None:
            found += _sections(subsection, f"{path}{name}.")
    return found


def config_reference_markdown() -> str:
    """The Markdown reference of every section and field, generated from the schema."""
    out = [
        "# zerotrain configuration reference",
        "",
        "Generated from `zerotrain/config.py` by `python -m zerotrain.config > docs/config.md`;"
        " do not edit by hand.",
        "",
        "zerotrain reads DeepSpeed's `ds_config.json` keys. Each section lists its fields, "
        "then the DeepSpeed keys it accepts without a field: keys that change nothing in "
        "zerotrain (any value, and the table says why) and keys accepted while they ask for "
        "nothing (a feature switched off); any other value of those is refused, naming the "
        "behaviour it asks for. Unknown keys are errors with a did-you-mean, as are "
        '`"auto"` placeholders (HuggingFace\'s Trainer fills them before DeepSpeed sees them), '
        "except where the Trainer never fills them (`bfloat16.enabled`, the unprefixed "
        "stage-3 names, stage-3 keys below stage 3): those take the default with a warning, "
        "as DeepSpeed reads them. "
        "Keys starting with `_` are comments. Load a config with "
        "`zerotrain.config.load_config(config, world_size=...)`; a `.json`, `.yaml` or "
        "`.yml` path or a dict.",
        "",
        "Check a file before submitting a job: `zerotrain config check ds_config.json "
        "[--world-size N]` (or `python -m zerotrain.config ds_config.json`) prints every "
        "problem with its key path, or what the config asks for; `zerotrain run` runs the "
        "same check on a `--deepspeed_config FILE` among the script's arguments before it "
        "starts any rank, and `zero.Init` before it builds the model.",
    ]
    for path, section in _sections():
        out += [
            "",
            f"## `{path.rstrip('.')}`" if path else "## Top level",
            "",
            _cell(inspect.cleandoc(section.__doc__ or "")),
            "",
            "| Key | Type | Default | Description |",
            "| --- | --- | --- | --- |",
        ]
        for name, field in section.model_fields.items():
            if field.is_required():
                default = "required"
            elif field.default_factory is not None:
                value = field.default_factory()  # type: ignore[call-arg]
                default = "`{}`" if isinstance(value, BaseModel) else f"`{show(value)}`"
            else:
                default = f"`{show(field.default)}`"
            out.append(
                f"| `{path}{name}` | `{_cell(_type_name(field.annotation))}` | {default} "
                f"| {_cell(field.description or '')} |"
            )
        renamed = ", ".join(f"`{old}` (read as `{new}`)" for old, new in section._RENAMED.items())
        if renamed:
            out += ["", f"Old DeepSpeed names accepted here: {renamed}."]
        if section._ACCEPTED:
            out += [
                "",
                "DeepSpeed keys of this section accepted without a field of their own:",
                "",
                "| Key | Accepted values | Why |",
                "| --- | --- | --- |",
            ]
            out += [
                f"| `{path}{key}` | {_cell(accepted.idle_values) if accepted.idle else 'any'} "
                f"| {_cell(accepted.why)} |"
                for key, accepted in sorted(section._ACCEPTED.items())
            ]
    for path, section in (("optimizer", OptimizerConfig), ("scheduler", SchedulerConfig)):
        out += ["", f"## `{path}.params`", "", f"Allowed keys for each `{path}.type`."]
        for type_name, spec in section._PARAMS.items():
            out += [
                "",
                f"### {type_name}",
                "",
                spec.doc,
                "",
                "| Key | Type | Required |",
                "| --- | --- | --- |",
            ]
            out += [
                f"| `{key}` | `{_cell(_type_name(annotation))}` "
                f"| {'yes' if key in spec.required else 'no'} |"
                for key, annotation in spec.keys.items()
            ]
        if section._DEEPSPEED_ONLY_TYPES:
            out += [
                "",
                f"DeepSpeed {path} types zerotrain does not implement yet (lower-cased): "
                + ", ".join(f"`{name}`" for name in sorted(section._DEEPSPEED_ONLY_TYPES))
                + ".",
            ]
    return "\n".join(out) + "\n"
