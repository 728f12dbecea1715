"""Declared state types (materializer.schema): the accepted forms, the value checks on write,
the evolution rules on restore, and the conversion of stored values (heap and LMDB tables,
from a materialized snapshot and from the log)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from pyspark.sql.types import (
    ArrayType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
)

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange
from dstl.errors import (
    ConfigError,
    ConfigTypeError,
    CorruptObjectError,
    StateSchemaError,
    StateTypeError,
)
from dstl.stores import MemoryBlobStore
from materializer.backend import ChangelogKeyedStateBackend
from materializer.changes import check_state_meta, decode_metadata
from materializer.handles import ChangelogStateBackendHandle
from materializer.options import BackendOptions
from materializer.schema import (
    compatibility_problems,
    compile_checker,
    conform,
    normalize_schema,
    type_string,
)
from materializer.states import (
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    ValueStateDescriptor,
)
from restore import ChangelogReader
from restore.restore import restore_backend

MP = 16
ALL = KeyGroupRange(0, MP - 1)
WAIT = 10.0
NO_TIMER = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None)
T = normalize_schema


# ----------------------------------------------------------------------------- declaring


@pytest.mark.parametrize("given,expected", [
    ("long", "long"), ("bigint", "long"), ("INT", "integer"), ("string", "string"),
    ("array<int>", "array<integer>"), ("map<string, double>", "map<string,double>"),
    ("count long, last string NOT NULL", "struct<count:long,last:string NOT NULL>"),
    ("struct<a: array<struct<b:binary>>>", "struct<a:array<struct<b:binary>>>"),
    ("`odd name` long", "struct<odd name:long>"),
    (StructType([StructField("n", LongType()), StructField("tags", ArrayType(StringType()))]),
     "struct<n:long,tags:array<string>>"),
    (MapType(StringType(), IntegerType(), False), "map<string,integer>"),
    (LongType(), "long"),
    ({"type": "array", "elementType": "long", "containsNull": False}, "array<long>"),
])
def test_a_type_is_declared_by_name_ddl_pyspark_type_or_json(given: Any, expected: str) -> None:
    t = normalize_schema(given)
    assert type_string(t) == expected
    assert normalize_schema(t) == t  # the recorded form declares the same type
    json.dumps(t)


def test_the_recorded_form_is_the_one_pyspark_reads() -> None:
    st = StructType([StructField("n", LongType(), False), StructField("s", StringType())])
    assert StructType.fromJson(normalize_schema("n long NOT NULL, s string")) == st


@pytest.mark.parametrize("bad,error,says", [
    ("decimal(10,2)", ConfigError, "unexpected"),
    ("timestamp", ConfigError, "'timestamp' is not a supported type"),
    ("a long,", ConfigError, "expected more"),
    ("array<long", ConfigError, "expected >"),
    ("", ConfigError, "empty"),
    ("a long, a string", ConfigError, "appears twice"),
    ({"type": "struct", "fields": "x"}, ConfigError, "list of fields"),
    (42, ConfigTypeError, "a type name, a DDL string"),
])
def test_an_unsupported_type_is_a_config_error_naming_the_supported_ones(
        bad: Any, error: type, says: str) -> None:
    with pytest.raises(error) as e:
        ValueStateDescriptor("s", schema=bad)
    assert says in str(e.value)
    assert "ValueStateDescriptor.schema" in str(e.value)
    assert "array<T>" in str(e.value)


# ----------------------------------------------------------------------------- rule 1: values


@pytest.mark.parametrize("declared,fits,misfits", [
    ("long", [0, -(1 << 63), (1 << 63) - 1], [True, 1.0, "1", None, 1 << 63]),
    ("byte", [127, -128], [128, -129]),
    ("double", [1.5, 2], ["2.0", False]),
    ("boolean", [True, False], [1, "true"]),
    ("string", ["x", ""], [b"x", 1]),
    ("binary", [b"x"], ["x", bytearray(b"x")]),
    ("array<long>", [[1, 2], (3,), [None]], [{1}, [1, "2"], "12"]),
    ("array<long>", [[]], [[1.0]]),
    ("map<string,long>", [{"a": 1}, {"a": None}], [{"a": "1"}, {1: 1}, [("a", 1)]]),
    ("a long NOT NULL, b string", [{"a": 1, "b": "x"}, {"a": 1}, {"a": 1, "b": None}],
     [{"b": "x"}, {"a": None}, {"a": 1, "c": 2}, (1, "x")]),
])
def test_a_value_fits_its_declared_type_by_rule_1(declared: str, fits: list[Any],
                                                   misfits: list[Any]) -> None:
    check = compile_checker(T(declared))
    for v in fits:
        assert check(v) is None, v
    for v in misfits:
        if v is None:
            continue  # a state's own value is never null: the state object refuses it
        assert check(v) is not None, v


# ----------------------------------------------------------------------------- rule 2: evolution


@pytest.mark.parametrize("old,new", [
    ("count long", "count long, last string"),                  # a nullable field added
    ("count long, last string", "count long"),                  # a field removed
    ("a long, b string", "b string, a long"),                   # fields moved
    ("integer", "long"), ("byte", "short"), ("short", "double"), ("float", "double"),
    ("long", "double"), ("integer", "float"),                   # widened
    ("a long NOT NULL", "a long"),                              # NOT NULL -> nullable
    ("array<int>", "array<long>"), ("map<string,int>", "map<string,long>"),
    ("a struct<x:int>", "a struct<x:long, y:string>"),          # nested
])
def test_compatible_changes_by_rule_2(old: str, new: str) -> None:
    assert compatibility_problems(T(old), T(new)) == []


@pytest.mark.parametrize("old,new,says", [
    ("long", "integer", "narrowed from long to integer"),
    ("double", "float", "narrowed"),
    ("long", "string", "changed from long to string"),
    ("a long", "long", "changed from struct<a:long> to long"),
    ("a long", "a long, b string NOT NULL", "'b': added as NOT NULL"),
    ("a long", "a long NOT NULL", "nullable became NOT NULL"),
    ("map<string,long>", "map<long,long>", "a map's key type cannot change"),
    ("array<long>", "array<int>", "field '[]': narrowed"),
    ("a struct<x:long>", "a struct<x:string>", "field 'a.x': changed from long to string"),
    ("a map<string,long>", "a map<string,int>", "field 'a{}': narrowed from long to integer"),
])
def test_incompatible_changes_by_rule_2_say_what(old: str, new: str, says: str) -> None:
    problems = compatibility_problems(T(old), T(new))
    assert any(says in p for p in problems), problems


def test_conform_converts_values_of_a_compatible_older_type_by_rule_3() -> None:
    new = T("count double, last string, tags array<struct<x:double, y:long>>")
    v = {"count": 3, "gone": "x", "tags": [{"x": 1, "y": 2, "z": 0}]}
    assert conform(v, new) == ({"count": 3.0, "last": None,
                                "tags": [{"x": 1.0, "y": 2}]}, True)
    same = {"count": 1.5, "last": "a", "tags": []}
    out, changed = conform(same, new)
    assert out is same and not changed
    assert conform(7, T("long")) == (7, False)
    assert conform(7, T("double"))[0] == 7.0
    assert type(conform(7, T("double"))[0]) is float


# ----------------------------------------------------------------------------- the backend


@pytest.fixture(params=["heap", "lmdb"])
def table(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def storage() -> Iterator[ChangelogStorage]:
    s = ChangelogStorage(store=MemoryBlobStore(), options=DstlOptions(persist_delay_s=0.0))
    yield s
    s.close()


def _backend(storage: ChangelogStorage, table: str) -> ChangelogKeyedStateBackend:
    return ChangelogKeyedStateBackend(storage, "op/0", ALL, MP, table=table, options=NO_TIMER)


_cp = iter(range(1, 10**6))


def _checkpoint(b: ChangelogKeyedStateBackend, *, materialize: bool
                ) -> ChangelogStateBackendHandle:
    if materialize:
        assert b.materialize_now(WAIT) is not None
    cp = next(_cp)
    h = b.snapshot(cp).result(WAIT)
    b.notify_checkpoint_complete(cp)
    b.close()
    return h


def _restore(storage: ChangelogStorage, h: ChangelogStateBackendHandle,
             table: str) -> ChangelogKeyedStateBackend:
    return restore_backend([h], storage, ALL, table=table, options=NO_TIMER)


@pytest.mark.parametrize("descriptor,write,bad", [
    (lambda: ValueStateDescriptor("s", schema="long"), lambda s, v: s.update(v), {"n": 1}),
    (lambda: ListStateDescriptor("s", schema="long"), lambda s, v: s.add_all([1, v]), "2"),
    (lambda: MapStateDescriptor("s", schema="n long"), lambda s, v: s.put("k", v), {"n": "1"}),
    (lambda: ReducingStateDescriptor("s", lambda a, b: b, schema="long"),
     lambda s, v: s.add(v), 1.5),
    (lambda: AggregatingStateDescriptor("s", _Last(), schema="long"),
     lambda s, v: s.add(v), [1]),
    (lambda: ValueStateDescriptor("s", schema="long", ttl_s=60.0),
     lambda s, v: s.update(v), "x"),
])
def test_a_write_that_does_not_fit_is_a_type_error_naming_state_key_and_types(
        storage: ChangelogStorage, table: str, descriptor: Any, write: Any, bad: Any) -> None:
    b = _backend(storage, table)
    s = b.get_state(descriptor())
    b.set_current_key("user-7")
    write(s, 1 if not isinstance(s.descriptor, MapStateDescriptor) else {"n": 1})
    with pytest.raises(StateTypeError) as e:
        write(s, bad)
    err = e.value
    assert isinstance(err, TypeError)
    assert (err.state, err.key, err.value_type) == ("s", "user-7", type(bad).__name__)
    assert f"state 's', key 'user-7': a value of type {type(bad).__name__} does not fit " \
           "the declared type" in str(err)
    b.close()


class _Last:
    def create_accumulator(self) -> Any:
        return 0

    def add(self, value: Any, acc: Any) -> Any:
        return value

    def get_result(self, acc: Any) -> Any:
        return acc

    def merge(self, a: Any, b: Any) -> Any:
        return b


def _meta_of(b: ChangelogKeyedStateBackend, name: str) -> dict[str, Any]:
    return next(m for m in b.state_metadata().values() if m["name"] == name)


def _metadata(storage: ChangelogStorage, h: ChangelogStateBackendHandle) -> list[dict[str, Any]]:
    return [decode_metadata(p)[1] for part in h.non_materialized
            for kg, p in ChangelogReader(storage).read(part) if kg == -1]


def test_the_declared_type_is_recorded_and_an_undeclared_state_records_none(
        storage: ChangelogStorage) -> None:
    b = _backend(storage, "heap")
    typed = b.get_state(ValueStateDescriptor("typed", schema="n long"))
    free = b.get_state(ValueStateDescriptor("free"))
    b.set_current_key("k")
    typed.update({"n": 1})
    free.update({"anything": [1, "x"]})
    metas = {m["name"]: m for m in _metadata(storage, _checkpoint(b, materialize=False))}
    assert metas["typed"]["schema"] == {"format": 1, "type": T("n long")}
    assert "schema" not in metas["free"]                       # as before declared types


@pytest.mark.parametrize("materialize", [True, False], ids=["snapshot", "log"])
def test_a_compatible_change_restores_and_converts_the_stored_values(
        storage: ChangelogStorage, table: str, materialize: bool) -> None:
    b = _backend(storage, table)
    s = b.get_state(ValueStateDescriptor("s", schema="count int, gone string"))
    lst = b.get_state(ListStateDescriptor("l", schema="int"))
    ttl = b.get_state(MapStateDescriptor("m", schema="a int", ttl_s=3600.0))
    for i in range(20):
        b.set_current_key(f"k{i}")
        s.update({"count": i, "gone": "x"})
        lst.add_all([i, i + 1])
        ttl.put("x", {"a": i})
    h = _checkpoint(b, materialize=materialize)

    r = _restore(storage, h, table)
    s2 = r.get_state(ValueStateDescriptor("s", schema="count long, last string"))
    l2 = r.get_state(ListStateDescriptor("l", schema="double"))
    m2 = r.get_state(MapStateDescriptor("m", schema="a long, b string", ttl_s=3600.0))
    for i in range(20):
        r.set_current_key(f"k{i}")
        assert s2.value() == {"count": i, "last": None}
        assert l2.get() == [float(i), float(i + 1)]
        assert all(type(x) is float for x in l2.get())
        assert m2.get("x") == {"a": i, "b": None}      # a TTL state's values convert too
    r.set_current_key("k0")
    s2.update({"count": 1 << 40, "last": "y"})            # a long fits now
    h2 = _checkpoint(r, materialize=False)
    metas = {m["name"]: m for m in _metadata(storage, h2)}
    assert metas["s"]["schema"]["type"] == T("count long, last string")

    # The conversion was logged: the next restore reads converted values with nothing to do.
    r2 = _restore(storage, h2, table)
    assert _meta_of(r2, "s")["schema"]["type"] == T("count long, last string")
    s3 = r2.get_state(ValueStateDescriptor("s", schema="count long, last string"))
    r2.set_current_key("k0")
    assert s3.value() == {"count": 1 << 40, "last": "y"}
    r2.set_current_key("k5")
    assert s3.value() == {"count": 5, "last": None}
    r2.close()


def test_an_incompatible_change_is_refused_at_restore_naming_both_types_and_the_fix(
        storage: ChangelogStorage, table: str) -> None:
    b = _backend(storage, table)
    s = b.get_state(ValueStateDescriptor("count", schema="long"))
    b.set_current_key("k")
    s.update(3)
    r = _restore(storage, _checkpoint(b, materialize=True), table)
    with pytest.raises(StateSchemaError) as e:
        r.get_state(ValueStateDescriptor("count", schema="total long, seen string"))
    err = e.value
    assert (err.state, err.recorded, err.declared) == (
        "count", "long", "struct<total:long,seen:string>")
    msg = str(err)
    assert "state 'count' of backend 'op/0' was written with the type long and is declared " \
           "struct<total:long,seen:string> now" in msg
    assert "changed from long to struct<total:long,seen:string>" in msg
    assert "new state name" in msg and "delete_if_exists" in msg
    # the old declaration still opens it, with its value
    s2 = r.get_state(ValueStateDescriptor("count", schema="long"))
    r.set_current_key("k")
    assert s2.value() == 3
    r.close()


def test_declaring_a_type_over_undeclared_values_checks_them(
        storage: ChangelogStorage, table: str) -> None:
    b = _backend(storage, table)
    s = b.get_state(ValueStateDescriptor("count"))
    for i, v in enumerate([1, 2, {"was": "a dict"}]):
        b.set_current_key(f"k{i}")
        s.update(v)
    h = _checkpoint(b, materialize=True)
    r = _restore(storage, h, table)
    with pytest.raises(StateSchemaError) as e:
        r.get_state(ValueStateDescriptor("count", schema="long"))
    assert e.value.recorded is None
    assert "key 'k2': a dict (a dict is not an integer)" in str(e.value)
    assert "holds values written without a declared type that do not fit it" in str(e.value)
    r.close()
    ok = _restore(storage, h, table)
    s2 = ok.get_state(ValueStateDescriptor("count"))   # undeclared: as before
    ok.set_current_key("k2")
    assert s2.value() == {"was": "a dict"}
    ok.close()


def test_dropping_the_declaration_opens_the_state_as_undeclared(
        storage: ChangelogStorage, table: str) -> None:
    b = _backend(storage, table)
    s = b.get_state(ValueStateDescriptor("s", schema="long"))
    b.set_current_key("k")
    s.update(1)
    r = _restore(storage, _checkpoint(b, materialize=False), table)
    s2 = r.get_state(ValueStateDescriptor("s"))
    r.set_current_key("k")
    s2.update("now a string")
    assert "schema" not in _meta_of(r, "s")
    r.close()


def test_a_malformed_recorded_type_is_corruption() -> None:
    meta = {"name": "s", "kind": "value", "schema": {"format": 1, "type": "decimal"}}
    with pytest.raises(CorruptObjectError, match="state 's' has a malformed declared type"):
        check_state_meta(meta, key="seg", offset=3, what="metadata record")
    with pytest.raises(CorruptObjectError, match="schema format 2"):
        check_state_meta({**meta, "schema": {"format": 2, "type": "long"}}, key="seg", offset=3,
                         what="metadata record")
    deep: Any = "long"
    for _ in range(40):
        deep = {"type": "array", "elementType": deep, "containsNull": True}
    with pytest.raises(CorruptObjectError, match="nested deeper"):
        check_state_meta({**meta, "schema": {"format": 1, "type": deep}}, key="seg", offset=3,
                         what="metadata record")
