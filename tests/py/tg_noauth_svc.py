"""TrustGraph's own no-auth IAM service (`no-auth-svc`, trustgraph-flow 2.11.1), run
unmodified except for one answer: `get-signing-key-public` returns an Ed25519 public key
instead of the empty string.

Why: TrustGraph's api-gateway fetches the IAM's JWT signing key before it listens, 30 tries
2 s apart (`trustgraph.gateway.auth.IamAuth.start`), and takes an empty key for "not yet".
Under no-auth-svc as shipped it therefore waits about 60 s on every start, then listens
anyway: a minute of the test command's TrustGraph stage spent on nothing. With a key it
listens at once. The key only matters for JWT bearer tokens, which nothing in these tests
sends (TrustGraph's CLI sends no token, and no-auth-svc authenticates every caller as
anonymous); the key pair is made at start-up and its private half is never used or kept.

Everything else (the operations, their answers, the argument parser, the queues) is
TrustGraph's: `NoAuthHandler.handle` is wrapped, not rewritten, and the service is launched
by TrustGraph's own `run`. Usage is that of `no-auth-svc`:

    python tests/py/tg_noauth_svc.py -p pulsar://127.0.0.1:6660 \
        --pulsar-admin-url http://127.0.0.1:8090 -P 8102
"""

import sys

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from trustgraph.iam.noauth import handler as noauth_handler
from trustgraph.iam.noauth import run
from trustgraph.schema import IamResponse

PUBLIC_PEM = (
    ed25519.Ed25519PrivateKey.generate()
    .public_key()
    .public_bytes(
        serialization.Encoding.PEM,
        serialization.PublicFormat.SubjectPublicKeyInfo,
    )
    .decode("ascii")
)

_handle = noauth_handler.NoAuthHandler.handle


async def handle(self, v):
    if v.operation == "get-signing-key-public":
        return IamResponse(signing_key_public=PUBLIC_PEM)
    return await _handle(self, v)


noauth_handler.NoAuthHandler.handle = handle

if __name__ == "__main__":
    sys.argv[0] = "no-auth-svc"
    sys.exit(run())
