"""Every Redis key, stream and consumer-group name the Redis Streams bus uses, in one place.

Keeping the names here (and nowhere else) means the layout can be read, documented, scanned for
and changed in one module: the bus, ``uninstall``-style cleanups, the tests and operators'
``redis-cli`` sessions all agree on it.

Layout, for namespace ``ns`` (default ``pollbridge``) and ``P`` partitions::

    ns:events:{ns:p0} … ns:events:{ns:p<P-1>}   stream   one per partition; entries {id, payload}
    ns:dead                                      stream   dead letters {group, entry_id, partition,
                                                          payload, reason}
    ns:epoch:{ns:p0} … ns:epoch:{ns:p<P-1>}     string   one epoch token per partition (SET NX), in
                                                          its stream's slot: it vanishing (FLUSHALL, a
                                                          restart without persistence, a shard's
                                                          failover to an empty replica) is how that
                                                          partition's data loss is detected; a relay
                                                          that finds its own acknowledged entry gone
                                                          (a failover lost the newest writes) replaces it
    ns:wake:{ns:wake}                            stream   Redis Cluster only: the doorbell. A publish
                                                          rings it with the partitions it wrote {p};
                                                          waiting readers block on it (a blocking read
                                                          cannot span several slots), capped ~1000
    ns:sched:{ns:sched}:members                  zset     event-scheduler processes, scored by their
                                                          last heartbeat (ms, Redis clock)
    ns:sched:{ns:sched}:leases                   hash     partition -> "expires_ms holder": which
                                                          scheduler consumes which partition

* **Every key starts with** ``ns:`` so one ``SCAN MATCH ns:*`` finds all of a namespace's keys
  (several pollbridge installations, or tests, can share one server) and nothing else.
* **Hash tags.** Redis Cluster places a key by the part between the first ``{`` and ``}``. Each
  partition stream has its own tag ``{ns:pN}``, so partitions spread over the cluster's slots
  (one partition's stream lives on exactly one node) while a partition's stream always stays in
  one slot. The tag includes the namespace so two namespaces' partition 3 do not pile onto the
  same slot. A partition's epoch shares its stream's tag, so it lives and dies with the stream on
  the same shard: one shard's loss changes only its partitions' epochs, and only their retained
  outbox rows are republished. ``ns:dead`` carries no tag: it is touched rarely and alone. The
  scheduler's members and leases share the tag ``{ns:sched}``: one script updates both.
* **Consumer groups** live inside each partition stream and use the caller's group name as is
  (a group is named once per stream, so it needs no namespace); :meth:`BusKeys.group` only
  validates it.

A namespace may hold letters, digits and ``_ - .``; braces (they would break the hash tags), glob
characters (they would break ``SCAN MATCH``), whitespace and ``:`` (namespace ``a`` would then
match the keys of namespace ``a:b``) are rejected.
"""

from __future__ import annotations

from dataclasses import dataclass

from bridge.core.urls import DEFAULT_NAMESPACE, validate_namespace

#: Field names of a partition-stream entry.
FIELD_ID = "id"
FIELD_PAYLOAD = "payload"

#: Field names of a dead-letter entry.
DEAD_FIELDS = ("group", "entry_id", "partition", "payload", "reason")


@dataclass(frozen=True)
class BusKeys:
    """The key names of one namespace. Construct it once; every method is a pure function."""

    namespace: str = DEFAULT_NAMESPACE

    def __post_init__(self) -> None:
        validate_namespace(self.namespace)

    def stream(self, partition: int) -> str:
        """The stream of ``partition``, hash-tagged so each partition maps to its own cluster slot."""
        if partition < 0:
            raise ValueError(f"partition must be >= 0, got {partition}")
        return f"{self.namespace}:events:{{{self.namespace}:p{partition}}}"

    def streams(self, partitions: int) -> list[str]:
        """The streams of partitions ``0..partitions-1``, in partition order."""
        return [self.stream(p) for p in range(partitions)]

    @property
    def dead(self) -> str:
        """The dead-letter stream (all groups, all partitions)."""
        return f"{self.namespace}:dead"

    def epoch(self, partition: int) -> str:
        """The string holding ``partition``'s epoch token, in its stream's slot; its disappearance means the
        partition lost its data."""
        if partition < 0:
            raise ValueError(f"partition must be >= 0, got {partition}")
        return f"{self.namespace}:epoch:{{{self.namespace}:p{partition}}}"

    @property
    def wake(self) -> str:
        """The doorbell stream of a Redis Cluster bus: publishes ring it, blocked readers wait on it."""
        return f"{self.namespace}:wake:{{{self.namespace}:wake}}"

    @property
    def pattern(self) -> str:
        """``SCAN MATCH`` pattern for every key of this namespace (and of no other)."""
        return f"{self.namespace}:*"

    @property
    def scheduler_members(self) -> str:
        """Sorted set of live event-scheduler processes (score: last heartbeat, ms)."""
        return self._scheduler("members")

    @property
    def scheduler_leases(self) -> str:
        """Hash of partition leases: field = partition, value = ``"<expires_ms> <holder>"``."""
        return self._scheduler("leases")

    def _scheduler(self, name: str) -> str:
        # One hash tag for every scheduler key: the lease script touches them together (one cluster slot).
        return f"{self.namespace}:sched:{{{self.namespace}:sched}}:{name}"

    @staticmethod
    def group(name: str) -> str:
        """The consumer-group name used on every partition stream: the caller's name, validated."""
        if not name or any(ch.isspace() for ch in name):
            raise ValueError(f"invalid consumer group name {name!r}: non-empty, no whitespace")
        return name
