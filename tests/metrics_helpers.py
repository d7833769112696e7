"""Scraping a daemon's --metrics-port in tests: real HTTP over loopback, parsed by the parser in
prometheus_client, so a test sees exactly what Prometheus would."""

from __future__ import annotations

import ssl
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


class Scrape:
    """One scrape: every sample by (name, labels)."""

    def __init__(self, text: str):
        self.text = text
        self.families = list(text_string_to_metric_families(text))
        self.samples = {(s.name, frozenset(s.labels.items())): s.value for f in self.families for s in f.samples}

    def value(self, name: str, **labels: str) -> float:
        """The sample `name{labels}`; 0 when absent (a labelled counter not yet touched)."""
        return self.samples.get((name, frozenset(labels.items())), 0.0)

    def sum(self, name: str, **labels: str) -> float:
        """Sum over every sample of `name` whose labels include `labels`."""
        wanted = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == name and wanted <= ls)

    def names(self) -> set[str]:
        """Every sample name (counters with _total, histograms with _bucket/_sum/_count)."""
        return {name for name, _ in self.samples}


def scrape(url: str, timeout_s: float = 5.0, context: ssl.SSLContext | None = None, token: str | None = None) -> Scrape:
    """GET `url` (https with `context`, a bearer `token` when given) and parse it; raises what
    urllib raises for a refusal (URLError, HTTPError)."""
    assert url.startswith(("http://127.0.0.1:", "https://127.0.0.1:")), url  # loopback only
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s,
                                context=context) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/plain")
        return Scrape(reply.read().decode())


def tls_context(ca_file, cert_file=None, key_file=None) -> ssl.SSLContext:
    """What a scraper's tls_config makes: the CA checks the server, cert and key are presented."""
    context = ssl.create_default_context(cafile=str(ca_file))
    if cert_file is not None:
        context.load_cert_chain(str(cert_file), str(key_file))
    return context


def delta(after: Scrape, before: Scrape, name: str, **labels: str) -> float:
    return after.value(name, **labels) - before.value(name, **labels)
