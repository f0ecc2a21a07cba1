"""The sidecar's side of the handoff: chunk files taken out of the inbox and kept per version.

The trainer writes each owned chunk into the inbox (a shared-memory volume) and names it in a
request; `CandidateStaging.accept` moves it into a private candidate directory, which frees the
shared memory at once (on another file system the move is a copy), and validates that private
copy as untrusted input (safe name, regular file, full safetensors header check, names, shapes
and dtypes as expected); a refused file is deleted.
The staged files of a version stay until its transition commits, because a retry that cannot
use the pending delta compares again from the same candidate (no second export).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
from pydantic import BaseModel, ConfigDict, Field

from refit_protocol.kit.config_files import ConfigPath, ensure_directory
from refit_sidecar.baseline.chunks import ExportChunk
from refit_sidecar.codec.records import TensorMeta
from refit_sidecar.producer.changes import CommittedBits, chunk_metas, rebuild
from refit_sidecar.trainer.chunk_files import load_tensors, read_header, safe_path
from refit_sidecar.trainer.errors import CandidateMismatchError, ChunkFileError
from refit_sidecar.trainer.manifest import describe_difference

log = structlog.get_logger("kuberefit.staging")


class StagingConfig(BaseModel):
    """Where the trainer's chunk files arrive and where staged versions are kept."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    inbox: ConfigPath = Field(
        description="Directory on the shared-memory volume the trainer writes chunk files to "
        "(the publisher's `inbox`, as mounted in this container).",
        examples=["/dev/shm/kuberefit/inbox"],
    )
    candidate_dir: ConfigPath | None = Field(
        default=None,
        description="Where staged chunk files are kept until their version commits (about "
        "H/W bytes: this producer's share of one checkpoint). Put it on disk, not on the "
        "shared-memory volume, so that volume only ever holds the chunks in flight. None: a "
        "private directory under the system temp directory.",
    )
    reference_checkpoint: ConfigPath | None = Field(
        default=None,
        description="HF checkpoint directory the rollout engines were started from. The first "
        "export must equal it bit for bit (fresh start and resume rule); None skips that check "
        "(a warning is logged).",
    )


@dataclass(frozen=True)
class StagedChunk:
    """One accepted chunk file of a version."""

    index: int
    metas: tuple[TensorMeta, ...]
    path: Path
    nbytes: int

    def load(self) -> ExportChunk:
        names = [m.name for m in self.metas]
        return ExportChunk(self.index, tuple(load_tensors(self.path, names)))


class CandidateStaging:
    """Accepted chunk files by version; thread-safe (the publisher sends chunks concurrently)."""

    def __init__(self, config: StagingConfig) -> None:
        self.config = config
        ensure_directory(config.inbox, "staging.inbox")
        if config.candidate_dir is not None:
            ensure_directory(config.candidate_dir, "staging.candidate_dir")
        self._root = Path(tempfile.mkdtemp(prefix="kuberefit-candidate-", dir=config.candidate_dir))
        self._lock = threading.Lock()
        self._chunks: dict[int, dict[int, StagedChunk]] = {}

    def accept(
        self,
        version: int,
        index: int,
        file: str,
        names: Sequence[str],
        expected: tuple[TensorMeta, ...] | None,
        known: Mapping[str, TensorMeta] | None = None,
        changed: Sequence[str] = (),
        committed: CommittedBits | None = None,
    ) -> StagedChunk:
        """Validate `file` in the inbox against `names` and the chunk `expected` at `index`
        (`known`: every baseline tensor, to name the tensor that changed) and take it over.
        `changed` of the names are given as changes against `committed` (the baseline's
        stored bits): the staged file holds them whole (`producer.changes`)."""
        src = safe_path(self.config.inbox, file)
        directory = self._root / f"v{version}"
        directory.mkdir(exist_ok=True)
        dest = directory / f"chunk-{index:06d}.safetensors"
        try:
            # Copy the file into a new inode of our own first and validate that copy: the
            # trainer can no longer change it (through a hard link, an open descriptor or a
            # mapping) or swap in a link between the check and the use.
            _take_copy(src, dest)
            header = read_header(dest)
            if len(set(names)) != len(names):
                raise ChunkFileError(f"chunk {index}: the request names a tensor twice")
            if changed and committed is None:
                raise ChunkFileError(
                    f"chunk {index}: the first export sends whole tensors, not changes"
                )
            metas = chunk_metas(index, header, names, changed, expected)
            if expected is not None:
                _require_expected(index, metas, expected, known or {})
            if changed and committed is not None:
                rebuild(dest, metas, changed, committed)
        except BaseException:
            with contextlib.suppress(OSError):
                src.unlink()  # a refused file must not keep shared memory
            dest.unlink(missing_ok=True)
            raise
        staged = StagedChunk(index, metas, dest, sum(m.nbytes for m in metas))
        with self._lock:
            self._chunks.setdefault(version, {})[index] = staged
        return staged

    def chunks(self, version: int) -> dict[int, StagedChunk]:
        with self._lock:
            return dict(self._chunks.get(version, {}))

    def export(self, version: int) -> Iterator[ExportChunk]:
        """The staged chunks of `version` in index order, loaded one at a time."""
        for index, staged in sorted(self.chunks(version).items()):
            del index
            yield staged.load()

    def drop(self, version: int) -> None:
        """Delete a version's staged files (committed, aborted or replaced)."""
        with self._lock:
            self._chunks.pop(version, None)
        shutil.rmtree(self._root / f"v{version}", ignore_errors=True)

    def drop_except(self, keep: set[int]) -> None:
        with self._lock:
            versions = [v for v in self._chunks if v not in keep]
        for v in versions:
            self.drop(v)

    def close(self) -> None:
        with self._lock:
            self._chunks.clear()
        shutil.rmtree(self._root, ignore_errors=True)


def _take_copy(src: Path, dest: Path) -> None:
    """Copy a regular file (never through a symlink) into a new file, then unlink the source."""
    try:
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:  # missing, a symlink (ELOOP), a directory...
        raise ChunkFileError(f"cannot take {src.name} from the inbox: {exc.strerror}") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ChunkFileError(f"{src.name} is not a regular file")
        out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "rb", closefd=False) as fin, os.fdopen(out, "wb") as fout:
                shutil.copyfileobj(fin, fout, 16 << 20)
        except BaseException:
            dest.unlink(missing_ok=True)
            raise
    finally:
        os.close(fd)
    src.unlink()


def _require_expected(
    index: int,
    metas: tuple[TensorMeta, ...],
    expected: tuple[TensorMeta, ...],
    known: Mapping[str, TensorMeta],
) -> None:
    """The chunk must be the baseline's chunk `index`; say which tensor broke it if one did."""
    diff = describe_difference(metas, expected)
    if diff is None:
        return
    changed = [m for m in metas if m.name in known and known[m.name] != m]
    unknown = [m.name for m in metas if m.name not in known]
    if changed or unknown:
        diff = describe_difference(metas, [known.get(m.name, m) for m in metas]) or ""
        if unknown:
            diff = "; ".join(filter(None, [diff, f"not in the baseline ({', '.join(unknown)})"]))
    raise CandidateMismatchError(f"chunk {index} does not match the baseline's chunk: {diff}")


def meta_chunk(index: int, metas: Sequence[TensorMeta]) -> ExportChunk:
    """A chunk of another producer for `SourceBaseline.load_initial`: metadata, no storage."""
    return ExportChunk(
        index, tuple((m.name, torch.empty(m.shape, dtype=m.dtype, device="meta")) for m in metas)
    )
