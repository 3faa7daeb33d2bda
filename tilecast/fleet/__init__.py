"""A night across many machines: its shards (shards.py) and the leases its machines keep in
the shared store (lease.py); the night itself is tilecast.workflows.fleet. The parent's
defaults live here, importable without the rest (the command line's help reads them)."""

SHARD_DEPLOYMENT = "tilecast-shard/shard"
LEASE_S = 120.0        # a running attempt silent this long is gone
GRACE_S = 600.0        # after the deadline, how long running shards may take to finish
POLL_S = 5.0
RETRIES = 2            # further attempts of a shard after its first
