"""PrefixAwareRouter: Ray Serve's request router for Tern's replicas. A request goes where its prompt's start is
already in a replica's prefix cache, unless that replica is much busier than another: then load decides, as Ray's
default power-of-two-choices router does.

Where a prefix is comes from two sources. Each replica reports the hashes of the KV blocks its cache holds (Ray's
routing stats, `record_routing_stats`, every request_routing_stats_period_s): the truth, eviction and restarts
included, but up to a period late. And the router remembers where it sent each prompt for memory_s seconds, which
covers the next turn of a conversation before the replica's next report has arrived.
"""
from __future__ import annotations

import logging
import random
import time
from collections import Counter, OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
from ray.serve.request_router import LocalityMixin, MultiplexMixin

from deploy.forwarding import ForwardedRequest

logger = logging.getLogger(__name__)

PREFIX_HASHES_STAT = "prefix_hashes"  # the key of the replicas' routing stats this router reads
_MAX_REMEMBERED_BLOCKS = 200_000  # ~10 MB of hashes: beyond it the least recently routed are forgotten
_CHOICE_TTL_S = 5.0  # a choice not followed by a send within this long is dropped


class PrefixAwareRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """No FIFOMixin: with it, a routing task may hand the replica it chose for one request to another request,
    and the choice here is per request (Ray's own PrefixCacheAffinityRouter leaves it out for the same reason)."""

    def initialize_state(self, imbalanced_threshold: int = 4, memory_s: float = 30.0) -> None:
        """imbalanced_threshold: when the busiest candidate has more than this many requests more than the least
        busy, load wins over affinity. memory_s: how long a routing decision counts as a cached prefix."""
        self.imbalanced_threshold = imbalanced_threshold
        self.memory_s = memory_s
        self._routed: OrderedDict[bytes, dict[str, float]] = OrderedDict()  # block hash -> replica -> when sent
        self._reported: dict[str, tuple[dict, frozenset[bytes]]] = {}  # replica -> (its last stats, their hashes)
        self._in_flight: dict[str, set[str]] = {}  # replica -> requests this router sent it that have not ended
        self._chosen: dict[str, tuple[str, float]] = {}  # request -> (replica chosen for it, when), until it is sent

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """Ranks of replicas: Ray takes the least loaded replica of the first rank that has room."""
        request = _request_of(pending_request)
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        if isinstance(request, ForwardedRequest):
            pinned = by_id.get(request.replica_id) if request.replica_id else None
            if pinned is not None:  # a UI session: its replica, or another only if that one has no room
                return [[pinned], [r for r in candidate_replicas if r is not pinned]]
            if request.prefix_hashes and not self._is_imbalanced(candidate_replicas):
                matched = {rid: self._num_matched_blocks(replica, request.prefix_hashes) for rid, replica in by_id.items()}
                best = max(matched.values(), default=0)
                if best > 0:
                    first = [by_id[rid] for rid, n in matched.items() if n == best]
                    # Counted as that replica's load from now on: the requests of a burst are routed before any of
                    # them is sent, and each must see the ones chosen before it.
                    self._chosen[pending_request.metadata.internal_request_id] = (
                        first[0].replica_id.unique_id, time.monotonic())
                    return [first, [r for r in candidate_replicas if r not in first]]
        return self._two_choices(candidate_replicas)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self._chosen.pop(pending_request.metadata.internal_request_id, None)
        self._in_flight.setdefault(replica_id.unique_id, set()).add(pending_request.metadata.internal_request_id)
        request = _request_of(pending_request)
        if not isinstance(request, ForwardedRequest) or not request.prefix_hashes:
            return
        now = time.monotonic()
        for content_hash in request.prefix_hashes:
            self._routed.setdefault(content_hash, {})[replica_id.unique_id] = now
            self._routed.move_to_end(content_hash)
        while len(self._routed) > _MAX_REMEMBERED_BLOCKS:
            self._routed.popitem(last=False)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._in_flight.get(replica_id.unique_id, set()).discard(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._reported.pop(replica_id.unique_id, None)
        self._in_flight.pop(replica_id.unique_id, None)
        for replicas in self._routed.values():
            replicas.pop(replica_id.unique_id, None)

    def _num_matched_blocks(self, replica: RunningReplica, prefix_hashes: tuple[bytes, ...]) -> int:
        """How many of the prompt's leading blocks this replica holds (reported) or was sent lately (remembered)."""
        rid = replica.replica_id.unique_id
        reported = self._reported_hashes(rid, replica.routing_stats)
        oldest = time.monotonic() - self.memory_s
        for count, content_hash in enumerate(prefix_hashes):
            if content_hash not in reported and self._routed.get(content_hash, {}).get(rid, -1.0) < oldest:
                return count
        return len(prefix_hashes)

    def _reported_hashes(self, rid: str, stats: dict | None) -> frozenset[bytes]:
        # The stats object changes only when the replica reports anew: build the set once per report.
        stats = stats or {}
        cached = self._reported.get(rid)
        if cached is None or cached[0] is not stats:
            cached = (stats, frozenset(stats.get(PREFIX_HASHES_STAT, ())))
            self._reported[rid] = cached
        return cached[1]

    def _is_imbalanced(self, candidate_replicas: list[RunningReplica]) -> bool:
        """A replica's load: the requests this router has in flight on it, or what Ray last learnt from the replica
        (which counts other callers' requests too), whichever is more. Ray's figure alone lags: a probe answered
        before the replica has counted the requests on their way resets it, and a burst all went one way."""
        oldest = time.monotonic() - _CHOICE_TTL_S
        for request_id, (_, when) in list(self._chosen.items()):
            if when < oldest:  # never sent (cancelled, or Ray took another replica's rank): forget it
                del self._chosen[request_id]
        chosen = Counter(rid for rid, _ in self._chosen.values())
        lengths = [max(len(self._in_flight.get(r.replica_id.unique_id, ())) + chosen[r.replica_id.unique_id],
                       self.replica_queue_len_cache.get(r.replica_id) or 0) for r in candidate_replicas]
        return len(lengths) >= 2 and max(lengths) - min(lengths) > self.imbalanced_threshold

    def _two_choices(self, candidate_replicas: list[RunningReplica]) -> list[list[RunningReplica]]:
        """Ray's default: two replicas at random, of which Ray takes the less loaded."""
        candidates = list(candidate_replicas)
        return [random.sample(candidates, min(2, len(candidates)))] if candidates else []


def _request_of(pending_request: PendingRequest | None):
    if pending_request is None or not pending_request.args:
        return None
    return pending_request.args[0]
