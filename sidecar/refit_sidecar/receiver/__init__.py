"""The rollout node's receiver: authenticated control plane, reception checks, dedup, declared-order
application through a bounded queue, relay-tree node and S3 downloader (paper Appendix B.1).

Kept import-light: `refit_operator.receiver_client` is usable without torch or zmq.
"""
