"""No port races (issue 45): a port primerl picks stays bound until its listener binds it, and a
fixed port that is taken is a one-line ``--dry-run`` error naming the key."""

from __future__ import annotations

import socket
from datetime import timedelta
from pathlib import Path

import pytest

from primerl.runtime import cli
from primerl.runtime.ports import PortReservation, held_port, port_in_use, reserve_block, reserve_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "reverse_text.toml")


def test_a_reserved_port_goes_to_no_one_else_but_its_listener():
    with reserve_port() as r:
        # no bind(0) of another socket gets it
        got = set()
        for _ in range(2000):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                got.add(s.getsockname()[1])
        assert r.port not in got
        # no outgoing connection takes it as its local port (the ephemeral range gloo / ZeroMQ / HTTP draw from)
        with socket.socket() as srv:
            srv.bind(("127.0.0.1", 0))
            srv.listen(1024)
            local = set()
            for _ in range(300):
                with socket.create_connection(srv.getsockname()) as c:
                    local.add(c.getsockname()[1])
                    srv.accept()[0].close()
        assert r.port not in local
        # a plain bind (another job picking it) fails; the listener it is for (SO_REUSEADDR) binds and serves
        with socket.socket() as s, pytest.raises(OSError):
            s.bind(("127.0.0.1", r.port))
        assert not port_in_use("127.0.0.1", r.port)  # a reservation is no conflict for our listeners
        from torch.distributed import TCPStore

        store = TCPStore("127.0.0.1", r.port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
        client = TCPStore("127.0.0.1", r.port, is_master=False, timeout=timedelta(seconds=10))
        client.set("k", "v")
        assert store.get("k") == b"v"
        assert port_in_use("127.0.0.1", r.port)  # now something listens
        del client, store


def test_a_block_of_reserved_ports_is_consecutive_and_exclusive():
    block = reserve_block(3)
    try:
        ports = [r.port for r in block]
        assert ports == list(range(ports[0], ports[0] + 3)) and ports[-1] < 32768
        with pytest.raises(OSError):  # another reservation (another test, another job) cannot take one
            PortReservation("127.0.0.1", ports[1])
        with socket.socket() as s:  # the server it is for binds it
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", ports[1]))
            s.listen()
    finally:
        for r in block:
            r.close()


def test_held_ports_differ_and_stay_bound():
    a, b = held_port(), held_port()
    assert a != b
    with socket.socket() as s, pytest.raises(OSError):
        s.bind(("127.0.0.1", a))


def test_the_server_pool_holds_its_ports_until_it_stops(tmp_path):
    from primerl.runtime.launch.servers import ServerPool, router_executable
    from primerl.runtime.processes import ProcessTable

    if not router_executable().exists():
        pytest.skip("vllm-router is not installed")
    pool = ServerPool("c.toml", 2, tmp_path, ProcessTable(tmp_path / "processes.json"))
    ports = [int(u.rsplit(":", 1)[1]) for u in [*pool.urls, pool.router_url]]
    metrics = int(pool.router.args[pool.router.args.index("--prometheus-port") + 1])
    assert len(set(ports + [metrics])) == 4
    for p in ports + [metrics]:
        with socket.socket() as s, pytest.raises(OSError):
            s.bind(("127.0.0.1", p))
    pool.stop()
    for p in ports + [metrics]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


@pytest.mark.parametrize("key,over", [
    ("orchestrator.metrics_port", []),
    ("orchestrator.zmq_port", ["--orchestrator.batch_transport", "zmq"]),
    ("inference.pd.router_port", ["--inference.pd.prefill", "1", "--inference.pd.decode", "1"]),
    ("inference.pd.base_port", ["--inference.pd.prefill", "1", "--inference.pd.decode", "1"]),
])
def test_dry_run_refuses_a_fixed_port_in_use_naming_the_key(tmp_path, capsys, key, over):
    if key.startswith("inference.pd."):  # the P/D ports not under test: held ones, not the defaults 8100/8101/8090/8091
        servers = reserve_block(2)  # held to the end of the test
        over = [*over, "--inference.pd.base_port", str(servers[0].port), "--inference.pd.router_port", str(held_port()),
                "--inference.pd.router_metrics_port", str(held_port())]
    # the reservation keeps the port from another process's connections (an ephemeral port) once the
    # listener closes, so "free again" below is not left to luck. The decode server takes base_port + 1: it
    # is held too, or another process's connection may sit on it (CI saw that once, an ephemeral port)
    block = reserve_block(2) if key == "inference.pd.base_port" else [reserve_port()]
    port = block[0].port
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
        rc = cli.main(["rl", "--config", EXAMPLE, "--output_dir", str(tmp_path), *over, f"--{key}", str(port),
                       "--dry-run"])
        err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith(f"primerl: config error: {key}: port {port} on "), err
    rc = cli.main(["rl", "--config", EXAMPLE, "--output_dir", str(tmp_path), *over, f"--{key}", str(port),
                   "--dry-run"])  # free again: the same command passes
    for r in block:
        r.close()
    assert rc == 0, capsys.readouterr().err
