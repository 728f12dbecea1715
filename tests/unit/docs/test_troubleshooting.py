"""docs/troubleshooting.md has an entry for every error class a user can meet, and the messages
it shows are the ones DSTL raises."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import dstl.errors
import dstl.reader.errors
from dstl import ChangelogHandle, ChangelogStorage, KeyGroupRange
from dstl.checkpoint.coordinator import CheckpointCommitError
from dstl.checkpoint.manifest import CorruptManifestError
from dstl.errors import ConfigTypeError, KeyGroupError, UnsafeHandleKeyError
from dstl.spark.agent.protocol import AgentUnavailableError

PAGE = Path(__file__).resolve().parents[3] / "docs" / "troubleshooting.md"


def _classes(module: object) -> set[str]:
    return {name for name, obj in inspect.getmembers(module, inspect.isclass)
            if issubclass(obj, dstl.errors.DstlError) and obj.__module__ == module.__name__}  # type: ignore[attr-defined]


def _entries() -> set[str]:
    return set(re.findall(r"^### `(\w+)`$", PAGE.read_text(), re.M))


def test_every_error_class_has_an_entry() -> None:
    wanted = (_classes(dstl.errors) | _classes(dstl.reader.errors)
              | {c.__name__ for c in (CheckpointCommitError, CorruptManifestError,
                                      AgentUnavailableError)})
    wanted.discard("DstlError")  # the root: the page's introduction
    missing = wanted - _entries()
    assert not missing, f"docs/troubleshooting.md: add an entry (### `Name`) for {sorted(missing)}"
    assert _classes(dstl.errors) >= {"ConfigError", "StorageError", "ProcessorError"}


def _shown(message: str) -> None:
    assert f"```\n{message}\n```" in PAGE.read_text(), f"not on the page verbatim: {message}"


def test_the_page_shows_the_messages_dstl_raises(tmp_path: Path) -> None:
    with ChangelogStorage(str(tmp_path / "store")) as storage:
        writer = storage.create_writer("w", KeyGroupRange(0, 15))
        with pytest.raises(ConfigTypeError) as typed:
            writer.truncate("a")  # type: ignore[arg-type]
        _shown(str(typed.value))
        with pytest.raises(KeyGroupError) as outside:
            writer.append(16, b"x")
        _shown(str(outside.value))
        writer.append(1, b"x")
        handle = writer.persist(0, 1).result()
        writer.close()
    forged = re.sub(r'"dstl/[^"]+"', '"../x"', handle.to_json(), count=1)
    with pytest.raises(UnsafeHandleKeyError) as unsafe:
        ChangelogHandle.from_json(forged)
    _shown(str(unsafe.value))
