"""Switchyard's simulator: a closed-loop fleet of Apple-silicon providers and gateway traffic.

* `fleet` — the provider model (`ProviderSpec`, `SimProvider`, `build_fleet`);
* `arrivals` — synthetic traffic with the production figures, and public trace replay;
* `presets` — scenario recipes (default, postmortem, prefill-starved, hotspot, v2-migration);
* `scenario` — a resolved run (preset + size + rate + settings + arrivals);
* `offline` — discrete-event simulation routed by the in-process core, written as a JSON Lines
  journal that `python -m replay` reproduces;
* `live` — the same fleet and traffic against a Kafka broker and a worker.

Command line: `python -m streams.sim {presets,offline,live} --help` (docs/simulator.md).
"""
