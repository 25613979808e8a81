"""KV tiers below the device pool: the host tier's arena traffic and the disk tier's files.

The books (which block lives where) are in :mod:`tgi_paged_backend.memory.host_tier` and
:mod:`tgi_paged_backend.memory.prefix_tiers` (ids only); this package moves the bytes:

- ``tier_io``: runs the host tier's copies (offload, load), spills host entries to disk, fetches a prompt's
  blocks from disk into the host tier at admission; counts bytes and seconds each way.
- ``disk_store``: the disk tier's files (atomic, checksummed, fingerprinted, size-capped, written off the
  engine thread).
- ``tier_sizing``: how big the host tier is when the user does not say.
"""
