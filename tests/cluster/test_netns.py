"""tagps.cluster: namespaces on a bridge, tc limits that hold, teardown that leaves nothing behind.

The tests that build networks need root and network namespaces; they skip with the reason otherwise.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys
import textwrap
from collections.abc import Callable

import pytest

from tagps.cluster import NETWORK, ClusterError, LinkLimit, Network, check_support, down_all, up
from tagps.cluster import netns as netns_module

NamesOf = Callable[[int], list[str]]


@pytest.fixture(scope="module")
def netns() -> None:
    """Skip, with the reason, where this process cannot build networks (not root, no iproute2, no netns)."""
    try:
        check_support()
        with up(["probe"]):
            pass
    except ClusterError as exc:
        pytest.skip(f"needs root and network namespaces: {exc}")


# Receiver: accept one connection, count bytes, print {"bytes", "seconds"} from first to last byte.
SINK = textwrap.dedent(
    """
    import json, socket, sys, time
    srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
    print("ready", flush=True)
    conn, _ = srv.accept()
    n, first = 0, None
    while data := conn.recv(1 << 20):
        first = first or time.monotonic()
        n += len(data)
    print(json.dumps({"bytes": n, "seconds": time.monotonic() - first}), flush=True)
    """
)
SOURCE = textwrap.dedent(
    """
    import socket, sys
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
    chunk = bytes(range(256)) * 4096
    for _ in range(int(sys.argv[3])):
        s.sendall(chunk)
    s.close()
    """
)
ECHO = textwrap.dedent(
    """
    import socket, sys
    srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
    print("ready", flush=True)
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while data := conn.recv(64):
        conn.sendall(data)
    """
)
PING = textwrap.dedent(
    """
    import socket, sys, time
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(5):
        t = time.monotonic()
        s.sendall(b"x")
        s.recv(1)
        rtts.append(time.monotonic() - t)
    print(min(rtts))
    """
)


def _serve(net: Network, node: str, script: str, *args: str) -> subprocess.Popen:
    proc = net.popen(node, [sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.netns
@pytest.mark.timeout(60)
@pytest.mark.usefixtures("netns")
@pytest.mark.parametrize("rate_mbit", [80.0])
def test_rate_limit_holds_and_teardown_is_complete(rate_mbit: float, netns_names: NamesOf) -> None:
    with up(["a", "b"], LinkLimit(rate_mbit=rate_mbit)) as net:
        index = net.index
        assert all(ipaddress.ip_address(net.address(n)) in NETWORK for n in ("a", "b"))
        assert sorted(netns_names(index)) == sorted(
            [
                f"tagps-{index}-a",
                f"tagps-{index}-b",
                f"tagps-{index}b",
                f"tagps-{index}v0",
                f"tagps-{index}v1",
            ]
        )
        sink = _serve(net, "b", SINK, net.address("b"), "5001")
        megabytes = int(rate_mbit / 8 * 1.5)  # about 1.5 s at the limit
        net.run(
            "a",
            [sys.executable, "-c", SOURCE, net.address("b"), "5001", str(megabytes)],
            check=True,
            timeout=30,
        )
        out, _ = sink.communicate(timeout=30)
        result = json.loads(out)
        assert result["bytes"] == megabytes << 20
        measured = result["bytes"] * 8 / result["seconds"] / 1e6
        assert abs(measured - rate_mbit) <= 0.2 * rate_mbit, (
            f"{measured:.1f} Mbit/s through a {rate_mbit} limit"
        )
    assert netns_names(index) == []


@pytest.mark.netns
@pytest.mark.timeout(60)
@pytest.mark.usefixtures("netns")
def test_receiving_on_a_shaped_link_costs_little_cpu() -> None:
    # A token bucket smaller than a GSO packet cuts it into MTU-sized segments, and the receiver's TCP stack
    # then took 0.2-0.6 of a core at these rates (8-20 ns a byte); whole GSO packets cost about a tenth.
    from tagps.cluster.measure import measure_pair

    with up(["a", "b"], LinkLimit(rate_mbit=300.0)) as net:
        m = measure_pair(
            lambda argv: net.exec_argv("b", argv),
            lambda argv: net.exec_argv("a", argv),
            net.address("b"),
            5003,
            seconds=1.0,
        )
    assert 0.8 * 300e6 / 8 <= m.bandwidth_Bps <= 1.1 * 300e6 / 8
    rate = m.bandwidth_Bps * 8e-6
    assert m.rx_cpu_cores < 0.12, f"receiving {rate:.0f} Mbit/s took {m.rx_cpu_cores:.2f} cores"


@pytest.mark.netns
@pytest.mark.usefixtures("netns")
def test_delay_adds_to_the_round_trip() -> None:
    try:
        net = up({"a": LinkLimit(delay_ms=15), "b": LinkLimit(delay_ms=10)})
    except ClusterError as exc:
        if "netem" not in str(exc):
            raise
        pytest.skip(str(exc))
    with net:
        echo = _serve(net, "b", ECHO, net.address("b"), "5002")
        rtt = float(
            net.run(
                "a",
                [sys.executable, "-c", PING, net.address("b"), "5002"],
                check=True,
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout
        )
        echo.kill()
        echo.communicate(timeout=30)
    assert 0.025 <= rtt < 0.045


@pytest.mark.netns
@pytest.mark.usefixtures("netns")
def test_down_all_cleans_up_after_a_crash(netns_names: NamesOf) -> None:
    # A process builds a network, starts a process inside it, and is SIGKILLed: nothing ran down().
    crasher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
            import sys, time
            from tagps.cluster import up
            net = up(["x", "y"])
            net.popen("x", ["sleep", "120"])
            print(net.index, flush=True)
            time.sleep(120)
            """
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert crasher.stdout is not None
        index = int(crasher.stdout.readline())
    finally:
        crasher.kill()
        crasher.wait(timeout=30)
        crasher.stdout.close()  # type: ignore[union-attr]  # `sleep` inside the network still holds it
    assert len(netns_names(index)) == 5
    removed = down_all(index)
    assert {f"tagps-{index}-x", f"tagps-{index}-y", f"tagps-{index}b"} <= set(removed)
    assert netns_names(index) == []
    assert down_all(index) == []  # idempotent


