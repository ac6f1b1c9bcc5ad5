"""The pgoutput decoder against messages built byte by byte as PostgreSQL's protocol chapter lays them out.

A real server's stream is decoded by the WAL capture's integration tests; here every message kind, every tuple
column kind, and truncation anywhere in a message (a clear DecodeError, never another exception)."""

from __future__ import annotations

import struct
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bridge.capture.pgoutput import (
    PG_EPOCH,
    UNCHANGED,
    Begin,
    Change,
    Column,
    Commit,
    DecodeError,
    LogicalMessage,
    Relation,
    Skipped,
    Value,
    begin_xid,
    commit_fields,
    decode,
    lsn_text,
    new_row,
    parse_lsn,
    pg_time,
)


def _s(text: str) -> bytes:
    return text.encode() + b"\x00"


def _ts(when: datetime) -> bytes:
    delta = when - PG_EPOCH
    return struct.pack("!q", (delta.days * 86400 + delta.seconds) * 1_000_000 + delta.microseconds)


def _tuple(values: tuple[Value, ...]) -> bytes:
    out = struct.pack("!h", len(values))
    for v in values:
        if v is None:
            out += b"n"
        elif v is UNCHANGED:
            out += b"u"
        else:
            assert isinstance(v, str)
            raw = v.encode()
            out += b"t" + struct.pack("!i", len(raw)) + raw
    return out


values = st.tuples() | st.lists(st.one_of(st.none(), st.just(UNCHANGED), st.text(max_size=20)),
                                max_size=8).map(tuple)
when = st.datetimes(min_value=datetime(2000, 1, 2), max_value=datetime(2100, 1, 1)).map(lambda d: d.replace(tzinfo=UTC))


@given(st.integers(0, 2**64 - 1), when, st.integers(0, 2**32 - 1))
def test_begin(lsn: int, at: datetime, xid: int) -> None:
    assert decode(b"B" + struct.pack("!Q", lsn) + _ts(at) + struct.pack("!I", xid)) == Begin(lsn, at, xid)


@given(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), when)
def test_commit(commit_lsn: int, end_lsn: int, at: datetime) -> None:
    raw = b"C" + b"\x00" + struct.pack("!QQ", commit_lsn, end_lsn) + _ts(at)
    assert decode(raw) == Commit(commit_lsn, end_lsn, at)


def test_relation() -> None:
    raw = (b"R" + struct.pack("!I", 16384) + _s("public") + _s("task_instance") + b"d" + struct.pack("!h", 2)
           + b"\x01" + _s("id") + struct.pack("!Ii", 23, -1) + b"\x00" + _s("state") + struct.pack("!Ii", 25, -1))
    assert decode(raw) == Relation(16384, "public", "task_instance", "d",
                                   (Column("id", 23, True), Column("state", 25, False)))


@given(values)
def test_insert(new: tuple[Value, ...]) -> None:
    assert decode(b"I" + struct.pack("!I", 7) + b"N" + _tuple(new)) == Change("insert", 7, new, None)


@given(values, st.one_of(st.none(), values), st.sampled_from([b"K", b"O"]))
def test_update(new: tuple[Value, ...], old: tuple[Value, ...] | None, marker: bytes) -> None:
    raw = b"U" + struct.pack("!I", 7) + (b"" if old is None else marker + _tuple(old)) + b"N" + _tuple(new)
    assert decode(raw) == Change("update", 7, new, old, old is not None and marker == b"O")


@given(values)
def test_delete(old: tuple[Value, ...]) -> None:
    assert decode(b"D" + struct.pack("!I", 7) + b"K" + _tuple(old)) == Change("delete", 7, None, old, False)


@pytest.mark.parametrize("tag", [b"O", b"Y", b"T"])
def test_messages_capture_does_not_use_are_skipped(tag: bytes) -> None:
    assert decode(tag + b"\x00" * 12) == Skipped(tag.decode())


@given(st.booleans(), st.integers(0, 2**64 - 1), st.text(alphabet=st.characters(blacklist_characters="\x00",
                                                                                 blacklist_categories=("Cs",))),
       st.binary(max_size=30))
def test_logical_message(transactional: bool, lsn: int, prefix: str, content: bytes) -> None:
    raw = b"M" + (b"\x01" if transactional else b"\x00") + struct.pack("!Q", lsn) + _s(prefix) \
        + struct.pack("!i", len(content)) + content
    assert decode(raw) == LogicalMessage(transactional, lsn, prefix, content)


