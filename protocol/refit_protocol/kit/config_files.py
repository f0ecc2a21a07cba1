"""Settings files of the services: YAML or JSON, paths relative to the file.

Every service's settings are one pydantic model. Its sizes are `refit_protocol.sizes` types
("256MiB", "64Mi", "1.5GB"); its paths are `ConfigPath` (a Path that, when relative, is taken
relative to the directory of the file it was read from, not the working directory).
`load_config` reads a file or a text; `example_yaml` renders a commented example from the model
itself (descriptions, defaults, and the `examples` of required fields), so the example, the
schema and the generated reference can never drift from the code.

A settings file is read with bounds, so that a hostile or broken one is refused in one line
instead of exhausting the process: at most `MAX_CONFIG_BYTES` (1 MiB; settings are a few
kilobytes), mappings and lists nested at most `MAX_CONFIG_DEPTH` (64) levels, at most
`MAX_CONFIG_VALUES` (100,000) values counting every use of a YAML alias, numbers written in at
most `MAX_NUMBER_CHARS` (100) characters and finite, and sizes bounded as `refit_protocol.sizes`
says. YAML is parsed by libyaml (PyYAML's C loader) when it is installed.
"""

from __future__ import annotations

import json
import math
import re
import textwrap
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Annotated, Any, TypeVar

import structlog
import yaml
from pydantic import AfterValidator, BaseModel, SecretStr, ValidationInfo
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined, to_jsonable_python

from refit_protocol.sizes import format_byte_size, is_byte_size_marker

M = TypeVar("M", bound=BaseModel)

#: Validation-context key: the directory relative paths are resolved against.
CONFIG_DIR = "config_dir"


#: The largest settings file (or $KUBEREFIT_CONFIG text) read, in bytes: 1 MiB.
MAX_CONFIG_BYTES = 1 << 20
#: The deepest nesting of mappings and lists in a settings file.
MAX_CONFIG_DEPTH = 64
#: The most values (mappings, lists and scalars, keys included; a YAML alias counts every time
#: it is used) a settings file may hold.
MAX_CONFIG_VALUES = 100_000
#: The longest number, as written, in a settings file or a JSON input (characters).
MAX_NUMBER_CHARS = 100


class ConfigFileError(ValueError):
    """A settings file that cannot be read as YAML or JSON, is not a mapping, or is beyond the
    bounds above (the message says which, in one line)."""


def resolve_relative(value: Path, info: ValidationInfo) -> Path:
    """`value`, made relative to the settings file being validated (if any)."""
    value = value.expanduser()
    base = (info.context or {}).get(CONFIG_DIR)
    if base is None or value.is_absolute():
        return value
    return Path(base) / value


#: A filesystem path; a relative one is taken relative to the settings file's directory.
ConfigPath = Annotated[Path, AfterValidator(resolve_relative)]


# -- reading with bounds ------------------------------------------------------------------------


def read_limited(path: Path, limit: int) -> bytes:
    """The bytes of `path`, refused (ConfigFileError) when there are more than `limit`: it reads
    at most `limit` + 1 bytes, so a huge file or an endless device is never read whole. An
    unreadable file raises OSError."""
    with path.open("rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ConfigFileError(f"{path}: larger than {format_byte_size(limit)}")
    return data


#: A JSON string, or one never closed (to the end: the parser stops there). Linear: every
#: attempt matches, so a text of escaped quotes is not rescanned from each of them.
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_DEPTH_STEP = [0] * 256
_DEPTH_STEP[ord("[")] = _DEPTH_STEP[ord("{")] = 1
_DEPTH_STEP[ord("]")] = _DEPTH_STEP[ord("}")] = -1


def json_shape_problem(text: str, *, max_depth: int, max_brackets: int) -> str | None:
    """Why the JSON `text` is beyond its bounds, found without parsing it (Python's parser
    recurses once per level, and a few thousand levels raise RecursionError), or None: more
    than `max_brackets` brackets outside strings, or arrays and objects nested deeper than
    `max_depth` levels. String contents are skipped; a bracket never closed counts as open to
    the end, so a broken text is judged no shallower than the parser would find it."""
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text)).encode("ascii")
    first = brackets[: max_brackets + 1]  # the depth of what the parser would reach first
    if max(accumulate(map(_DEPTH_STEP.__getitem__, first)), default=0) > max_depth:
        return f"nested deeper than {max_depth} levels"
    if len(brackets) > max_brackets:
        return f"more than {max_brackets:,} brackets ([ ] {{ }}) outside strings"
    return None


