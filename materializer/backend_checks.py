"""The arguments of a keyed backend (and of ``restore_backend``), checked before anything is
opened: one place for their types, ranges and combinations, each refusal naming the argument
and its fix."""

from __future__ import annotations

from dstl.checks import (
    check_bool,
    check_choice,
    check_instance,
    check_int,
    check_optional_path,
    check_protocol,
    check_str,
)
from dstl.errors import ConfigError, UsageError
from dstl.keygroups import MAX_PARALLELISM_LIMIT, KeyGroupRange
from dstl.stores.base import check_store
from dstl.timer import check_timer
from materializer.codecs import check_codec
from materializer.options import BackendOptions

__all__ = ["check_arguments", "check_layout", "check_local", "check_storage"]


def check_layout(key_groups: object, max_parallelism: object, owner: str,
                 table: object = "heap") -> None:
    """The table kind, key groups and max parallelism of a backend (shared with
    ``restore_backend``).

    Raises:
        ConfigError: a wrong type (ConfigTypeError) or value; key groups beyond
            ``max_parallelism`` blame ``key_groups``.
    """
    check_choice(table, "table", owner, ("heap", "lmdb"))
    check_instance(key_groups, "key_groups", owner, KeyGroupRange,
                   fix="e.g. dstl.KeyGroupRange.of_operator(max_parallelism, parallelism, index)")
    check_int(max_parallelism, "max_parallelism", owner, lo=1, hi=MAX_PARALLELISM_LIMIT)
    assert isinstance(key_groups, KeyGroupRange) and isinstance(max_parallelism, int)
    if key_groups.end >= max_parallelism:
        raise ConfigError("key_groups", str(key_groups), f"a range within [0, "
                          f"{max_parallelism - 1}] (max_parallelism={max_parallelism})",
                          owner=owner)


def check_arguments(storage: object, operator_id: object, key_groups: object,
                    max_parallelism: object, table: object, options: object,
                    key_codec: object, local_directory: object, timer: object,
                    clear_local: object, adopt_local: object,
                    auto_materialize: object) -> BackendOptions:
    """The backend constructor's arguments, checked before anything is opened (one place);
    returns the options to use."""
    owner = "ChangelogKeyedStateBackend"
    check_storage(storage, "storage", owner)
    check_str(operator_id, "operator_id", owner, fix="unique per backend in its storage and "
              "stable across restarts")
    check_layout(key_groups, max_parallelism, owner, table)
    if options is not None:
        check_instance(options, "options", owner, BackendOptions)
    check_codec(key_codec, "key_codec", owner)
    check_optional_path(local_directory, "local_directory", owner)
    check_timer(timer, "timer", owner)
    check_bool(clear_local, "clear_local", owner)
    check_bool(adopt_local, "adopt_local", owner)
    check_bool(auto_materialize, "auto_materialize", owner)
    return options if isinstance(options, BackendOptions) else BackendOptions()


def check_storage(storage: object, field: str, owner: str) -> None:
    """A :class:`~dstl.ChangelogStorage` (or one shaped like it: a ``store`` and
    ``create_writer``)."""
    check_protocol(storage, field, owner, ("create_writer",),
                   "a dstl.ChangelogStorage", fix="create one per process: "
                   "dstl.ChangelogStorage(uri)")
    check_store(getattr(storage, "store", None), f"{field}.store", owner)


def check_local(operator_id: str, table: str, local_directory: str | None, clear_local: bool,
                adopt_local: bool) -> None:
    """``adopt_local`` only with an LMDB table in a given directory that is kept.

    Raises:
        UsageError: names the argument that makes adopting impossible.
    """
    if not adopt_local:
        return
    why = ("table='heap' has nothing on disk" if table != "lmdb"
           else "no local_directory was given (a new temporary directory holds no table)"
           if local_directory is None
           else "clear_local=True removes the table it would adopt" if clear_local else None)
    if why is not None:
        raise UsageError(f"backend {operator_id!r}: adopt_local=True opens an existing LMDB "
                         f"table, but {why}; drop adopt_local or fix the other argument")
