"""Affinity routing: place a request where its prefix already is, weighed against load.

No I/O: its only state is the prefix index, the session map and a ticket counter, all fed by
the flows; given them, every choice below is deterministic (the tests assert exact choices).

The policy ranks the same candidates as `policy.py` (healthy, the compatible fingerprint group,
the right role, not excluded) and only changes their order:

- **affinity** (the default). Each candidate's cost is
      prefix_weight * (prompt blocks it does not hold) + load_weight * (requests on it)
  where "holds" is the router's `PrefixIndex` (leading chained block hashes) and requests are
  running + waiting + router in-flight. Cheapest first; ties: more matched blocks, then the
  load order of `policy.py` (fewer requests, more free blocks, list order); but a worker
  without free blocks for prompt + max_tokens (it would refuse the reservation) goes after
  every worker with room. A **session** (the OpenAI `user` field or an `x-session-id` header)
  goes first to its holder: the candidate with room that holds the longest prefix of the
  prompt (its earlier turns) in the prefix index, the decode worker that served the session's
  last turn on this router breaking ties or standing alone when no worker holds any prefix.
  The index is fed by the workers' KV events, the same on every router, so a session keeps
  its worker when its turns go through another router. Without a holder the cost order
  stands, and the session moves to whichever worker serves the turn.
- **load**: exactly `policy.rank_decode` / `policy.pick_prefill` (prefix and session ignored).
- **round_robin**: candidates in list order rotated by the request's ticket (a benchmark
  baseline: placement ignores both cache and load).

Prefill workers are scored the same way against their own index entries (the prompts they
computed), role `prefill` before `both`, never the decode worker itself.

**Suffix-only work.** When the chosen decode worker holds all but at most
`local_prefill_threshold` prompt tokens (and holds some), `local_prefill` says so: the flow runs
the turn there with `/generate`, which prefills only the uncached suffix, with no prefill worker
and no KV transfer. Otherwise the reservation's `num_cached_tokens` (the decode worker's own
count) makes the prefill worker send only the missing blocks.

After a request finishes the flow calls `record`: the decode worker computed the prompt and
every output token but the last (its KV is written by the step after sampling), the prefill
worker the prompt.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from pdserve.engine.block_manager import prefix_block_hashes
from pdserve.router.config import AffinityConfig
from pdserve.router.placement import policy, revisions
from pdserve.router.placement.policy import WorkerView
from pdserve.router.placement.prefix_index import PrefixIndex
from pdserve.router.placement.revisions import RevisionBook


@dataclass(frozen=True, slots=True)
class RouteQuery:
    """What the policy needs to know about one request."""

    prompt_token_ids: Sequence[int]
    max_tokens: int
    # The conversation this request continues (None: no stickiness).
    session_id: str | None = None
    # The request's arrival number (round-robin rotates by it).
    ticket: int = 0
    # The model revision (fingerprint digest) the request is pinned to once a token was sent;
    # None: placed on the newest ready revision (`placement/revisions.py`).
    revision: str | None = None
    # Block hashes of the prompt by block size, computed once per request (a prompt of n
    # tokens costs n / block_size xxh3 calls; every candidate is scored against them).
    _hashes: dict[int, list[int]] = field(default_factory=dict, compare=False, repr=False)

    def block_hashes(self, block_size: int) -> list[int]:
        """Chained hashes of the prompt's whole blocks (the engine's prefix-cache keys)."""
        hashes = self._hashes.get(block_size)
        if hashes is None:
            hashes = prefix_block_hashes(list(self.prompt_token_ids), block_size)
            self._hashes[block_size] = hashes
        return hashes


@dataclass(frozen=True, slots=True)
class Score:
    """One candidate's cost and its parts."""

    url: str
    num_matched_blocks: int
    num_missing_blocks: int
    num_busy: int
    cost: float


def _busy(w: WorkerView) -> int:
    assert w.health is not None
    return w.health.num_running + w.health.num_waiting + w.num_inflight


def _incarnation(w: WorkerView) -> str:
    assert w.health is not None
    return f"{w.health.worker_id}:{w.health.pid}"


