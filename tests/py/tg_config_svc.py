"""TrustGraph's own config service (`config-svc`, trustgraph-flow 2.11.1), run unmodified
except for its storage: Cassandra is replaced by an in-memory table.

Why this is the smallest faithful stand-in: everything TrustGraph's config service does on
the wire (the system queue `request:tg:config`, the per-workspace queues
`request:tg:config:<workspace>`, the `notify:tg:config` pushes, version numbering,
workspace discovery and provisioning from `__template__`, reserved-workspace filtering)
lives in `trustgraph.config.service.service.Processor` and
`trustgraph.config.service.config.Configuration`, which run here as published. Both reach
storage only through `trustgraph.tables.config.ConfigTableStore`, a thin async wrapper over
two Cassandra tables:

    config  (workspace, class, key, value)  PRIMARY KEY ((workspace, class), key)
    version (id, version counter)           one row, id = 'version'

So only that class is replaced, by one with the same constructor and the same async
methods, keeping the semantics those CQL statements have:

  * put_config is an upsert (INSERT on an existing primary key overwrites it);
  * keys come back in clustering order, ascending by key, within a (workspace, class);
  * a missing key reads as None; deleting a missing key is a no-op;
  * the all-workspace queries (get_values_all_ws, get_keys_all_ws, get_all) span every
    partition (Cassandra returns partitions in token order, which callers never rely on;
    here they come sorted by workspace, then class, then key);
  * get_all_for_workspace returns (class, key, value) over every class of one workspace;
  * the version counter exists from start-up at 0 (ensure_cassandra_schema runs
    `UPDATE version SET version = version + 0`) and inc_version adds 1.

It is installed in sys.modules as `trustgraph.tables.config` before the service is
imported, so `from ... tables.config import ConfigTableStore` inside TrustGraph's code
binds to it, and the cassandra driver is never needed. State lives as long as the
process: restarting this service forgets the config, as wiping Cassandra would.

Usage is that of `config-svc` (same argument parser, TrustGraph's own):

    python tests/py/tg_config_svc.py -p pulsar://127.0.0.1:6660 \
        --pulsar-admin-url http://127.0.0.1:8090 -P 8101
"""

import sys
import types


class ConfigTableStore:
    """In-memory stand-in for trustgraph.tables.config.ConfigTableStore."""

    def __init__(
            self,
            cassandra_host, cassandra_username, cassandra_password, keyspace,
            replication_factor=1,
    ):
        self.keyspace = keyspace
        self.replication_factor = replication_factor
        # (workspace, class) -> {key: value}
        self.partitions = {}
        self.version = 0

    async def inc_version(self):
        self.version += 1

    async def get_version(self):
        return self.version

    def _rows(self):
        """(workspace, class, key, value) for every row, sorted."""
        for (workspace, cls) in sorted(self.partitions):
            part = self.partitions[(workspace, cls)]
            for key in sorted(part):
                yield workspace, cls, key, part[key]

    async def put_config(self, workspace, cls, key, value):
        self.partitions.setdefault((workspace, cls), {})[key] = value

    async def get_value(self, workspace, cls, key):
        return self.partitions.get((workspace, cls), {}).get(key)

    async def get_values(self, workspace, cls):
        part = self.partitions.get((workspace, cls), {})
        return [[key, part[key]] for key in sorted(part)]

    async def get_values_all_ws(self, cls):
        return [(w, k, v) for (w, c, k, v) in self._rows() if c == cls]

    async def get_keys_all_ws(self, cls):
        return [(w, k) for (w, c, k, v) in self._rows() if c == cls]

    async def get_all(self):
        return list(self._rows())

    async def get_all_for_workspace(self, workspace):
        return [(c, k, v) for (w, c, k, v) in self._rows() if w == workspace]

    async def get_keys(self, workspace, cls):
        return sorted(self.partitions.get((workspace, cls), {}))

    async def delete_key(self, workspace, cls, key):
        part = self.partitions.get((workspace, cls))
        if part is not None:
            part.pop(key, None)
            if not part:
                del self.partitions[(workspace, cls)]


def install():
    import trustgraph.tables  # the real package; only its `config` module is replaced
    module = types.ModuleType("trustgraph.tables.config")
    module.ConfigTableStore = ConfigTableStore
    module.__doc__ = "In-memory ConfigTableStore (tests/py/tg_config_svc.py)"
    sys.modules["trustgraph.tables.config"] = module
    trustgraph.tables.config = module


if __name__ == "__main__":
    install()
    from trustgraph.config.service.service import run
    sys.argv[0] = "config-svc"
    run()
