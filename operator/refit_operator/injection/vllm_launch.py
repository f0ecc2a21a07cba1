"""How a vLLM container is started, and how injection reaches its command line (pure).

vLLM must be started with KubeRefit's worker extension and refit control path
(`--worker-extension-cls`, `--middleware`). People start vLLM in several ways; each is wired,
or refused at admission with a message that names the fix (never a vLLM that crashes at start):

- `vllm serve MODEL ...`, `python -m vllm.entrypoints.openai.api_server ...`, args only (the
  image's entrypoint, e.g. vllm/vllm-openai's `vllm serve`), KServe's vLLM runtime: both flags
  are appended to the container's args;
- neither command nor args (the image's CMD): refused, appended args would replace the CMD;
- a shell, `sh -c "... vllm serve ... $KUBEREFIT_VLLM_ARGS"`: `$KUBEREFIT_VLLM_ARGS` is set to
  both flags; a script that does not use it is refused;
- a vLLM that already has `--worker-extension-cls X` (verl, OpenRLHF), or a pod that names X in
  `kuberefit.io/worker-extension`: the flag names the composed class
  (`refit_sidecar.vllm.composed`), and X goes in `$KUBEREFIT_USER_WORKER_EXTENSION`;
- KServe's Hugging Face runtime (`huggingfaceserver`): refused, its own server loads no
  `--middleware`.

The port the receiver calls vLLM on: the pod's `kuberefit.io/vllm-port`, else vLLM's `--port`,
else 8080 in KServe's serving container (`kserve-container`), else vLLM's default 8000.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from refit_operator.injection.pod import Container
from refit_operator.kube.names import USER_WORKER_EXTENSION, VLLM_PORT
from refit_protocol.pod_contract import (
    USER_WORKER_EXTENSION_ENV,
    VLLM_ARGS_ENV,
    VLLM_COMPOSED_EXTENSION,
    VLLM_MIDDLEWARE,
    VLLM_WORKER_EXTENSION,
)

Obj = dict[str, Any]
SHELLS = frozenset({"sh", "bash", "ash", "dash", "zsh"})
DEFAULT_VLLM_PORT = 8000
#: KServe's serving container, which listens on 8080 unless told otherwise.
KSERVE_CONTAINER, KSERVE_PORT = "kserve-container", 8080
EXTENSION_FLAG, MIDDLEWARE_FLAG = "--worker-extension-cls", "--middleware"
_OURS = frozenset({VLLM_WORKER_EXTENSION, VLLM_COMPOSED_EXTENSION})
_USES_ARGS_ENV = re.compile(
    rf"\$(\{{{VLLM_ARGS_ENV}\}}|\({VLLM_ARGS_ENV}\)|{VLLM_ARGS_ENV}(?![A-Za-z0-9_]))"
)
_PORT = re.compile(r"[0-9]{1,5}")


class LaunchRefusedError(ValueError):
    """vLLM's command line cannot be wired as written (the message says what to change)."""


@dataclass
class VllmWiring:
    """What injection changes in the vLLM container: words replaced (JSON Patch ops on its
    command/args), words appended to its args, env added, and the port vLLM serves on."""

    port: int
    append_args: list[str] = field(default_factory=list)
    replace: list[Obj] = field(default_factory=list)
    env: list[Obj] = field(default_factory=list)


def wire_vllm(container: Container, base: str, annotations: Mapping[str, str]) -> VllmWiring:
    """How to start the vLLM `container` (at JSON Pointer `base`) with KubeRefit's flags."""
    name = container.name
    command = list(container.command or [])
    args = list(container.args or [])
    words = [*command, *args]
    if any("huggingfaceserver" in w for w in words):
        raise LaunchRefusedError(
            f"container {name!r} runs KServe's Hugging Face runtime (huggingfaceserver), whose "
            "own server loads no vLLM --middleware: serve the model with a ServingRuntime that "
            "runs vLLM's OpenAI server (vllm serve, or "
            "python -m vllm.entrypoints.openai.api_server)"
        )
    theirs = annotations.get(USER_WORKER_EXTENSION) or ""
    if words and words[0].rsplit("/", 1)[-1] in SHELLS:
        return _shell(container, words, theirs, annotations)
    if not words:
        raise LaunchRefusedError(
            f"container {name!r} sets neither command nor args: appending vLLM's flags would "
            "replace the image's CMD; write its `vllm serve ...` arguments in the pod"
        )
    given = _flag_values(words, EXTENSION_FLAG)
    foreign = sorted({g for g in given if g not in _OURS})
    wiring = VllmWiring(port=_port(container, words, annotations))
    if foreign:
        if len(foreign) > 1 or (theirs and theirs != foreign[0]):
            raise LaunchRefusedError(
                f"container {name!r} names worker extensions {sorted({*foreign, theirs} - {''})}:"
                f" vLLM takes one, and KubeRefit composes it with its own (keep one, or name it"
                f" in {USER_WORKER_EXTENSION})"
            )
        wiring.replace = _replace_flag(words, len(command), base, EXTENSION_FLAG)
        wiring.env.append(_env(USER_WORKER_EXTENSION_ENV, foreign[0]))
    elif not given:
        wiring.append_args.append(f"{EXTENSION_FLAG}={_extension(theirs)}")
        if theirs:
            wiring.env.append(_env(USER_WORKER_EXTENSION_ENV, theirs))
    if VLLM_MIDDLEWARE not in _flag_values(words, MIDDLEWARE_FLAG):
        wiring.append_args.append(f"{MIDDLEWARE_FLAG}={VLLM_MIDDLEWARE}")
    return wiring


