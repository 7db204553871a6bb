#!/usr/bin/env bash
# Makes (once; cached) a Python venv holding TrustGraph's own processes, unmodified from
# PyPI: trustgraph-base, trustgraph-flow and trustgraph-cli 2.11.1. Prints the venv's path
# on stdout; logs go to stderr; exits non-zero if the install fails. For issue #14:
#   TG_FLOW_VENV=$(bash scripts/tg-flow-venv.sh) && "$TG_FLOW_VENV/bin/api-gateway" --help
#
# trustgraph-flow declares every backend TrustGraph supports (Cassandra, Milvus, Pinecone,
# Qdrant, FAISS, fastembed, Neo4j, ...), hundreds of MB the processes used here never
# import. So it is installed with --no-deps, and then only what these import is added,
# found by importing and running each of them: config-svc (tests/py/tg_config_svc.py),
# flow-svc, no-auth-svc, bootstrap, api-gateway, text-completion-openai, prompt-template
# and agent-manager-react need, beyond trustgraph-base's own dependencies,
#   cryptography (api-gateway), openai (text-completion-openai),
#   ibis and jsonschema (prompt-template).
# Every package is pinned (as pip constraints) to versions these were verified with.
#
# Settings (environment): TG_FLOW_VENV (default ~/.cache/sluice/tg-flow-venv),
# PYTHON (default python3; TrustGraph wants 3.10 or newer; verified with 3.11).
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
LOG_TAG="tg-flow-venv"

version=2.11.1
venv="${TG_FLOW_VENV:-$HOME/.cache/sluice/tg-flow-venv}"
python="${PYTHON:-python3}"

# Pins, verified together on CPython 3.11 (pip constraints: a pin applies only if pip
# installs that package).
constraints() {
  cat <<'EOF'
trustgraph-base==2.11.1
trustgraph-flow==2.11.1
trustgraph-cli==2.11.1
cryptography==50.0.2
openai==3.57.0
ibis==3.3.0
jsonschema==4.26.0
aio-pika==10.2.1
aiohappyeyeballs==2.7.1
aiohttp==3.14.5
aiokafka==0.14.0
aiormq==7.2.4
aiosignal==1.4.0
annotated-types==0.8.0
anyio==4.16.0
async-timeout==5.0.1
attrs==26.1.0
certifi==2026.10.19.post1
cffi==2.1.1
charset-normalizer==3.5.2
confluent-kafka==2.16.1
frozenlist==1.8.0
h11==0.16.0
httpcore2==2.16.2
httpx2==2.16.2
idna==3.20
jiter==0.19.0
jsonschema-specifications==2025.9.1
msgpack==1.2.4
multidict==7.2.1
packaging==26.3
pamqp==4.0.1
pika==1.4.4
prometheus_client==0.26.0
propcache==0.5.4
pulsar-client==3.13.0
pycparser==3.12
pydantic==2.14.4
pydantic_core==2.50.5
pyparsing==3.3.3
PyYAML==6.0.4
rdflib==7.6.0
referencing==0.37.0
requests==2.34.2
rpds-py==2026.9.1
sniffio==1.3.1
tabulate==0.10.0
truststore==0.10.5
typing-inspection==0.4.5
typing_extensions==4.16.0
urllib3==2.8.0
websockets==17.4
yarl==1.25.1
EOF
}

# The stamp names the pins, so changing them rebuilds the venv.
stamp="$venv/.sluice-tg-flow-$(constraints | cksum | cut -d' ' -f1)"

if [ -f "$stamp" ] && [ -x "$venv/bin/tg-invoke-agent" ] && [ -x "$venv/bin/api-gateway" ]; then
  echo "$venv"
  exit 0
fi

log "building $venv (TrustGraph $version; once, then cached)"
rm -rf "$venv"
"$python" -m venv "$venv" >&2
cons="$venv/constraints.txt"
constraints > "$cons"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install -c "$cons" \
  "trustgraph-base==$version" "trustgraph-cli==$version" \
  cryptography openai ibis jsonschema >&2
"${pip[@]}" install -c "$cons" --no-deps "trustgraph-flow==$version" >&2

# Every process must import. config-svc's module imports the Cassandra driver at import
# time; it runs through tests/py/tg_config_svc.py, which replaces that module first.
"$venv/bin/python" - <<'EOF' >&2
import trustgraph.flow.service, trustgraph.iam.noauth, trustgraph.gateway
import trustgraph.model.text_completion.openai, trustgraph.prompt.template
import trustgraph.agent.react, trustgraph.bootstrap.bootstrapper
import trustgraph.api
EOF
for cmd in api-gateway flow-svc no-auth-svc bootstrap text-completion-openai prompt-template \
           agent-manager-react tg-invoke-llm tg-invoke-prompt tg-invoke-agent \
           tg-put-flow-blueprint tg-start-flow tg-show-flows tg-list-models; do
  [ -x "$venv/bin/$cmd" ] || { log "missing $venv/bin/$cmd"; exit 1; }
done
touch "$stamp"
log "ready: $venv"
echo "$venv"
