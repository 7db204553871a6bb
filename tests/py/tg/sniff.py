"""Prints every message on the given Pulsar topics, as TrustGraph's processes put them on
the wire (payload bytes as text, message properties), one JSON line per message:

    python tests/py/tg/sniff.py pulsar://127.0.0.1:6660 \
        non-persistent://tg/request/config non-persistent://tg/response/config ...

Each topic gets its own Exclusive subscription `sniff-<uuid>` at the latest position, so
it sees what is published after it starts (non-persistent topics keep nothing). Prints
`sniffing` on stderr once every subscription is open.
"""

import json
import sys
import time
import uuid

import _pulsar
import pulsar


def main():
    url, topics = sys.argv[1], sys.argv[2:]
    client = pulsar.Client(url, logger=pulsar.ConsoleLogger(_pulsar.LoggerLevel.Error))
    consumers = [
        client.subscribe(t, f"sniff-{uuid.uuid4().hex[:8]}",
                         consumer_type=pulsar.ConsumerType.Exclusive,
                         initial_position=pulsar.InitialPosition.Latest)
        for t in topics
    ]
    print("sniffing", file=sys.stderr, flush=True)
    while True:
        idle = True
        for c in consumers:
            try:
                msg = c.receive(timeout_millis=50)
            except pulsar.Timeout:
                continue
            idle = False
            c.acknowledge(msg)
            data = msg.data().decode("utf-8", "replace")
            try:
                data = json.loads(data)
            except ValueError:
                pass
            print(json.dumps({"t": round(time.time(), 3), "topic": msg.topic_name(),
                              "properties": msg.properties(), "data": data}), flush=True)
        if idle:
            time.sleep(0.01)


if __name__ == "__main__":
    main()
