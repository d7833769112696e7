"""The connector's settings, read from vLLM's `kv_connector_extra_config` and checked once at start."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

from base import security, tokens


class SettingsError(ValueError):
    """A setting that cannot work; the message names it and says what to give instead."""


@dataclass(frozen=True)
class Settings:
    coordinators: tuple[str, ...] = ()   # placement from the cluster's live kvnodes, as coordinators see them
    kvnodes: tuple[str, ...] = ()        # or a fixed list of kvnodes, no coordinator
    replicas: int = 0                    # kvnodes a sequence's blocks are saved to; 0: the coordinators' setting
    token: str = ""                      # a client token, when the cluster runs secure
    token_file: str = ""                 # or a file holding it alone, or a tokens file (the run directory's `tokens`)
    tenant: str = ""                     # whose token in such a tokens file (default: its only one, else `default`)
    tls_ca: str = ""                     # mutual TLS: the cluster's CA ...
    tls_cert: str = ""                   # ... and a worker's certificate and key (kvnodes take pages from workers)
    tls_key: str = ""
    model_id: str = ""                   # names the model in the keys instead of its path (same weights, other path)
    lookup_timeout_s: float = 0.5        # a lookup not answered by then is a miss
    load_timeout_s: float = 10.0         # a load not done by then is recomputed
    lease_ms: int = 30_000               # how long a node keeps a looked-up block for the load that follows
    save: bool = True                    # False: only read from the cluster
    save_buffer_mib: int = 512           # blocks copied out for saving, at most; past it new blocks go unsaved
    refresh_s: float = 2.0               # how often the coordinators are asked for the live kvnodes

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> "Settings":
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise SettingsError(f"unknown kv_connector_extra_config key(s) {', '.join(unknown)}; "
                                f"the kvcache connector takes {', '.join(known)}")
        values: dict[str, Any] = {}
        for name, value in extra.items():
            default = known[name].default
            if isinstance(default, tuple):
                value = tuple(a.strip() for a in value.split(",") if a.strip()) if isinstance(value, str) else value
                if not isinstance(value, (list, tuple)) or not all(isinstance(a, str) for a in value):
                    raise SettingsError(f"{name} must be a list of host:port addresses, got {value!r}")
                value = tuple(value)
            elif isinstance(default, bool):
                if not isinstance(value, bool):
                    raise SettingsError(f"{name} must be true or false, got {value!r}")
            elif isinstance(default, (int, float)):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                    raise SettingsError(f"{name} must be a number >= 0, got {value!r}")
                if isinstance(default, int) and value != int(value):
                    raise SettingsError(f"{name} must be a whole number, got {value!r}")
                value = type(default)(value)
            elif not isinstance(value, str):
                raise SettingsError(f"{name} must be a string, got {value!r}")
            values[name] = value
        settings = cls(**values)
        settings.check()
        return settings

    def check(self) -> None:
        if bool(self.coordinators) == bool(self.kvnodes):
            raise SettingsError("give either coordinators (a list of host:port) or kvnodes, not "
                                + ("both" if self.coordinators else "neither"))
        if (self.tls_cert or self.tls_key) and not (self.tls_cert and self.tls_key and self.tls_ca):
            raise SettingsError("tls_cert and tls_key go together, with tls_ca")
        if self.token and self.token_file:
            raise SettingsError("give token or token_file, not both")
        for name in ("lookup_timeout_s", "load_timeout_s", "refresh_s"):
            if getattr(self, name) <= 0:
                raise SettingsError(f"{name} must be positive")
        if self.lease_ms >= 2**32:  # a Lookup's lease_ms is a uint32
            raise SettingsError(f"lease_ms must be below 2**32, got {self.lease_ms}")
        # The files are read now, so a bad one turns the connector off at start (connector.py), not later.
        self.credentials()
        self.client_token()

    def credentials(self) -> security.Credentials | None:
        if not self.tls_ca:
            return None
        try:
            return security.Credentials(Path(self.tls_ca), Path(self.tls_cert) if self.tls_cert else None,
                                        Path(self.tls_key) if self.tls_key else None)
        except ValueError as exc:  # names the daemons' --tls-* options
            raise SettingsError(f"tls_ca, tls_cert, tls_key: {str(exc).replace('--tls-', 'tls_')}") from None

    def client_token(self) -> str | None:
        """As a client's --token-file and --tenant read it (base/tokens.py), the messages naming these keys."""
        if self.tenant and not self.token_file:
            raise SettingsError("tenant picks a tenant of a tokens file: give that file as token_file")
        if self.token_file:
            try:
                return tokens.client_token(self.token_file, self.tenant or None)
            except ValueError as exc:
                raise SettingsError(str(exc).replace("--token-file", "token_file").replace("--tenant", "tenant")) from None
        return self.token or None
