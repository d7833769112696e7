"""The data plane's server: GET, PUT and LOOKUP of whole pages over TCP or a Unix socket."""
