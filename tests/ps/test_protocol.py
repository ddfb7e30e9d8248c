"""Unit tests of the wire format, key placement and the PS configuration (no processes)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tagps.config import ConfigError, ps_config, server_optimizer_config
from tagps.ps.client import key_to_server
from tagps.ps.protocol import (
    HEADER_SIZE,
    DType,
    Op,
    ProtocolError,
    describe_node,
    dtype_code,
    numpy_dtype,
    pack_header,
    server_node_id,
    unpack_header,
    worker_node_id,
)

BASE = {
    "DMLC_ROLE": "worker",
    "DMLC_NUM_WORKER": "2",
    "DMLC_NUM_SERVER": "1",
    "DMLC_PS_ROOT_URI": "127.0.0.1",
    "DMLC_PS_ROOT_PORT": "9000",
    "DMLC_WORKER_ID": "1",
}


def test_header_round_trip() -> None:
    raw = pack_header(Op.PUSH, sender=11, key=(3 << 16) + 2, round=7, nbytes=4096, dtype=DType.FLOAT16)
    assert len(raw) == HEADER_SIZE == 36
    header = unpack_header(raw)
    assert (header.op, header.sender, header.key, header.round, header.nbytes) == (
        Op.PUSH,
        11,
        196610,
        7,
        4096,
    )
    assert numpy_dtype(header.dtype) == np.float16


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b[:-1], "header has 35 bytes"),
        (lambda b: b"XX" + b[2:], "bad magic"),
        (lambda b: b[:2] + bytes([9]) + b[3:], "protocol version 9"),
        (lambda b: b[:3] + bytes([99]) + b[4:], "unknown op 99"),
        (lambda b: b[:4] + bytes([77]) + b[5:], "unknown dtype code 77"),
        (lambda b: b[:5] + bytes([0x80]) + b[6:], "unknown flags"),
        (lambda b: b[:6] + b"\x01\x00" + b[8:], "reserved bits"),
    ],
)
def test_header_validation(mutate, message: str) -> None:
    good = pack_header(Op.PULL, sender=9, key=1, dtype=DType.FLOAT32)
    with pytest.raises(ProtocolError, match=message):
        unpack_header(mutate(good))


def test_dtype_codes() -> None:
    assert dtype_code(np.uint16) == DType.BFLOAT16
    with pytest.raises(TypeError, match="not supported"):
        dtype_code(np.complex64)


def test_node_ids() -> None:
    assert [server_node_id(r) for r in range(3)] == [8, 10, 12]
    assert [worker_node_id(r) for r in range(3)] == [9, 11, 13]
    assert (
        describe_node(11) == "worker 1"
        and describe_node(10) == "server 1"
        and describe_node(1) == "scheduler"
    )


def test_key_hash_functions_spread_keys() -> None:
    keys = [(i << 16) + c for i in range(64) for c in range(3)]
    for name in ("djb2", "sdbm", "naive"):
        ranks = [key_to_server(k, 4, name) for k in keys]
        assert set(ranks) == {0, 1, 2, 3}, name
        assert ranks == [key_to_server(k, 4, name) for k in keys]  # deterministic
    with pytest.raises(ValueError, match="balanced"):
        key_to_server(0, 4, "balanced")


def test_ps_config_defaults() -> None:
    config = ps_config(BASE)
    assert config.partition_bytes == 4096000
    assert config.engine_threads == 4
    assert config.key_hash_fn == "djb2"
    assert not config.enable_async and config.max_staleness is None
    assert "secret" not in repr(ps_config({**BASE, "TAGPS_PS_SECRET": "hunter2"}))


@pytest.mark.parametrize(
    ("override", "variable"),
    [
        ({"DMLC_ROLE": None}, "DMLC_ROLE"),
        ({"DMLC_ROLE": "chief"}, "DMLC_ROLE"),
        ({"DMLC_NUM_WORKER": "zero"}, "DMLC_NUM_WORKER"),
        ({"DMLC_NUM_SERVER": "0"}, "DMLC_NUM_SERVER"),
        ({"DMLC_PS_ROOT_URI": None}, "DMLC_PS_ROOT_URI"),
        ({"DMLC_PS_ROOT_PORT": "70000"}, "DMLC_PS_ROOT_PORT"),
        ({"DMLC_WORKER_ID": None}, "DMLC_WORKER_ID"),
        ({"DMLC_WORKER_ID": "2"}, "DMLC_WORKER_ID"),
        ({"BYTEPS_LOCAL_RANK": "1", "BYTEPS_LOCAL_SIZE": "1"}, "BYTEPS_LOCAL_RANK"),
        ({"BYTEPS_PARTITION_BYTES": "0"}, "BYTEPS_PARTITION_BYTES"),
        ({"BYTEPS_SERVER_ENGINE_THREAD": "-1"}, "BYTEPS_SERVER_ENGINE_THREAD"),
        ({"TAGPS_SERVER_IO_THREADS": "0"}, "TAGPS_SERVER_IO_THREADS"),
        ({"BYTEPS_ENABLE_ASYNC": "maybe"}, "BYTEPS_ENABLE_ASYNC"),
        ({"BYTEPS_KEY_HASH_FN": "md5"}, "BYTEPS_KEY_HASH_FN"),
        ({"BYTEPS_LOG_LEVEL": "LOUD"}, "BYTEPS_LOG_LEVEL"),
        ({"BYTEPS_TRACE_START_STEP": "5", "BYTEPS_TRACE_END_STEP": "4"}, "BYTEPS_TRACE_END_STEP"),
        ({"PS_HEARTBEAT_INTERVAL": "0"}, "PS_HEARTBEAT_INTERVAL"),
        ({"PS_HEARTBEAT_INTERVAL": "2", "PS_HEARTBEAT_TIMEOUT": "1"}, "PS_HEARTBEAT_TIMEOUT"),
        ({"PS_REGISTER_TIMEOUT": "0"}, "PS_REGISTER_TIMEOUT"),
        ({"PS_REGISTER_TIMEOUT": "inf"}, "PS_REGISTER_TIMEOUT"),
        ({"TAGPS_MAX_STALENESS": "-1"}, "TAGPS_MAX_STALENESS"),
        ({"BYTEPS_SCHEDULING_CREDIT": "0"}, "BYTEPS_SCHEDULING_CREDIT"),
    ],
)
def test_ps_config_errors_name_the_variable(override: dict[str, str | None], variable: str) -> None:
    env = {**BASE, **override}
    env = {k: v for k, v in env.items() if v is not None}
    with pytest.raises(ConfigError, match=variable):
        ps_config(env)


@pytest.mark.parametrize("workers", [1, 2, 64])
def test_server_io_threads_default_to_one_per_worker_within_the_cores(workers: int) -> None:
    env = {**BASE, "DMLC_NUM_WORKER": str(workers), "DMLC_WORKER_ID": "0"}
    config = ps_config(env)
    assert config.server_io_threads is None
    assert config.server_io_thread_count() == min(workers, len(os.sched_getaffinity(0)))
    assert ps_config({**env, "TAGPS_SERVER_IO_THREADS": "3"}).server_io_thread_count() == 3


def test_server_optimizer_config() -> None:
    assert server_optimizer_config({}).name == "none"
    adamw = server_optimizer_config({"TAGPS_SERVER_OPTIMIZER": "AdamW", "TAGPS_SERVER_BETAS": "0.8,0.9"})
    assert adamw.name == "adamw" and adamw.betas == (0.8, 0.9) and adamw.weight_decay == 0.01
    for env, variable in [
        ({"TAGPS_SERVER_OPTIMIZER": "lamb"}, "TAGPS_SERVER_OPTIMIZER"),
        ({"TAGPS_SERVER_LR": "-1"}, "TAGPS_SERVER_LR"),
        ({"TAGPS_SERVER_BETAS": "0.9"}, "TAGPS_SERVER_BETAS"),
        ({"TAGPS_SERVER_BETAS": "0.9,1.5"}, "TAGPS_SERVER_BETAS"),
        ({"TAGPS_SERVER_NESTEROV": "1"}, "TAGPS_SERVER_NESTEROV"),
    ]:
        with pytest.raises(ConfigError, match=variable):
            server_optimizer_config(env)