class _NumberError(ValueError):
    """A number in a document that is too long or not finite (the message says which)."""


def _too_long(text: str, limit: int) -> _NumberError:
    return _NumberError(f"a number of {len(text)} characters (at most {limit})")


def _json_constant(name: str) -> Any:
    raise _NumberError(f"{name} is not a finite number")


def json_loads_bounded(
    text: str, max_number_chars: int = MAX_NUMBER_CHARS, *, finite: bool = True
) -> Any:
    """`json.loads`, with every number written in at most `max_number_chars` characters and,
    when `finite`, finite (no NaN, Infinity or 1e999): a ValueError says which otherwise. It
    does not bound the depth: check `json_shape_problem` first."""

    def whole(number: str) -> int:
        if len(number) > max_number_chars:
            raise _too_long(number, max_number_chars)
        return int(number)

    def real(number: str) -> float:
        if len(number) > max_number_chars:
            raise _too_long(number, max_number_chars)
        value = float(number)
        if finite and not math.isfinite(value):
            raise _NumberError(f"{number} is not a finite number")
        return value

    constant = _json_constant if finite else float
    return json.loads(text, parse_int=whole, parse_float=real, parse_constant=constant)


_BaseLoader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _Loader(_BaseLoader):  # type: ignore[misc,valid-type]
    """PyYAML's safe loader, parsed by libyaml (C) when installed: the pure-Python parser takes
    tens of seconds and gigabytes for a few megabytes. Numbers are bounded as in JSON."""


def _where(node: yaml.Node) -> str:
    mark = node.start_mark
    return f" at line {mark.line + 1} column {mark.column + 1}"


def _yaml_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    if len(node.value) > MAX_NUMBER_CHARS:
        raise _NumberError(
            f"a number of {len(node.value)} characters{_where(node)} (at most {MAX_NUMBER_CHARS})"
        )
    return int(loader.construct_yaml_int(node))


