"""Throwaway certificates for the TLS tests and `pdserve bench transfer --transports tls`, made
with the openssl command line: a CA and a certificate it signs, good for every cluster process
(TLS is checked by chain, not host name). A second set is an outsider to the first."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CertSet:
    """PEM files of one CA and one certificate it signed."""

    ca: Path
    cert: Path
    key: Path

    def flags(self) -> list[str]:
        """The flags that give a router or worker this set."""
        return ["--tls-cert", str(self.cert), "--tls-key", str(self.key), "--tls-ca", str(self.ca)]


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_cert_set(folder: Path, name: str) -> CertSet:
    """A new CA named `name` and a member certificate it signed, in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca = folder / f"{name}-ca.key", folder / f"{name}-ca.pem"
    key, csr, cert = folder / f"{name}.key", folder / f"{name}.csr", folder / f"{name}.pem"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", str(ca_key), "-out", str(ca), "-days", "2",
             "-subj", f"/CN={name} cluster CA")  # fmt: skip
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name} member")  # fmt: skip
    ext = folder / f"{name}.ext"
    ext.write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
             "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext))  # fmt: skip
    return CertSet(ca, cert, key)
