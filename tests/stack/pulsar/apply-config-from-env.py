#!/usr/bin/env python3
"""apply-config-from-env.py CONF_FILE... -- for the local stand-in of apachepulsar/pulsar.

Docker Hub's Pulsar image carries a script of this name in /pulsar/bin that
docker-compose.yml calls; Pulsar's distribution tarball does not, so
scripts/stack-images.sh puts this one in its place. It does what that script is documented
to do (sluice's own implementation):
  * an environment variable named like a key the file already has replaces that key's value;
  * PULSAR_PREFIX_<key>=<value> sets <key>, appending it when the file lacks it.
Comments and every other line are kept as they are.
"""

import os
import re
import sys

PREFIX = "PULSAR_PREFIX_"


def apply(path):
    lines = open(path).read().splitlines()
    keys = {}
    for i, line in enumerate(lines):
        m = re.match(r"^([A-Za-z0-9_.\-]+)=", line)
        if m:
            keys[m.group(1)] = i
    wanted = {}
    for name, value in os.environ.items():
        if name.startswith(PREFIX) and len(name) > len(PREFIX):
            wanted[name[len(PREFIX):]] = value
        elif name in keys:
            wanted[name] = value
    for key, value in sorted(wanted.items()):
        if key in keys:
            lines[keys[key]] = f"{key}={value}"
        else:
            lines.append(f"{key}={value}")
        print(f"[{path}] {key}={value}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main():
    if len(sys.argv) < 2:
        sys.exit("usage: apply-config-from-env.py CONF_FILE...")
    for path in sys.argv[1:]:
        apply(path)


if __name__ == "__main__":
    main()
