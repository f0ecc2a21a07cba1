"""The trainer sidecar's producer (paper ❶–❹ on one owner): candidate staging from the trainer's
inbox, the producer service the coordinator drives, its HTTP plane and the process entry.

- `staging`: chunk files taken out of the shared-memory inbox, checked, kept per version;
- `resume`: the fresh-start / resume rules checked on the first export;
- `service`: `ProducerService`, one owner's side of every attempt (pipeline + transport);
- `http`: the aiohttp control plane (coordinator calls and the trainer's handoff);
- `main`: `kuberefit producer serve` / `python -m refit_sidecar.producer`.
"""
