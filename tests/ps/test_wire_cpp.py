"""The C++ wire format (csrc/net/wire.h) agrees with tagps/ps/protocol.py: same bytes, same reasons."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tagps import _core
from tagps.ps.protocol import Op, ProtocolError, pack_header, pack_workers, unpack_header, unpack_workers

pytestmark = pytest.mark.skipif(not _core.HAVE_NET, reason="tagps._core was built without libzmq (HAVE_NET)")


def _python(frame: bytes) -> tuple[int, ...] | str:
    try:
        h = unpack_header(frame)
    except ProtocolError as exc:
        return str(exc)
    return (h.op, h.dtype, h.flags, h.sender, h.key, h.round, h.nbytes)


def _cpp(frame: bytes) -> tuple[int, ...] | str:
    try:
        return tuple(_core.wire_unpack_header(frame))
    except ValueError as exc:
        return str(exc)


@given(
    op=st.sampled_from([int(op) for op in Op]),
    sender=st.integers(0, 2**32 - 1),
    key=st.integers(0, 2**64 - 1),
    round=st.integers(0, 2**64 - 1),
    nbytes=st.integers(0, 2**64 - 1),
    dtype=st.integers(0, 6),
    flags=st.integers(0, 15),
)
def test_pack_header_matches_python(op, sender, key, round, nbytes, dtype, flags) -> None:
    fields = {"sender": sender, "key": key, "round": round, "nbytes": nbytes, "dtype": dtype, "flags": flags}
    raw = pack_header(op, **fields)
    assert _core.wire_pack_header(op, **fields) == raw
    assert _cpp(raw) == _python(raw) == (op, dtype, flags, sender, key, round, nbytes)


valid = pack_header(Op.PUSH, sender=9, key=3, round=1, nbytes=8, dtype=1)


@given(
    frame=st.one_of(
        st.binary(max_size=40),
        st.binary(min_size=36, max_size=36),
        st.integers(0, 36 * 8 - 1).map(
            lambda bit: bytes(b ^ (1 << (bit % 8)) if i == bit // 8 else b for i, b in enumerate(valid))
        ),
        st.integers(0, 35).map(lambda cut: valid[:cut]),
    )
)
def test_unpack_header_agrees_with_python_on_any_frame(frame: bytes) -> None:
    assert _cpp(frame) == _python(frame)


@given(frame=st.binary(max_size=24), num_workers=st.integers(1, 5))
def test_unpack_workers_agrees_with_python(frame: bytes, num_workers: int) -> None:
    try:
        expected: object = list(unpack_workers(frame, num_workers))
    except ProtocolError as exc:
        expected = str(exc)
    try:
        got: object = _core.wire_unpack_workers(frame, num_workers)
    except ValueError as exc:
        got = str(exc)
    assert got == expected
    if isinstance(expected, list):
        assert pack_workers(tuple(expected)) == frame
