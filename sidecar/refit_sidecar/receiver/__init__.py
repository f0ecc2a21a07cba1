"""❺ validate, dedup, queue: the rollout node's receiver (paper Appendix B.1), by responsibility.

- `admission`: pure verdicts (prepare, payload offers, gate);
- `intake`: payloads in from the relay node or S3, checked and staged; `validate`: decoded once;
- `apply_loop`: the declared-order apply thread; `appliers/`: what writes (in process, vLLM);
- `control` and `flush`: the control state machine the coordinator drives;
- `node_state`, `state`: what the node and each attempt hold; `core`, `node`, `service`: the
  in-process assembly, the full node with its relay, and the HTTP plane.
"""
