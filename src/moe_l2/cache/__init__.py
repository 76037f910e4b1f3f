"""The cache bookkeeping and policy, shared by the daemon (L2), the client's pools (L0) and `moe-l2 replay`:
eviction policies, the per-layer slot store with its pins and hints, routing traces, domain profiles and the
domain predictors. Nothing here touches shared memory or imports the daemon (docs/architecture.md, "The tree").
"""