def _extension(theirs: str) -> str:
    """The class `--worker-extension-cls` names: ours, or ours composed with the user's."""
    return VLLM_COMPOSED_EXTENSION if theirs else VLLM_WORKER_EXTENSION


def _shell(
    container: Container, words: list[str], theirs: str, annotations: Mapping[str, str]
) -> VllmWiring:
    name, script = container.name, " ".join(words[1:])
    if not _USES_ARGS_ENV.search(script):
        raise LaunchRefusedError(
            f"container {name!r} runs vLLM through a shell ({words[0]}), where appended flags "
            f"would not reach vLLM: add ${VLLM_ARGS_ENV} to the vllm command line in the script "
            f"(injection sets it to vLLM's refit flags), or run vllm directly"
        )
    try:
        inner = shlex.split(script)
    except ValueError:
        inner = script.split()
    if _flag_values(inner, EXTENSION_FLAG):
        raise LaunchRefusedError(
            f"container {name!r}'s script sets {EXTENSION_FLAG} itself, and vLLM takes one: "
            f"remove it and name your class in the annotation {USER_WORKER_EXTENSION} "
            f"(${VLLM_ARGS_ENV} then carries both, composed)"
        )
    flags = [f"{EXTENSION_FLAG}={_extension(theirs)}", f"{MIDDLEWARE_FLAG}={VLLM_MIDDLEWARE}"]
    env = [_env(VLLM_ARGS_ENV, " ".join(flags))]
    if theirs:
        env.append(_env(USER_WORKER_EXTENSION_ENV, theirs))
    return VllmWiring(port=_port(container, inner, annotations), env=env)


def _port(container: Container, words: Sequence[str], annotations: Mapping[str, str]) -> int:
    given = annotations.get(VLLM_PORT)
    source = f"annotation {VLLM_PORT}"
    if given is None:
        flags = _flag_values(words, "--port")
        if not flags:
            kserve = container.name == KSERVE_CONTAINER
            return KSERVE_PORT if kserve else DEFAULT_VLLM_PORT
        given, source = flags[-1], "vLLM's --port"
    port = given
    if not _PORT.fullmatch(port) or not 1 <= int(port) <= 65535:
        raise LaunchRefusedError(
            f"cannot read {source} {port!r}: use a port number (or set {VLLM_PORT})"
        )
    return int(port)


def _replace_flag(words: Sequence[str], n_command: int, base: str, flag: str) -> list[Obj]:
    """Ops that point every `flag` of `words` (command then args) at the composed class."""
    ops = []
    for i, word in enumerate(words):
        if word == flag and i + 1 < len(words):
            at, value = i + 1, VLLM_COMPOSED_EXTENSION
        elif word.startswith(flag + "="):
            at, value = i, f"{flag}={VLLM_COMPOSED_EXTENSION}"
        else:
            continue
        where = f"{base}/command/{at}" if at < n_command else f"{base}/args/{at - n_command}"
        ops.append({"op": "replace", "path": where, "value": value})
    return ops


def _flag_values(words: Sequence[str], flag: str) -> list[str]:
    values = []
    for i, word in enumerate(words):
        if word == flag and i + 1 < len(words):
            values.append(str(words[i + 1]))
        elif word.startswith(flag + "="):
            values.append(word.split("=", 1)[1])
    return values


def _env(name: str, value: str) -> Obj:
    return {"name": name, "value": value}
