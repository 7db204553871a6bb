#!/usr/bin/env bash
# Makes (once; cached) the Python venv of the gateway benchmark: LiteLLM's proxy (the
# `litellm[proxy]` package from PyPI, unmodified) to compare against, and matplotlib for
# bench/plot.py. Prints the venv's directory on stdout; pip's output goes to stderr; exits
# non-zero if the install fails. For example:
#   BENCH_VENV=$(bash scripts/bench-venv.sh) && "$BENCH_VENV/bin/litellm" --version
#   "$BENCH_VENV/bin/python" bench/plot.py IN.json OUT.png
# How the proxy is run for the benchmark: bench/litellm.md.
#
# LiteLLM 1.77.7: a stable release from before both published supply-chain incidents
# (1.82.7 and 1.82.8 on PyPI, since removed; 1.107.0, the 2026-10-21 announcement); never
# move this pin to one of those, or to an unpinned or ranged spec. Every other package is
# pinned too (as pip constraints) to the versions this was verified with, wheels only, so
# no package's build code runs at install time.
#
# Settings (environment): BENCH_VENV (default ~/.cache/sluice/bench-venv), PYTHON (default
# python3; verified with CPython 3.11).
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
LOG_TAG="bench-venv"

litellm_version=1.77.7
matplotlib_version=3.10.8
venv="${BENCH_VENV:-$HOME/.cache/sluice/bench-venv}"
python="${PYTHON:-python3}"

# Pins, verified together on CPython 3.11 (pip constraints: a pin applies only if pip
# installs that package).
constraints() {
  cat <<EOF
litellm==$litellm_version
matplotlib==$matplotlib_version
aiohappyeyeballs==2.7.1
aiohttp==3.14.5
aiosignal==1.4.0
annotated-types==0.8.0
anyio==4.16.0
APScheduler==3.11.3
attrs==26.1.0
azure-core==1.41.0
azure-identity==1.27.0
azure-storage-blob==12.31.1
backoff==2.2.1
boto3==1.36.0
botocore==1.36.26
certifi==2026.10.19.post1
cffi==2.1.1
charset-normalizer==3.5.3
click==8.5.1
contourpy==1.3.3
croniter==7.0.0
cryptography==50.0.2
cycler==0.12.1
dnspython==2.9.2
email-validator==2.4.0
fastapi==0.115.14
fastapi-sso==0.16.0
fastuuid==0.14.0
filelock==4.3.1
fonttools==4.68.0
frozenlist==1.8.0
fsspec==2026.9.0
gunicorn==23.0.0
h11==0.16.0
hf-xet==1.8.0
httpcore==1.0.9
httpcore2==2.16.2
httpx==0.28.1
httpx-sse==0.4.3
httpx2==2.16.2
huggingface_hub==2.4.0
idna==3.20
importlib_metadata==10.2.0
isodate==0.7.2
Jinja2==3.1.6
jiter==0.19.0
jmespath==1.1.0
jsonschema==4.26.0
jsonschema-specifications==2025.9.1
kiwisolver==1.5.1
lazy-importer==0.1.0
litellm-enterprise==0.1.20
litellm-proxy-extras==0.2.25
markdown-it-py==4.3.0
MarkupSafe==3.0.4
mcp==1.12.4
mdurl==0.1.2
msal==1.39.0
msal-extensions==1.3.1
multidict==7.2.1
numpy==2.4.6
oauthlib==4.0.1
openai==3.57.0
orjson==3.13.0
packaging==26.4
pillow==13.0.0
polars==1.44.2
polars-runtime-32==1.44.2
propcache==0.5.4
pycparser==3.12
pydantic==2.14.4
pydantic-settings==2.16.3
pydantic_core==2.50.5
Pygments==2.21.0
PyJWT==2.15.1
PyNaCl==1.6.2
pyparsing==3.3.3
python-dateutil==2.9.0.post0
python-dotenv==1.2.4
python-multipart==0.0.18
PyYAML==6.0.4
redis==8.1.0
referencing==0.37.0
regex==2026.11.19
requests==2.34.2
rich==13.7.1
rpds-py==2026.9.1
rq==3.0.0
s3transfer==0.11.3
six==1.17.0
sniffio==1.3.1
sse-starlette==3.0.3
starlette==0.46.2
tiktoken==0.14.0
tokenizers==0.23.3
tqdm==4.70.1
truststore==0.10.5
typing-inspection==0.4.5
typing_extensions==4.16.0
tzlocal==5.4.5
urllib3==2.8.0
uvicorn==0.29.0
uvloop==0.21.0
websockets==13.1
yarl==1.25.1
zipp==4.1.2
EOF
}

# The venv is kept while it holds the pinned LiteLLM and matplotlib and was built from these
# pins (the stamp names them, so changing any pin rebuilds it).
stamp="$venv/.sluice-bench-$(constraints | cksum | cut -d' ' -f1)"
installed() {
  [ -f "$stamp" ] && [ -x "$venv/bin/litellm" ] &&
    "$venv/bin/python" - "$litellm_version" "$matplotlib_version" 2>/dev/null <<'EOF'
import sys
from importlib.metadata import version
sys.exit(version("litellm") != sys.argv[1] or version("matplotlib") != sys.argv[2])
EOF
}
if installed; then
  echo "$venv"
  exit 0
fi

log "building $venv (litellm[proxy] $litellm_version, matplotlib $matplotlib_version; once, then cached)"
# Only a venv this script made (or the default path) is replaced: BENCH_VENV may name
# somebody's own.
if [ -e "$venv" ] && [ "$venv" != "$HOME/.cache/sluice/bench-venv" ] &&
  ! compgen -G "$venv/.sluice-bench-*" >/dev/null; then
  fail "$venv exists and was not made by this script; remove it or set BENCH_VENV elsewhere"
fi
rm -rf "$venv"
"$python" -m venv "$venv" >&2
cons="$venv/constraints.txt"
constraints > "$cons"
"$venv/bin/python" -m pip --disable-pip-version-check -q install --only-binary=:all: -c "$cons" \
  "litellm[proxy]==$litellm_version" "matplotlib==$matplotlib_version" >&2
"$venv/bin/python" -m pip --disable-pip-version-check -q check >&2

# A .pth file in site-packages runs at every start of the venv's Python (the 1.82.8 implant
# was one): none is expected but setuptools' own.
unexpected=$(find "$venv/lib" -path '*/site-packages/*.pth' ! -name distutils-precedence.pth)
[ -z "$unexpected" ] || fail "unexpected .pth files in $venv: $unexpected"

# The proxy's modules and the plot's backend must import, without network (the cost map is
# the copy inside the package).
LITELLM_LOCAL_MODEL_COST_MAP=True "$venv/bin/python" - <<'EOF' >&2
import litellm.proxy.proxy_server, litellm.proxy.proxy_cli
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot
EOF
touch "$stamp"
log "ready: $venv"
echo "$venv"
