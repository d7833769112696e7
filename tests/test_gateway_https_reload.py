"""The gateway's HTTPS certificate re-read on SIGHUP, as every daemon's: new connections get the new
one, and files that do not make a certificate leave the old one serving, with one warning line."""

from __future__ import annotations

import shutil
import signal
import socket
import ssl
from urllib.parse import urlsplit

from cluster_helpers import wait_for
from kvcache.launch import Daemon


def served_certificate(address: str, ca) -> bytes:
    """The DER certificate a new TLS connection to `address` is served."""
    host, port = urlsplit(address).hostname, urlsplit(address).port
    context = ssl.create_default_context(cafile=str(ca))
    with socket.create_connection((host, port), timeout=10) as raw, \
            context.wrap_socket(raw, server_hostname=host) as tls:
        return tls.getpeercert(binary_form=True)


def der(pem_path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(pem_path.read_text())


def test_sighup_serves_new_connections_the_new_certificate_and_a_bad_one_keeps_the_old(tmp_path):
    from kvcache.certs import make_certs

    certs = tmp_path / "certs"
    make_certs(certs, extra={"gateway2": "gateway"})
    for suffix in ("pem", "key"):
        shutil.copy(certs / f"gateway.{suffix}", tmp_path / f"served.{suffix}")
    args = ["--host", "127.0.0.1", "--port", "0", "--coordinators", "127.0.0.1:1", "--tls-ca", str(certs / "ca.pem"),
            "--tls-cert", str(tmp_path / "served.pem"), "--tls-key", str(tmp_path / "served.key")]
    with Daemon("gateway", args, log_path=tmp_path / "gateway.log") as gateway:
        ca = certs / "ca.pem"
        assert served_certificate(gateway.address, ca) == der(certs / "gateway.pem")

        def reloads(word: str) -> int:
            return gateway.log_path.read_text().count(word)

        for suffix in ("pem", "key"):
            shutil.copy(certs / f"gateway2.{suffix}", tmp_path / f"served.{suffix}")
        gateway.process.send_signal(signal.SIGHUP)
        assert wait_for(lambda: reloads("TLS files re-read") == 1, timeout_s=10.0), gateway.log_path.read_text()
        assert served_certificate(gateway.address, ca) == der(certs / "gateway2.pem")

        (tmp_path / "served.pem").write_text("not a certificate\n")
        gateway.process.send_signal(signal.SIGHUP)
        assert wait_for(lambda: reloads("TLS files not re-read, the old ones stay") == 1, timeout_s=10.0)
        assert served_certificate(gateway.address, ca) == der(certs / "gateway2.pem")
        assert gateway.process.poll() is None and "Traceback" not in gateway.log_path.read_text()
