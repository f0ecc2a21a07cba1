"""Settings files as a user writes them: YAML or JSON, sizes with units, paths relative to the
file, typos refused by name; `<component> config --example` validates with `--check`, and every
setting of every service says what it is for."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import pytest
from click.testing import CliRunner
from pydantic import BaseModel, ValidationError

from refit_protocol.kit import cli
from refit_protocol.kit.config_files import ConfigFileError, kind_choice, load_config
from refit_protocol.sizes import format_byte_size, parse_byte_size
from refit_sidecar.producer.main import ProducerProcessConfig
from refit_sidecar.receiver.config import ReceiverConfig

SERVICES = {
    "receiver": "refit_sidecar.receiver.config:ReceiverConfig",
    "producer": "refit_sidecar.producer.main:ProducerProcessConfig",
    "coordinator": "refit_operator.coordinator_service:CoordinatorServiceConfig",
}


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("256MiB", 256 << 20),
        ("64Mi", 64 << 20),
        ("1.5GiB", 3 << 29),
        ("1.5GB", 1_500_000_000),
        ("1.07GB", 1_070_000_000),  # exact, not 1.07 * 1e9 in floating point
        ("2k", 2000),
        ("4 KiB", 4096),
        ("512", 512),
        ("512B", 512),
        (512, 512),
    ],
)
def test_sizes_take_units(text: str | int, size: int) -> None:
    assert parse_byte_size(text) == size


@pytest.mark.parametrize("text", ["12 parsecs", "MiB", "1.5", "0.3KiB", "-1MiB"])
def test_sizes_that_are_not_sizes_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"(not a size|whole number)"):
        parse_byte_size(text)


def test_sizes_print_in_the_largest_exact_unit() -> None:
    assert [format_byte_size(n) for n in (64 << 30, 3 << 29, 1000, 0)] == [
        "64GiB",
        "1536MiB",
        "1000",
        "0",
    ]


def test_yaml_with_units_and_relative_paths(tmp_path: Path) -> None:
    conf = tmp_path / "conf"
    conf.mkdir()
    path = conf / "receiver.yaml"
    path.write_text(
        "node: rollout-0  # a comment\n"
        "token_file: secrets/token\n"
        "async_staging_max_bytes: 2GiB\n"
        "relay:\n  bind: tcp://127.0.0.1:5701\n  max_payload_bytes: 512Mi\n"
        "applier:\n  shm_dir: /dev/shm/abs\n"
    )
    config = load_config(ReceiverConfig, path=path)
    assert config.token_file == conf / "secrets" / "token"
    assert config.applier.shm_dir == Path("/dev/shm/abs")
    assert config.async_staging_max_bytes == 2 << 30
    assert config.relay is not None
    assert config.relay.max_payload_bytes == 512 << 20
    # JSON is read as JSON; nested paths resolve against the file too
    path = conf / "producer.json"
    path.write_text(json.dumps({"staging": {"inbox": "inbox"}, "baseline": {"directory": "b"}}))
    producer = load_config(ProducerProcessConfig, path=path)
    assert producer.staging is not None
    assert producer.staging.inbox == conf / "inbox"
    assert producer.baseline.directory == conf / "b"
    # settings given as text (an injected $KUBEREFIT_CONFIG) resolve against the working dir
    text = load_config(ProducerProcessConfig, text='{"staging": {"inbox": "in"}}')
    assert text.staging is not None
    assert text.staging.inbox == Path.cwd() / "in"
    # built in code, nothing is rewritten
    assert ProducerProcessConfig.model_validate({"staging": {"inbox": "in"}}).staging == (
        producer.staging.model_copy(update={"inbox": Path("in")})
    )


def test_unreadable_documents_say_where(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    for text, message in [
        ("node: [1, 2\n", r"bad.yaml: not valid YAML at line 2"),
        ('{"node": }', r"bad.yaml: not valid JSON at line 1 column 10"),
        ("- a\n- b\n", r"bad.yaml: expected a mapping of settings, found list"),
        ("", r"bad.yaml: expected a mapping of settings, found nothing"),
    ]:
        path.write_text(text)
        with pytest.raises(ConfigFileError, match=message):
            load_config(ReceiverConfig, path=path)


def test_a_typo_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text("node: n\nrelay:\n  bind: tcp://127.0.0.1:1\n  max_payload_byte: 1\n")
    with pytest.raises(ValidationError, match=r"relay\.max_payload_byte\n  Extra inputs"):
        load_config(ReceiverConfig, path=path)


def run(args: list[str]) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli.build(), args, prog_name="kuberefit")
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_the_example_validates_with_check(service: str, tmp_path: Path) -> None:
    code, example, _ = run([service, "config", "--example"])
    assert code == 0
    name = SERVICES[service].rpartition(":")[2]
    assert example.startswith(f"# {name}: ")
    path = tmp_path / "example.yaml"
    path.write_text(example)
    code, out, err = run([service, "config", "--check", str(path)])
    assert (code, out.strip()) == (0, f"{path}: valid {name}"), err
    # every top-level setting is in the example, with its description above it
    model = cli.import_model(SERVICES[service])
    for field, info in model.model_fields.items():
        assert f"\n{field}:" in example or f"\n# {field}:" in example, field
        assert (info.description or "").split()[0] in example, field


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_check_names_a_typo_and_exits_2(service: str, tmp_path: Path) -> None:
    path = tmp_path / "typo.yaml"
    code, example, _ = run([service, "config", "--example"])
    path.write_text(example + "snyc: false\n")
    code, _out, err = run([service, "config", "--check", str(path)])
    assert code == 2
    assert err.strip().splitlines() == [
        f"kuberefit {service} config: error: invalid "
        f"{SERVICES[service].rpartition(':')[2]}: snyc: Extra inputs are not permitted"
    ]


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_schema_is_the_models(service: str) -> None:
    code, out, _ = run([service, "config", "--schema"])
    assert code == 0
    assert json.loads(out) == cli.import_model(SERVICES[service]).model_json_schema()


def test_config_wants_exactly_one_view() -> None:
    for args in ([], ["--example", "--schema"]):
        code, _, err = run(["receiver", "config", *args])
        assert code == 2
        assert "exactly one of --example, --schema, --check FILE" in err


def settings_models() -> list[type[BaseModel]]:
    """Every model reachable from the services' settings."""
    found: list[type[BaseModel]] = []
    todo = [cli.import_model(ref) for ref in SERVICES.values()]
    while todo:
        model = todo.pop()
        if model in found:
            continue
        found.append(model)
        for info in model.model_fields.values():
            choice = kind_choice(info)
            if choice is not None:  # one of several sections, by `kind`: each of them
                todo += list(choice.choices().values())
                continue
            for arg in (info.annotation, *typing.get_args(info.annotation)):
                for inner in (arg, *typing.get_args(arg)):
                    if isinstance(inner, type) and issubclass(inner, BaseModel):
                        todo.append(inner)
    return found


def test_every_setting_is_described_and_typos_are_refused() -> None:
    models = settings_models()
    assert len(models) >= 12
    for model in models:
        assert model.model_config.get("extra") == "forbid", model
        for name, info in model.model_fields.items():
            assert info.description, f"{model.__name__}.{name} has no description"
