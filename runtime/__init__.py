"""What every relay process runs on: settings (`config`), logs (`logs`, `log_rate`), metrics
(`metrics`), the TCP accept loop with admission (`listener`, `open_files`), TLS (`tls`,
`tls_stream`), the relay's keys (`keys`) and a role's serving loop (`role`).

Below the shells and the jobs, above the sans-I/O cores: it imports only `engine/`, so any
package may use it (tests/test_layout.py).
"""
