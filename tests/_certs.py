"""A self-signed certificate for loopback TLS tests."""

import shutil
import subprocess

import pytest


def self_signed_cert(directory):
    """(certificate, key) PEM files in `directory`, valid for localhost and
    127.0.0.1 for a day (the openssl CLI makes them)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI (cryptography is not installed)")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
         "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1",
         "-subj", "/CN=localhost", "-addext",
         "subjectAltName=DNS:localhost,IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=30)
    return cert, key
