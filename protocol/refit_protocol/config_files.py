"""Settings files of the services: YAML or JSON, sizes with units, paths relative to the file.

Every service's settings are one pydantic model. Its fields use two types from here:
`ByteSize` (an int that also accepts "256MiB", "64Mi", "1.5GB") and `ConfigPath` (a Path that,
when relative, is taken relative to the directory of the file it was read from, not the
working directory). `load_config` reads a file or a text; `example_yaml` renders a commented
example from the model itself (descriptions, defaults, and the `examples` of required fields),
so the example, the schema and the generated reference can never drift from the code.
"""

from __future__ import annotations

import json
import re
import textwrap
import types
import typing
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import structlog
import yaml
from pydantic import AfterValidator, BaseModel, BeforeValidator, SecretStr, ValidationInfo
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined, to_jsonable_python

M = TypeVar("M", bound=BaseModel)

#: Validation-context key: the directory relative paths are resolved against.
CONFIG_DIR = "config_dir"

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kKmMgGtTpP])(i?))?[bB]?\s*$")
_POWER = {"k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
_BINARY_UNITS = ("PiB", "TiB", "GiB", "MiB", "KiB")


class ConfigFileError(ValueError):
    """A settings file that cannot be read as YAML or JSON, or is not a mapping."""


def parse_byte_size(value: Any) -> Any:
    """An int, or a size with a unit: B; k/M/G/T/P (powers of 1000, optional B); Ki/Mi/Gi/Ti/Pi
    (powers of 1024, optional B, as Kubernetes writes them). Other inputs pass through to
    pydantic's own int validation, which names the field."""
    if not isinstance(value, str):
        return value
    match = _SIZE.match(value)
    if match is None:
        raise ValueError(
            f"{value!r} is not a size: write bytes as an integer or with a unit, "
            "e.g. 256MiB, 64Mi, 1.5GB"
        )
    number, prefix, binary = match.groups()
    scale = (1024 if binary else 1000) ** _POWER[prefix.lower()] if prefix else 1
    size = Decimal(number) * scale  # exact: 1.07GB is 1070000000 bytes, not 1070000000.0000001
    if size != size.to_integral_value():
        raise ValueError(f"{value!r} is not a whole number of bytes")
    return int(size)


def format_byte_size(size: int) -> str:
    """The shortest exact binary-unit spelling ("512MiB"), else the plain integer."""
    for index, unit in enumerate(_BINARY_UNITS):
        step = 1024 ** (len(_BINARY_UNITS) - index)
        if size and size % step == 0:
            return f"{size // step}{unit}"
    return str(size)


class _Bytes:
    """Marks a ByteSize field, so examples and the reference print it with a unit."""


#: Put in a size type's `Annotated` metadata (as `ByteSize` does) to print it with a unit.
BYTE_SIZE = _Bytes()


Auto = Literal["auto"]
AUTO: Auto = "auto"


def _size_or_auto(value: Any) -> Any:
    if value == AUTO:
        return value
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size: write auto, bytes, or a unit (256MiB)")
    size = parse_byte_size(value)
    if isinstance(size, int) and size < 1:
        raise ValueError(f"{value!r}: a size must be at least 1 byte (or auto)")
    return size


#: A size setting that may also be `auto` (one clear error for anything else).
SizeOrAuto = Annotated[
    int | Auto, BeforeValidator(_size_or_auto, json_schema_input_type=int | str), BYTE_SIZE
]


def resolve_relative(value: Path, info: ValidationInfo) -> Path:
    """`value`, made relative to the settings file being validated (if any)."""
    value = value.expanduser()
    base = (info.context or {}).get(CONFIG_DIR)
    if base is None or value.is_absolute():
        return value
    return Path(base) / value


#: A number of bytes: an int or a string with a unit ("256MiB").
ByteSize = Annotated[
    int, BeforeValidator(parse_byte_size, json_schema_input_type=int | str), _Bytes()
]
#: A filesystem path; a relative one is taken relative to the settings file's directory.
ConfigPath = Annotated[Path, AfterValidator(resolve_relative)]


def parse_document(text: str, source: str) -> dict[str, Any]:
    """The mapping a settings text holds (JSON, or YAML, which also reads JSON)."""
    try:
        data = json.loads(text) if text.lstrip().startswith("{") else yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        raise ConfigFileError(
            f"{source}: not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigFileError(f"{source}: not valid YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        kind = "nothing" if data is None else type(data).__name__
        raise ConfigFileError(f"{source}: expected a mapping of settings, found {kind}")
    return data


def load_config(
    model: type[M], *, path: Path | None = None, text: str | None = None, source: str = ""
) -> M:
    """Read and validate settings from `path`, or from `text` (relative paths then resolve
    against the working directory). Raises ConfigFileError or pydantic's ValidationError."""
    if path is not None:
        text = path.read_text()
        source = source or str(path)
        base = path.resolve().parent
    elif text is not None:
        source = source or "settings"
        base = Path.cwd()
    else:
        raise TypeError("load_config needs a path or a text")
    data = parse_document(text, source)
    return model.model_validate(data, context={CONFIG_DIR: base})


# -- the views: example, reference -------------------------------------------------------------


def nested_model(annotation: Any) -> type[BaseModel] | None:
    """The settings model a field holds (directly or optionally), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(models) == 1:
            return nested_model(models[0])
    return None


def is_byte_size(info: FieldInfo) -> bool:
    return any(isinstance(m, _Bytes) for m in info.metadata)


def field_value(info: FieldInfo) -> Any:
    """What a field holds when not given: its default, else its first example."""
    if info.default is not PydanticUndefined:
        return info.default
    if info.default_factory is not None:
        return info.default_factory()  # type: ignore[call-arg]
    if info.examples:
        return info.examples[0]
    return PydanticUndefined


def render_value(info: FieldInfo, value: Any) -> Any:
    """A field's value as it would be written in a settings file."""
    if isinstance(value, SecretStr):
        return "<secret>"
    if is_byte_size(info) and isinstance(value, int):
        return format_byte_size(value)
    return to_jsonable_python(value)


def example_yaml(model: type[BaseModel]) -> str:
    """A commented YAML example of `model`: every field with its description and default
    (required ones with their example); optional sections commented out."""
    doc = (model.__doc__ or model.__name__).strip().splitlines()[0]
    lines = [
        f"# {model.__name__}: {doc}",
        "# Sizes take units (256MiB); relative paths are relative to this file.",
        "",
    ]
    lines += _example_lines(model, None, indent="", commented=False)
    return "\n".join(lines) + "\n"


def _example_lines(
    model: type[BaseModel], instance: BaseModel | None, *, indent: str, commented: bool
) -> list[str]:
    out: list[str] = []
    lead = f"{indent}# " if commented else indent
    for name, info in model.model_fields.items():
        required = info.is_required()
        description = (info.description or "").strip()
        note = " (required)" if required else ""
        for text in textwrap.wrap(description + note, width=94 - len(indent)) or [name]:
            out.append(f"{indent}# {text}")
        value = getattr(instance, name) if instance is not None else field_value(info)
        sub = nested_model(info.annotation)
        if sub is not None and (value is None or isinstance(value, BaseModel) or required):
            if value is PydanticUndefined:  # a required section: its own defaults and examples
                out.append(f"{lead}{name}:")
                out += _example_lines(sub, None, indent=indent + "  ", commented=commented)
            elif value is None:
                out.append(f"{indent}# Optional section, off by default:")
                out.append(f"{indent}# {name}:")
                out += _example_lines(sub, None, indent=indent + "  ", commented=True)
            else:
                out.append(f"{lead}{name}:")
                out += _example_lines(sub, value, indent=indent + "  ", commented=commented)
            continue
        if value is PydanticUndefined:
            raise ValueError(f"{model.__name__}.{name} is required but has no example")
        text = yaml.safe_dump(
            {name: render_value(info, value)}, sort_keys=False, width=1 << 16
        ).rstrip("\n")
        out += [f"{lead}{line}" for line in text.splitlines()]
    return out


def ensure_directory(path: Path, setting: str) -> Path:
    """Create the directory a setting names if it is missing, and say so (a relative path or a
    typo then shows in the log instead of a silent new folder)."""
    if not path.is_dir():
        path.mkdir(parents=True, exist_ok=True)
        structlog.get_logger("kuberefit.config").info(
            "config.created_directory", setting=setting, path=str(path)
        )
    return path