class AffinityPolicy:
    """Ranks decode and prefill candidates; remembers prefixes and sessions it placed."""

    def __init__(self, config: AffinityConfig | None = None) -> None:
        self.config = config or AffinityConfig()
        self.index = PrefixIndex()
        # session id -> (decode worker url, its incarnation), least recently used first. A
        # worker restarted at the same url holds nothing of the session, so it is no holder.
        self._sessions: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self._num_tickets = 0
        self.revisions = RevisionBook()
        # decode url -> prefill urls whose pair with it was attested slow or broken
        # (`router/workers/pair_probes.py`): chosen only when no other pair exists.
        self.avoid_pairs: Callable[[str], Collection[str]] = lambda _: ()

    # ---- queries ------------------------------------------------------------------------------

    def next_ticket(self) -> int:
        """A fresh arrival number for `RouteQuery.ticket`."""
        self._num_tickets += 1
        return self._num_tickets - 1

    def session_holder(self, session_id: str) -> str | None:
        """The decode worker that served the session's last turn."""
        holder = self._sessions.get(session_id)
        return None if holder is None else holder[0]

    def score(self, w: WorkerView, query: RouteQuery) -> Score:
        """`w`'s cost for the query's prompt (see the module docstring)."""
        assert w.health is not None
        size = w.health.block_size
        hashes = query.block_hashes(size)
        # A restarted worker (new pid) starts with an empty cache: observe() clears it.
        self.index.observe(w.url, _incarnation(w))
        matched = self.index.match(w.url, hashes)
        missing = -(-len(query.prompt_token_ids) // size) - matched
        busy = _busy(w)
        cost = self.config.prefix_weight * missing + self.config.load_weight * busy
        return Score(w.url, matched, missing, busy, cost)

    def cache_holders(
        self, workers: Sequence[WorkerView], token_ids: Sequence[int], exclude: Collection[str]
    ) -> list[str]:
        """Workers the index says hold leading blocks of `token_ids`, the most first (a
        resume's cache sources; the index may be stale, the source's own lookup decides).

        Only healthy workers of the pool's compatible fingerprint: KV from a worker that is
        not bit-compatible with the resuming one must never be offered (invariant 3)."""
        digest = policy.compatible_digest(workers)
        found: list[tuple[int, str]] = []
        for w in workers:
            if w.url in exclude or w.health is None or not w.healthy:
                continue
            if w.health.fingerprint_digest != digest:
                continue
            matched = self.index.match(w.url, prefix_block_hashes(list(token_ids), _size(w)))
            if matched:
                found.append((matched, w.url))
        return [url for _, url in sorted(found, key=lambda f: -f[0])]

    def num_matched_tokens(self, w: WorkerView, query: RouteQuery) -> int:
        """Leading prompt tokens `w` is believed to hold (whole blocks)."""
        if w.health is None:
            return 0
        return self.score(w, query).num_matched_blocks * w.health.block_size

    def local_prefill(self, decode: WorkerView, query: RouteQuery) -> bool:
        """True when `decode` should prefill the uncached suffix itself (no transfer)."""
        threshold = self.config.local_prefill_threshold
        if self.config.routing != "affinity" or threshold == 0:
            return False
        matched = self.num_matched_tokens(decode, query)
        return matched > 0 and len(query.prompt_token_ids) - matched <= threshold

    # ---- ranking ------------------------------------------------------------------------------

    def revision_views(
        self, views: Sequence[WorkerView], query: RouteQuery, colocated: bool = False
    ) -> list[WorkerView]:
        """The workers of the query's revision: the pinned one, else the one `revisions.choose`
        gives (every worker when no revision is ready)."""
        self.revisions.note(views)
        digest = query.revision or revisions.choose(
            views, self.revisions, query.ticket, colocated, self.config.canary_weight
        )
        return revisions.restrict(views, digest)

    def rank_decode(
        self, views: Sequence[WorkerView], query: RouteQuery, exclude: Collection[str] = ()
    ) -> list[WorkerView]:
        """Decode candidates (role decode or both) of the request's revision, best first."""
        views = self.revision_views(views, query)
        if self.config.routing == "load":
            return policy.rank_decode(views, exclude)
        return self._rank(views, query, ("decode", "both"), exclude)

    def rank_colocated(
        self, views: Sequence[WorkerView], query: RouteQuery, exclude: Collection[str] = ()
    ) -> list[WorkerView]:
        """Workers that run a whole request of the request's revision, best first (role both,
        else decode workers: `policy.rank_colocated`)."""
        views = self.revision_views(views, query, colocated=True)
        if self.config.routing == "load":
            return policy.rank_colocated(views, exclude)
        return self._rank(views, query, ("both",), exclude) or self._rank(
            views, query, ("decode",), exclude
        )

    def _rank(
        self,
        views: Sequence[WorkerView],
        query: RouteQuery,
        roles: tuple[str, ...],
        exclude: Collection[str],
    ) -> list[WorkerView]:
        routing = self.config.routing
        digest = policy.compatible_digest(views)
        if digest is None:
            return []
        found = policy.candidates(views, roles, digest, exclude)
        if routing == "round_robin":
            return _rotate(found, query.ticket)
        # A worker without free blocks for the whole request would refuse the reservation:
        # it goes after every worker with room, whatever its prefix.
        ranked = sorted(
            found,
            key=lambda w: (not _has_room(w, query), *self._affinity_key(w, query)),
        )
        holder = self._sticky(ranked, query)
        if holder is not None:
            ranked.remove(holder)
            ranked.insert(0, holder)
        return ranked

    def pick_prefill(
        self,
        views: Sequence[WorkerView],
        decode: WorkerView,
        query: RouteQuery,
        exclude: Collection[str] = (),
    ) -> WorkerView | None:
        """The prefill worker for `decode`: same digest (so the decode worker's revision),
        never `decode` itself; a pair attested slow only when no other exists."""
        avoid = set(self.avoid_pairs(decode.url)) - set(exclude)
        if avoid:
            chosen = self.pick_prefill(views, decode, query, {*exclude, *avoid})
            if chosen is not None:
                return chosen
        routing = self.config.routing
        if routing == "load" or decode.health is None:
            return policy.pick_prefill(views, decode, exclude)
        skip = {*exclude, decode.url}
        found = policy.candidates(
            views, ("prefill", "both"), decode.health.fingerprint_digest, skip
        )
        if not found:
            return None
        if routing == "round_robin":
            return _rotate([w for w in found if _role(w) == "prefill"] or found, query.ticket)[0]
        return min(
            found,
            key=lambda w: (_role(w) != "prefill", *self._affinity_key(w, query)),
        )

    def _affinity_key(self, w: WorkerView, query: RouteQuery) -> tuple[float, int, int, int, int]:
        s = self.score(w, query)
        busy, neg_free, index = policy.load_key(w)
        return (s.cost, -s.num_matched_blocks, busy, neg_free, index)

    def _sticky(self, ranked: Sequence[WorkerView], query: RouteQuery) -> WorkerView | None:
        """The session's holder, if it is a candidate with room for the request.

        The holder is the candidate holding the longest prefix of the prompt (the session's
        earlier turns), by the prefix index, the session's recorded worker breaking ties; with
        no prefix anywhere, the recorded worker. Fed by KV events, the index is the same on
        every router, so a session keeps its worker when its turns change routers.
        """
        if query.session_id is None:
            return None
        recorded = self._sessions.get(query.session_id)
        best: WorkerView | None = None
        best_key = (0, False)
        for w in ranked:
            if not _has_room(w, query):
                continue
            is_recorded = (w.url, _incarnation(w)) == recorded
            key = (self.index.match(w.url, query.block_hashes(_size(w))), is_recorded)
            if key > best_key:
                best, best_key = w, key
        return best

    # ---- learning -----------------------------------------------------------------------------

    def record(
        self,
        views: Sequence[WorkerView],
        decode_url: str,
        prefill_url: str | None,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        session_id: str | None = None,
    ) -> None:
        """A request finished: note what each worker computed, and the session's holder.

        The decode worker holds the prompt and every output token but the last; the prefill
        worker (if any) the prompt. Workers not in `views` (gone since) are skipped.
        """
        # Workers that left the pool take their entries with them (the index stays bounded).
        self.index.retain({w.url for w in views})
        by_url = {w.url: w for w in views if w.health is not None}
        computed = [*prompt_token_ids, *output_token_ids[:-1]]
        for url, tokens in ((decode_url, computed), (prefill_url, list(prompt_token_ids))):
            w = by_url.get(url) if url is not None else None
            if w is None or w.health is None:
                continue
            self.index.observe(w.url, _incarnation(w))
            hashes = prefix_block_hashes(tokens, w.health.block_size)
            self.index.insert(w.url, hashes, w.health.num_blocks)
        if session_id is not None and decode_url in by_url:
            self._sessions[session_id] = (decode_url, _incarnation(by_url[decode_url]))
            self._sessions.move_to_end(session_id)
            while len(self._sessions) > self.config.max_sessions:
                self._sessions.popitem(last=False)


def _has_room(w: WorkerView, query: RouteQuery) -> bool:
    """Free blocks (evictable cached ones included) for the prompt and max_tokens."""
    assert w.health is not None
    need = -(-(len(query.prompt_token_ids) + query.max_tokens) // w.health.block_size)
    return w.health.num_free_blocks >= need


def _size(w: WorkerView) -> int:
    assert w.health is not None
    return w.health.block_size


def _role(w: WorkerView) -> str | None:
    return w.role


def _rotate(found: Sequence[WorkerView], ticket: int) -> list[WorkerView]:
    ordered = sorted(found, key=lambda w: w.index)
    if not ordered:
        return []
    k = ticket % len(ordered)
    return ordered[k:] + ordered[:k]