@pytest.mark.netns
@pytest.mark.usefixtures("netns")
def test_two_networks_get_distinct_numbers_and_subnets(netns_names: NamesOf) -> None:
    with up(["a"]) as first, up(["a"]) as second:
        assert first.index != second.index
        assert first.address("a") != second.address("a")
        assert first.node("a").netns != second.node("a").netns
        first.down()
        # only its own names went
        assert netns_names(first.index) == [] and len(netns_names(second.index)) == 3
        first.down()  # idempotent; leaving the block calls it a third time


# --- no root needed below ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"nodes": []}, ValueError, "1 to 254"),
        ({"nodes": ["a", "a"]}, ValueError, "distinct"),
        ({"nodes": ["Bad Name"]}, ValueError, "bad node name"),
        ({"nodes": ["a" * 33]}, ValueError, "bad node name"),
        ({"nodes": "ab"}, TypeError, "not one string"),
        ({"nodes": {"a": 5}}, TypeError, "LinkLimit"),
        ({"nodes": {"a": LinkLimit()}, "limit": LinkLimit()}, ValueError, "not both"),
        ({"nodes": ["a"], "mtu": 10}, ValueError, "mtu"),
    ],
)
def test_up_rejects_bad_arguments(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        up(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"), [({"rate_mbit": 0}, "rate_mbit"), ({"delay_ms": -1}, "delay_ms")]
)
def test_link_limit_validates(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LinkLimit(**kwargs)


def test_not_root_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns_module.os, "geteuid", lambda: 1000)
    with pytest.raises(ClusterError, match="need root"):
        check_support()
    with pytest.raises(ClusterError, match="need root"):
        up(["a"])


def test_missing_iproute2_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns_module.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns_module.shutil, "which", lambda *args, **kwargs: None)
    with pytest.raises(ClusterError, match="install iproute2"):
        check_support()


def test_down_all_rejects_a_bad_index() -> None:
    with pytest.raises(ValueError, match="index"):
        down_all(512)


def test_cli_down_without_root_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from tagps.cli import main

    monkeypatch.setattr(netns_module.os, "geteuid", lambda: 1000)
    assert main(["cluster", "down"]) == 1
    assert "need root" in capsys.readouterr().err