def _yaml_float(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> float:
    if len(node.value) > MAX_NUMBER_CHARS:
        raise _NumberError(
            f"a number of {len(node.value)} characters{_where(node)} (at most {MAX_NUMBER_CHARS})"
        )
    value = float(loader.construct_yaml_float(node))
    if not math.isfinite(value):
        raise _NumberError(f"{node.value} is not a finite number{_where(node)}")
    return value


_Loader.add_constructor("tag:yaml.org,2002:int", _yaml_int)
_Loader.add_constructor("tag:yaml.org,2002:float", _yaml_float)
#: The loader settings are read with (libyaml's when installed).
YAML_LOADER: type[yaml.SafeLoader] = _Loader


def _load_yaml(text: str) -> Any:
    """`YAML_LOADER` is PyYAML's safe loader (libyaml's or Python's), numbers bounded."""
    return yaml.load(text, Loader=YAML_LOADER)  # noqa: S506


def _shape_problem(data: Any) -> str | None:
    """Why the parsed document is beyond the bounds (depth, values with aliases expanded), or
    None; iterative, and it stops at the first value past a bound."""
    todo: list[tuple[Any, int]] = [(data, 1)]
    seen = 0
    while todo:
        value, depth = todo.pop()
        seen += 1
        if seen > MAX_CONFIG_VALUES:
            return f"more than {MAX_CONFIG_VALUES:,} values (YAML aliases count each time used)"
        if isinstance(value, dict | list):
            if depth > MAX_CONFIG_DEPTH:
                return f"nested deeper than {MAX_CONFIG_DEPTH} levels"
            items = (
                [x for pair in value.items() for x in pair] if isinstance(value, dict) else value
            )
            todo.extend((item, depth + 1) for item in items)
    return None


def parse_document(text: str, source: str) -> dict[str, Any]:
    """The mapping a settings text holds (JSON, or YAML, which also reads JSON), within the
    bounds (`MAX_CONFIG_BYTES`, `MAX_CONFIG_DEPTH`, `MAX_CONFIG_VALUES`, `MAX_NUMBER_CHARS`):
    anything else raises ConfigFileError with a one-line reason."""
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigFileError(f"{source}: larger than {format_byte_size(MAX_CONFIG_BYTES)}")
    is_json = text.lstrip().startswith("{")
    if is_json:
        problem = json_shape_problem(
            text, max_depth=MAX_CONFIG_DEPTH, max_brackets=2 * MAX_CONFIG_VALUES
        )
        if problem is not None:
            raise ConfigFileError(f"{source}: {problem}")
    try:
        data = json_loads_bounded(text) if is_json else _load_yaml(text)
    except json.JSONDecodeError as exc:
        raise ConfigFileError(
            f"{source}: not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigFileError(f"{source}: not valid YAML{where}: {_one_line(problem)}") from None
    except _NumberError as exc:
        raise ConfigFileError(f"{source}: {exc}") from None
    except RecursionError:  # a backstop: libyaml's parser and the checks above do not recurse
        raise ConfigFileError(f"{source}: nested deeper than {MAX_CONFIG_DEPTH} levels") from None
    except ValueError as exc:  # e.g. a YAML value PyYAML cannot convert
        raise ConfigFileError(f"{source}: not valid YAML: {_one_line(str(exc))}") from None
    problem = _shape_problem(data)
    if problem is not None:
        raise ConfigFileError(f"{source}: {problem}")
    if not isinstance(data, dict):
        kind = "nothing" if data is None else type(data).__name__
        raise ConfigFileError(f"{source}: expected a mapping of settings, found {kind}")
    return data


def _one_line(text: str, limit: int = 200) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def load_config(
    model: type[M], *, path: Path | None = None, text: str | None = None, source: str = ""
) -> M:
    """Read and validate settings from `path`, or from `text` (relative paths then resolve
    against the working directory). Raises ConfigFileError or pydantic's ValidationError."""
    if path is not None:
        source = source or str(path)
        raw = read_limited(path, MAX_CONFIG_BYTES)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigFileError(
                f"{source}: not UTF-8 text (byte {exc.start + 1}: {exc.reason})"
            ) from None
        base = path.resolve().parent
    elif text is not None:
        source = source or "settings"
        base = Path.cwd()
    else:
        raise TypeError("load_config needs a path or a text")
    data = parse_document(text, source)
    settings = model.model_validate(data, context={CONFIG_DIR: base})
    where = _non_finite(settings.model_dump())
    if where:  # e.g. `timeout_s: "inf"` or YAML 1.1's `1e999` (a string), which pydantic takes
        raise ConfigFileError(f"{source}: {where} is not a finite number")
    return settings


def _non_finite(value: Any, at: str = "") -> str:
    """The dotted name of the first infinite or NaN float in a dumped settings model, else ""."""
    if isinstance(value, float) and not math.isfinite(value):
        return at or "a value"
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, (list, tuple)):
        items = ((str(i), v) for i, v in enumerate(value))
    else:
        return ""
    for key, item in items:
        found = _non_finite(item, f"{at}.{key}" if at else str(key))
        if found:
            return found
    return ""


# -- the views: example, reference -------------------------------------------------------------
@dataclass(frozen=True)
class KindChoice:
    """Field metadata: the field holds one of several settings sections, the one its `kind`
    key names (the model's own validator picks it; this tells the views and the schema).
    `choices` is called when needed, so the sections' modules are imported only then."""

    choices: Callable[[], Mapping[str, type[BaseModel]]]
    default: str

    def kind_of(self, value: BaseModel) -> str:
        for kind, model in self.choices().items():
            if isinstance(value, model):
                return kind
        raise ValueError(f"{type(value).__name__} is none of {', '.join(self.choices())}")

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: Any) -> dict[str, Any]:
        options = []
        for kind, model in self.choices().items():
            sub = dict(handler.resolve_ref_schema(handler(model.__pydantic_core_schema__)))
            default = {"default": kind} if kind == self.default else {}
            kind_schema = {"const": kind, **default}
            sub["properties"] = {"kind": kind_schema, **sub.get("properties", {})}
            options.append(sub)
        return {"oneOf": options}


def kind_choice(info: FieldInfo) -> KindChoice | None:
    return next((m for m in info.metadata if isinstance(m, KindChoice)), None)


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
    return any(is_byte_size_marker(m) for m in info.metadata)


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
        choice = kind_choice(info)
        if choice is not None and isinstance(value, BaseModel):  # the default kind's section
            out.append(f"{lead}{name}:")
            kinds = ", ".join(choice.choices())
            out.append(f"{indent}  # Which kind of section this is: one of {kinds}.")
            out.append(f"{lead}  kind: {choice.kind_of(value)}")
            out += _example_lines(type(value), value, indent=indent + "  ", commented=commented)
            continue
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
