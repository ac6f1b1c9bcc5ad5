"""The RabbitMQ bus on its own: publish rate, consume rate (read + ack through one consumer group), and how
fast a blocking read wakes when another process publishes.

    python -m bench.rabbitmq_bus [--url amqp://guest:guest@127.0.0.1:5672/%2F] [--events 5000] [--batch 100]

Runs in a fresh namespace and deletes it afterwards. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import uuid
from datetime import UTC, datetime

from bridge.bus.rabbitmq import RabbitMQBus
from bridge.core.events import TASK_STATUS_CHANGED, CloudEvent

P = 8


def _event(n: int) -> CloudEvent:
    return CloudEvent(id=str(uuid.uuid4()), type=TASK_STATUS_CHANGED, subject=f"task-{n}",
                      partitionkey=f"inst-{n % 97}", time=datetime.now(UTC), data={"n": n, "pad": "x" * 200})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672/%2F")
    parser.add_argument("--events", type=int, default=5000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--wakes", type=int, default=20)
    args = parser.parse_args()
    ns = f"pbbench-{uuid.uuid4().hex[:8]}"
    bus = RabbitMQBus(args.url, partitions=P, namespace=ns)
    publisher = RabbitMQBus(args.url, partitions=P, namespace=ns)
    try:
        bus.ensure_group("g")
        events = [_event(n) for n in range(args.events)]
        start = time.perf_counter()
        for i in range(0, len(events), args.batch):
            publisher.publish(events[i:i + args.batch])
        publish_s = time.perf_counter() - start

        got, acks = 0, []
        start = time.perf_counter()
        while got < args.events:
            batch = bus.ack_and_read("g", acks, "c", list(range(P)), args.batch, 1.0)
            got += len(batch)
            acks = batch
        bus.ack("g", acks)
        consume_s = time.perf_counter() - start

        wakes: list[float] = []
        for n in range(args.wakes):
            sent: list[float] = []
            def send(n: int = n, sent: list[float] = sent) -> None:
                publisher.publish([_event(n)])
                sent.append(time.perf_counter())

            timer = threading.Timer(0.05, send)
            timer.start()
            batch = bus.read("g", "c", list(range(P)), 10, 5.0)
            woke = time.perf_counter()
            timer.join()
            bus.ack("g", batch)
            if batch and sent:
                wakes.append((woke - sent[0]) * 1000)
        print(json.dumps({
            "events": args.events, "batch": args.batch, "partitions": P,
            "publish_per_s": round(args.events / publish_s), "consume_per_s": round(args.events / consume_s),
            "wake_ms_p50": round(statistics.median(wakes), 2) if wakes else None,
            "wake_ms_max": round(max(wakes), 2) if wakes else None,
        }))
    finally:
        publisher.close()
        bus.purge_all()
        bus.close()


if __name__ == "__main__":
    main()
