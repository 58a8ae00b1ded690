"""Weight sync: how a new version's weights get from the learner to the rollout engines.

Two methods (``weight_sync.method``), one interface for the trainer (:class:`WeightSync`):

- ``object_store`` (:class:`ObjectStoreSync`): ``learner.publish()`` exports a snapshot and
  ``rollout.sync_weights`` has every engine load it (on Ray: one put, one get per worker).
- ``collective`` (:class:`CollectiveSync`): the learner broadcasts its parameters to every
  rollout worker through a ``torch.distributed`` process group of their own — learner =
  rank 0, rollout worker i = rank i+1 — built from a ``TCPStore`` the learner hosts on a
  free port. Not the default process group: a sharded learner's ranks own that one.
  With ``learner.world_size`` > 1, learner rank 0 is the group's rank 0: on each sync
  every learner rank gathers the full weights to it (a collective of the learner's own
  group, :func:`~asyncrl.weight_sync.endpoints.send`), then it alone broadcasts them.

A collective sync moves the bytes once, device to device where the backend allows (nccl),
instead of through the object store's serialise-put-get-deserialise. Parameters of one
dtype are packed into flat buckets of ``bucket_mb`` (one broadcast each, the next packed
while the previous is on the wire); the receivers read the bucket layout once, from the
store, and unpack them into views. The version travels in a header broadcast first.

Nothing may hang silently, so every wait has ``weight_sync.timeout_s`` and names who did
not answer. The store carries a handshake beside the group:

- forming the group: each receiver sets ``join/<rank>``; the learner waits for all of them
  (:class:`WeightSyncError` naming the ranks missing), then publishes the layout, and only
  then do all build the group (gloo's own rendezvous would time out without names);
- each sync of version v: each receiver sets ``ready/v/<rank>``, the learner waits for all,
  sets ``send/v`` and broadcasts; each receiver sets ``done/v/<rank>`` once it holds every
  bucket and the learner waits for those too. A receiver waiting for ``send/v`` names the
  learner if it never comes;
- afterwards each engine reports the version it serves and :func:`check_served` turns one
  that is not v into an error naming the worker, for both methods.

A receiver takes the bytes while its engine goes on generating, then swaps all weights at
once between two decode steps (:func:`~asyncrl.weight_sync.endpoints.receive`, which honours
``partial_rollout`` as ``sync_weights`` does), so no token comes from a half-loaded model.
vLLM takes them through its own ``update_weights`` (``reload_weights`` in its workers), as
with ``object_store``: the collective replaces the learner-to-worker hop, not vLLM's
load. ``runtime: local`` keeps the engine in the driver's process, with the learner
or beside its process (or a sharded learner's rank processes, whose rank 0 publishes the
gathered weights through shared memory: ``asyncrl/runtime/shared_weights.py``), where a
collective would copy through a socket what can be copied in memory:
it uses ``object_store`` and says so once. A dead rollout worker cannot be replaced
under ``collective`` (the group has a fixed size): the run stops naming it, and ``resume=true`` starts a fresh group.

Four parts: ``buckets`` (packing, the digest), ``group`` (sender, receiver, the
handshake), ``endpoints`` (the functions that run inside the learner's and the rollout
workers' processes, installed there through the handles' generic ``apply``, so the
handles carry no weight-sync method of their own), and ``strategies`` (the trainer's
side: which method, the order of the calls, the checks).
"""

from asyncrl.weight_sync.buckets import Bucket, fingerprint, pack_bucket, plan_buckets, unpack_bucket
from asyncrl.weight_sync.group import SyncAddress, WeightReceiver, WeightSender, WeightSyncError, rank_name
from asyncrl.weight_sync.strategies import (
    CollectiveSync,
    ObjectStoreSync,
    WeightSync,
    check_served,
    open_weight_sync,
    resolve_backend,
)

__all__ = ["Bucket", "CollectiveSync", "ObjectStoreSync", "SyncAddress", "WeightReceiver", "WeightSender",
           "WeightSync", "WeightSyncError", "check_served", "fingerprint", "open_weight_sync", "pack_bucket",
           "plan_buckets", "rank_name", "resolve_backend", "unpack_bucket"]
