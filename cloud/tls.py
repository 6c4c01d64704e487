"""TLS of the verifier's two ports (mTLS on gRPC only: probes present no certificate), and the rule that keeps a
plaintext verifier on loopback (docs/operations.md, "Securing a verifier")."""

from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from cloud.logs import log_event
from shared.errors import ConfigError
from shared.net import is_loopback

log = logging.getLogger("cloud-verifier")


@dataclass(frozen=True)
class ServerTls:
    cert: Path  # PEM: the server's certificate (chain)
    key: Path  # PEM: its private key
    client_ca: Path | None = None  # PEM: CAs whose client certificates gRPC requires (mTLS)

    @classmethod
    def checked(cls, cert: str, key: str, client_ca: str | None) -> ServerTls:
        """Load the files once with Python's ssl, so a missing file, a key that does not match
        the certificate or a file that is not PEM stops the start with one readable line."""
        tls = cls(Path(cert), Path(key), Path(client_ca) if client_ca else None)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(tls.cert, tls.key)
        except (OSError, ssl.SSLError) as err:
            raise ConfigError(f"--tls-cert {cert} / --tls-key {key}: {_reason(err)}") from None
        if tls.client_ca is not None:
            try:
                context.load_verify_locations(cafile=tls.client_ca)
            except (OSError, ssl.SSLError) as err:
                raise ConfigError(f"--tls-client-ca {client_ca}: {_reason(err)}") from None
        return tls

    def grpc_credentials(self) -> grpc.ServerCredentials:
        ca = self.client_ca.read_bytes() if self.client_ca else None
        return grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())], root_certificates=ca, require_client_auth=ca is not None
        )

    def uvicorn_options(self) -> dict[str, Any]:
        return {"ssl_certfile": str(self.cert), "ssl_keyfile": str(self.key)}


def _reason(err: OSError | ssl.SSLError) -> str:
    if isinstance(err, ssl.SSLError):
        return f"not a usable PEM certificate and key ({err.reason or err})"
    return str(err.strerror or err)


def check_exposure(host: str, tls: ServerTls | None, insecure: bool) -> None:
    """A verifier reachable from other machines speaks TLS, unless --insecure says otherwise."""
    if tls is not None or is_loopback(host):
        return
    if not insecure:
        raise ConfigError(
            f"--host {host} serves other machines: give --tls-cert and --tls-key "
            "(README: Securing a verifier), or --insecure for plaintext on a trusted network"
        )
    # Not worded "serving ...": scripts wait for the line that starts so.
    clear_text = f"no TLS on {host} (--insecure): API keys, prompts and tokens cross the network in clear text"
    log_event(log, logging.WARNING, clear_text, host=host)
