"""The Redis bus on a Redis Cluster (3 primaries, 3 replicas, started by the tests): what the one contract suite
(test_bus_contract.py, which also runs on it) does not say about clusters — finding the cluster from any node,
where partitions and their epochs live, and ``status`` showing it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from bridge.bus.redis_streams import RedisStreamsBus
from bridge.reconcile.status import bus_status
from tests.support import clear_redis_namespace

pytestmark = pytest.mark.redis


@pytest.fixture
def namespace(redis_cluster: str) -> Iterator[str]:
    name = f"pbtest-{uuid.uuid4().hex[:10]}"
    yield name
    clear_redis_namespace(redis_cluster, name)


def test_any_node_replica_or_primary_leads_to_the_whole_cluster(redis_cluster_nodes: Any, namespace: str) -> None:
    """The bus URL may name any node: the bus detects the cluster and reaches every partition through it."""
    for port in redis_cluster_nodes.ports:
        bus = RedisStreamsBus(f"redis://127.0.0.1:{port}/0", partitions=8, namespace=namespace)
        try:
            assert bus.cluster
            bus.ensure_group("g")
            assert sum(bus.lag("g").values()) == 0
        finally:
            bus.close()


def test_a_single_server_is_not_taken_for_a_cluster(redis_server: str, redis_namespace: str) -> None:
    bus = RedisStreamsBus(redis_server, partitions=2, namespace=redis_namespace)
    try:
        assert not bus.cluster and bus.placement() is None
    finally:
        bus.close()


def test_partitions_spread_over_the_primaries_and_each_epoch_lives_beside_its_stream(
        redis_cluster_nodes: Any, redis_cluster: str, namespace: str) -> None:
    bus = RedisStreamsBus(redis_cluster, partitions=16, namespace=namespace)
    try:
        placement = bus.placement()
        assert placement is not None and set(placement) == set(range(16))
        primaries = {f"127.0.0.1:{p}" for p in redis_cluster_nodes.primaries()}
        assert set(placement.values()) <= primaries
        assert len(set(placement.values())) >= 2  # 16 hash tags on one of three nodes: (1/3)^15
        node = redis_cluster_nodes.node(redis_cluster_nodes.alive()[0])
        for p, where in placement.items():
            assert f"127.0.0.1:{redis_cluster_nodes.primary_of(bus.keys.stream(p))}" == where
            # One shard's loss takes a partition's stream and its epoch together, and nothing of the others.
            assert node.cluster("keyslot", bus.keys.stream(p)) == node.cluster("keyslot", bus.keys.epoch(p))
    finally:
        bus.close()


def test_status_says_where_the_partitions_live(redis_cluster: str, namespace: str) -> None:
    bus = RedisStreamsBus(redis_cluster, partitions=8, namespace=namespace)
    try:
        bus.ensure_group("g")
        status = bus_status(bus, "redis cluster", "g")
        assert status.state == "ok" and status.placement == bus.placement()
        assert status.to_json()["placement"] == {str(p): n for p, n in sorted((bus.placement() or {}).items())}
    finally:
        bus.close()


def test_doctor_says_the_bus_is_a_cluster(redis_cluster: str, namespace: str, tmp_path: Any) -> None:
    from click.testing import CliRunner

    from bridge.cli.main import cli

    db = tmp_path / "x.db"
    config = tmp_path / "pollbridge.toml"
    config.write_text(f'[bus]\nnamespace = "{namespace}"\n')
    env = {"POLLBRIDGE_DATABASE_URL": f"sqlite:///{db}", "POLLBRIDGE_BUS_URL": redis_cluster}
    runner = CliRunner()
    assert runner.invoke(cli, ["--config", str(config), "init", "--demo-schema"], env=env).exit_code == 0
    result = runner.invoke(cli, ["--config", str(config), "doctor"], env=env)
    line = next(x for x in result.output.splitlines() if "bus:" in x)
    assert line.startswith("[ok] bus:") and "on 3 cluster primaries" in line, result.output