@given(values, st.data())
def test_a_truncated_message_is_a_decode_error(new: tuple[Value, ...], data: st.DataObject) -> None:
    raw = b"I" + struct.pack("!I", 7) + b"N" + _tuple(new)
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(DecodeError):
        decode(raw[:cut])


def test_unknown_tags_and_binary_tuples_are_decode_errors() -> None:
    with pytest.raises(DecodeError, match="unknown message tag"):
        decode(b"Z")
    with pytest.raises(DecodeError, match="binary tuples"):
        decode(b"I" + struct.pack("!I", 7) + b"N" + struct.pack("!h", 1) + b"b" + struct.pack("!i", 1) + b"x")


# --- read in place: what the WAL capture reads of every captured transaction, as decode reads it ------------------

@given(st.integers(0, 2**64 - 1), when, st.integers(0, 2**32 - 1))
def test_begin_xid_reads_what_decode_reads(lsn: int, at: datetime, xid: int) -> None:
    raw = b"B" + struct.pack("!Q", lsn) + _ts(at) + struct.pack("!I", xid)
    begin = decode(raw)
    assert isinstance(begin, Begin)
    assert begin_xid(raw) == begin.xid == xid
    with pytest.raises(DecodeError):
        begin_xid(raw[:-1])


@given(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), when)
def test_commit_fields_read_what_decode_reads(commit_lsn: int, end_lsn: int, at: datetime) -> None:
    raw = b"C" + b"\x00" + struct.pack("!QQ", commit_lsn, end_lsn) + _ts(at)
    lsn, end, micros = commit_fields(raw)
    assert Commit(lsn, end, pg_time(micros)) == decode(raw) == Commit(commit_lsn, end_lsn, at)
    with pytest.raises(DecodeError):
        commit_fields(raw[:-1])


@given(values, st.one_of(st.none(), values), st.sampled_from([b"I", b"U"]))
def test_new_row_reads_a_change_with_only_its_new_tuple_as_decode_does(
        new: tuple[Value, ...], old: tuple[Value, ...] | None, tag: bytes) -> None:
    old_part = b"" if old is None or tag == b"I" else b"K" + _tuple(old)
    raw = tag + struct.pack("!I", 7) + old_part + b"N" + _tuple(new)
    change = decode(raw)
    assert isinstance(change, Change)
    if old_part:  # an old tuple first: left to decode
        assert new_row(raw) is None
    else:
        assert new_row(raw) == (7, change.kind, change.new)
    assert new_row(b"D" + struct.pack("!I", 7) + b"K" + _tuple(new)) is None


@given(values, st.data())
def test_new_row_of_a_truncated_message_is_a_decode_error_or_left_to_decode(new: tuple[Value, ...],
                                                                          data: st.DataObject) -> None:
    raw = b"U" + struct.pack("!I", 7) + b"N" + _tuple(new)
    cut = raw[:data.draw(st.integers(0, len(raw) - 1))]
    try:
        assert new_row(cut) is None
    except DecodeError:
        return
    with pytest.raises(DecodeError):  # and decode says what is wrong
        decode(cut)


@given(st.integers(0, 2**64 - 1))
def test_lsn_text_round_trips(lsn: int) -> None:
    assert parse_lsn(lsn_text(lsn)) == lsn


def test_lsn_text_is_postgresqls() -> None:
    assert lsn_text(parse_lsn("16/B374D848")) == "16/B374D848"
    assert decode(b"B" + struct.pack("!Q", 0) + _ts(PG_EPOCH + timedelta(seconds=1)) + struct.pack("!I", 1)) == \
        Begin(0, PG_EPOCH + timedelta(seconds=1), 1)


@given(st.text())
def test_the_captures_event_ids_are_the_uuid5_of_their_seed(seed: str) -> None:
    """The WAL capture derives a change's event id from its commit LSN and place (a change streamed again gets the
    same id): the hand-built version must be ``uuid.uuid5`` exactly, or a relay upgraded between a crash and its
    restart would publish the replayed changes under new ids."""
    import uuid

    from bridge.capture.wal import _EVENT_NAMESPACE, event_id

    assert event_id(seed) == str(uuid.uuid5(_EVENT_NAMESPACE, seed))
