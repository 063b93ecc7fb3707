"""What a soak sends and what its nemesis does, drawn from one seed. Pure: no I/O, no clock.

**Load** (`plan_load`): requests arrive as a Poisson process. An arrival is a single request
or the first turn of a multi-turn session whose later turns follow their previous turn
(`think_s` after it ends, so the runner, not the plan, times them). Each request draws its
kind: chat or completions, streamed or not, a short or a long prompt, greedy or seeded
sampling (both deterministic, so a fault-free reference exists), `ignore_eos` or not; a
streamed one may be a client that disconnects after some tokens; a few are malformed (each
kind has the 400 and `param` the router must answer, `MALFORMED`). The arrival rate is set so
that requests (turns included) arrive at `rate` per second on average.

**Nemesis** (`plan_faults`): a fault starts every `max_interval_s / 2` to `max_interval_s`
seconds (so at least one per `max_interval_s`), each a kind drawn from the enabled ones with a
target drawn from the cluster's shape, and most last seconds, so they overlap. The plan keeps
one decode worker and one router out of reach at any time: the targets measure failover, and
a cluster with no decode worker (or no router) left serves nobody whatever it does. Both
prefill workers may be down together: the decode workers then prefill locally. A killed
process counts as busy for the time it typically takes to come back.

The same seed, duration, rate and shape give the same plans: a failed soak replays with the
seed its history records.
"""

from __future__ import annotations

import enum
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.errors import ConfigError

# Ordinary token ids of the tiny model, clear of its special tokens.
VOCAB = (40, 2000)
_WORDS = [
    "the",
    "a",
    "lease",
    "token",
    "block",
    "prefill",
    "decode",
    "worker",
    "router",
    "cache",
    "river",
    "map",
    "village",
    "sea",
    "engineer",
    "quick",
    "brown",
    "fox",
    "lazy",
    "dog",
    "once",
    "upon",
    "time",
    "small",
    "light",
    "night",
    "morning",
    "paper",
    "stone",
    "garden",
    "bird",
    "window",
    "train",
    "station",
    "letter",
    "story",
    "answer",
    "question",
    "number",
    "rain",
    "cloud",
    "field",
    "house",
    "door",
    "road",
]


class Api(enum.StrEnum):
    """Which OpenAI endpoint a request uses."""

    COMPLETIONS = "completions"
    CHAT = "chat"


class Malformed(enum.StrEnum):
    """A broken request; `MALFORMED` says what the router must answer."""

    BAD_JSON = "bad_json"
    WRONG_MODEL = "wrong_model"
    N_TWO = "n_two"
    BAD_TEMPERATURE = "bad_temperature"
    EMPTY_PROMPT = "empty_prompt"
    BAD_TOKEN_ID = "bad_token_id"
    TOO_LONG = "too_long"
    NO_MESSAGES = "no_messages"


@dataclass(frozen=True, slots=True)
class MalformedCase:
    """The body of a malformed request and the `param` its 400 must name (None: none)."""

    api: Api
    body: bytes
    param: str | None


def malformed_case(kind: Malformed, model: str, max_model_len: int) -> MalformedCase:
    """What to send for `kind`, and what must come back."""
    good = {"model": model, "prompt": "hello", "max_tokens": 4}
    cases: dict[Malformed, tuple[Api, object, str | None]] = {
        Malformed.BAD_JSON: (Api.COMPLETIONS, b'{"model": "x", "prompt": ', None),
        Malformed.WRONG_MODEL: (Api.COMPLETIONS, {**good, "model": "no-such-model"}, "model"),
        Malformed.N_TWO: (Api.COMPLETIONS, {**good, "n": 2}, "n"),
        Malformed.BAD_TEMPERATURE: (Api.COMPLETIONS, {**good, "temperature": -1}, "temperature"),
        Malformed.EMPTY_PROMPT: (Api.COMPLETIONS, {**good, "prompt": ""}, "prompt"),
        Malformed.BAD_TOKEN_ID: (Api.COMPLETIONS, {**good, "prompt": [5, 10**9]}, "prompt"),
        Malformed.TOO_LONG: (
            Api.COMPLETIONS,
            {**good, "prompt": [50] * max_model_len},
            "prompt",
        ),
        Malformed.NO_MESSAGES: (Api.CHAT, {"model": model, "messages": []}, "messages"),
    }
    api, body, param = cases[kind]
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return MalformedCase(api, raw, param)


@dataclass(frozen=True, slots=True)
class LoadMix:
    """Shares of each kind of request (each a probability)."""

    chat: float = 0.35
    stream: float = 0.6
    long_prompt: float = 0.2
    # Arrivals that start a session of 2..max_turns turns.
    session: float = 0.3
    max_turns: int = 4
    seeded: float = 0.5
    ignore_eos: float = 0.8
    # Streamed requests whose client leaves after some tokens.
    disconnect: float = 0.06
    malformed: float = 0.03

    def __post_init__(self) -> None:
        for name in (
            "chat",
            "stream",
            "long_prompt",
            "session",
            "seeded",
            "ignore_eos",
            "disconnect",
            "malformed",
        ):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"load mix {name}: must be in [0, 1], got {value}")
        if self.max_turns < 2:
            raise ConfigError(f"load mix max_turns: must be >= 2, got {self.max_turns}")

    @property
    def mean_turns(self) -> float:
        """Requests per arrival on average."""
        return 1 + self.session * ((2 + self.max_turns) / 2 - 1)


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    """One request of the load, before its prompt is completed by earlier turns' outputs."""

    index: int
    # Seconds after the load starts; a later turn starts no earlier than this and `think_s`
    # after its previous turn ended.
    at_s: float
    api: Api
    stream: bool
    max_tokens: int
    # 0: greedy; else seeded with `seed`.
    temperature: float
    seed: int | None
    ignore_eos: bool
    # What this turn adds: token ids (completions) or a user message (chat).
    new_token_ids: tuple[int, ...] = ()
    new_text: str = ""
    session: str | None = None
    turn: int = 0
    think_s: float = 0.0
    # The client leaves after receiving this many tokens.
    disconnect_after: int | None = None
    malformed: Malformed | None = None


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def _one(
    rng: random.Random, mix: LoadMix, index: int, at_s: float, api: Api, long: bool
) -> PlannedRequest:
    stream = rng.random() < mix.stream
    max_tokens = rng.randint(8, 48)
    seeded = rng.random() < mix.seeded
    disconnect = None
    if stream and rng.random() < mix.disconnect:
        disconnect = rng.randint(1, max_tokens - 1)
    if api is Api.COMPLETIONS:
        n = rng.randint(256, 512) if long else rng.randint(8, 64)
        ids = tuple(rng.randrange(*VOCAB) for _ in range(n))
        text = ""
    else:
        ids = ()
        text = _words(rng, rng.randint(150, 300) if long else rng.randint(4, 30))
    return PlannedRequest(
        index=index,
        at_s=at_s,
        api=api,
        stream=stream,
        max_tokens=max_tokens,
        temperature=round(rng.uniform(0.5, 1.0), 3) if seeded else 0.0,
        seed=rng.randrange(1 << 31) if seeded else None,
        ignore_eos=rng.random() < mix.ignore_eos,
        new_token_ids=ids,
        new_text=text,
        disconnect_after=disconnect,
    )


def plan_load(
    seed: int, duration_s: float, rate: float, mix: LoadMix | None = None
) -> list[PlannedRequest]:
    """Every request a soak of `duration_s` at `rate` requests/s may send, in index order."""
    if rate <= 0 or duration_s <= 0:
        raise ConfigError(f"rate and duration must be > 0, got {rate} and {duration_s}")
    mix = mix or LoadMix()
    rng = random.Random(f"pdserve-soak-load:{seed}")
    out: list[PlannedRequest] = []
    arrival_rate = rate / mix.mean_turns
    t = rng.expovariate(arrival_rate)
    while t < duration_s:
        index = len(out)
        if rng.random() < mix.malformed:
            kind = rng.choice(list(Malformed))
            out.append(
                PlannedRequest(index, t, Api.COMPLETIONS, False, 4, 0.0, None, True, malformed=kind)
            )
        elif rng.random() < mix.session:
            api = Api.CHAT if rng.random() < mix.chat else Api.COMPLETIONS
            session = f"s{index}"
            first = _one(rng, mix, index, t, api, rng.random() < mix.long_prompt)
            out.append(_as_turn(first, session, 0, 0.0))
            for turn in range(1, rng.randint(2, mix.max_turns)):
                later = _one(rng, mix, len(out), t, api, long=False)
                # A later turn adds a short user message (16-64 ids, or a few words).
                later = _as_turn(later, session, turn, round(rng.uniform(0.2, 1.0), 3))
                if api is Api.COMPLETIONS:
                    later = _with_ids(later, later.new_token_ids[: rng.randint(16, 64)])
                out.append(later)
        else:
            api = Api.CHAT if rng.random() < mix.chat else Api.COMPLETIONS
            out.append(_one(rng, mix, index, t, api, rng.random() < mix.long_prompt))
        t += rng.expovariate(arrival_rate)
    return out


def _as_turn(r: PlannedRequest, session: str, turn: int, think_s: float) -> PlannedRequest:
    return PlannedRequest(
        r.index,
        r.at_s,
        r.api,
        r.stream,
        r.max_tokens,
        r.temperature,
        r.seed,
        r.ignore_eos,
        r.new_token_ids,
        r.new_text,
        session,
        turn,
        think_s,
        r.disconnect_after,
        r.malformed,
    )


def _with_ids(r: PlannedRequest, ids: tuple[int, ...]) -> PlannedRequest:
    return PlannedRequest(
        r.index,
        r.at_s,
        r.api,
        r.stream,
        r.max_tokens,
        r.temperature,
        r.seed,
        r.ignore_eos,
        ids,
        r.new_text,
        r.session,
        r.turn,
        r.think_s,
        r.disconnect_after,
        r.malformed,
    )


# ---- the nemesis ---------------------------------------------------------------------------


class FaultKind(enum.StrEnum):
    """What the nemesis can do (`--nemesis` names)."""

    KILL_WORKER = "kill-worker"
    KILL_ROUTER = "kill-router"
    PAUSE_WORKER = "pause-worker"
    PAUSE_ROUTER = "pause-router"
    CORRUPT = "corrupt"
    TRUNCATE = "truncate"
    STALL = "stall"
    PARTITION = "partition"
    ETCD_RESTART = "etcd-restart"


ALL_FAULTS: tuple[FaultKind, ...] = tuple(FaultKind)
_PROCESS_FAULTS = frozenset(
    {FaultKind.KILL_WORKER, FaultKind.PAUSE_WORKER, FaultKind.KILL_ROUTER, FaultKind.PAUSE_ROUTER}
)
_ROUTER_FAULTS = frozenset({FaultKind.KILL_ROUTER, FaultKind.PAUSE_ROUTER})
_PAUSES = frozenset({FaultKind.PAUSE_WORKER, FaultKind.PAUSE_ROUTER})


def parse_nemesis(text: str) -> tuple[FaultKind, ...]:
    """ "all" or a comma list of fault names; ConfigError naming the flag and the bad name."""
    if text.strip() == "all":
        return ALL_FAULTS
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise ConfigError("--nemesis: no fault named (use all or a comma list)")
    kinds = []
    for name in names:
        try:
            kinds.append(FaultKind(name))
        except ValueError:
            known = ", ".join(k.value for k in FaultKind)
            raise ConfigError(f"--nemesis: unknown fault {name!r} (known: all, {known})") from None
    return tuple(dict.fromkeys(kinds))


@dataclass(frozen=True, slots=True)
class ClusterShape:
    """The names the nemesis may target."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    routers: tuple[str, ...]
    etcd: str | None = "etcd"


@dataclass(frozen=True, slots=True)
class PlannedFault:
    """One fault: when, what, on whom, for how long."""

    index: int
    at_s: float
    kind: FaultKind
    targets: tuple[str, ...]
    # How long a pause, partition or transfer fault lasts (0: a kill, instantaneous).
    duration_s: float = 0.0
    # Fault rules posted to the target's /admin/faults (transfer faults).
    rules: tuple[str, ...] = ()


# Seconds a killed process is typically away (restart backoff + start); the plan does not
# strike its group again meanwhile.
_AWAY_S = {FaultKind.KILL_WORKER: 12.0, FaultKind.KILL_ROUTER: 6.0, FaultKind.ETCD_RESTART: 6.0}
_TRANSFER_RULES = {
    FaultKind.CORRUPT: "transfer.send:corrupt:times=0,probability=0.5",
    FaultKind.TRUNCATE: "transfer.send:truncate:times=0,probability=0.3",
    FaultKind.STALL: "transfer.send:stall:times=0,probability=0.3",
}


def plan_faults(
    seed: int,
    duration_s: float,
    kinds: Sequence[FaultKind],
    shape: ClusterShape,
    max_interval_s: float = 8.0,
    first_at_s: float = 2.0,
) -> list[PlannedFault]:
    """The nemesis's faults for a soak of `duration_s` (see the module docstring)."""
    if max_interval_s <= 0:
        raise ConfigError(f"--fault-interval-s: must be > 0, got {max_interval_s}")
    rng = random.Random(f"pdserve-soak-nemesis:{seed}")
    # name -> until when it is out of reach (down, paused, or carrying a transfer fault)
    busy: dict[str, float] = {}
    # group -> until when one of its members is down or paused
    group_down: dict[str, float] = {}
    partition_until = 0.0
    groups = {"prefill": shape.prefill, "decode": shape.decode, "router": shape.routers}
    out: list[PlannedFault] = []
    t = first_at_s
    while t < duration_s and kinds:
        for kind in rng.sample(list(kinds), len(kinds)):
            fault = _draw(rng, kind, t, shape, groups, busy, group_down, partition_until)
            if fault is None:
                continue
            fault = PlannedFault(
                len(out), round(t, 3), fault.kind, fault.targets, fault.duration_s, fault.rules
            )
            out.append(fault)
            if kind is FaultKind.PARTITION:
                partition_until = t + fault.duration_s
            break
        t += rng.uniform(max_interval_s / 2, max_interval_s)
    return out


def _draw(
    rng: random.Random,
    kind: FaultKind,
    t: float,
    shape: ClusterShape,
    groups: dict[str, tuple[str, ...]],
    busy: dict[str, float],
    group_down: dict[str, float],
    partition_until: float,
) -> PlannedFault | None:
    """A fault of `kind` at `t` on free targets, recording what it occupies; None if none."""

    def free(name: str) -> bool:
        return busy.get(name, 0.0) <= t

    if kind in _PROCESS_FAULTS:
        members = [
            (group, n)
            for group in (("router",) if kind in _ROUTER_FAULTS else ("prefill", "decode"))
            if group == "prefill" or (len(groups[group]) > 1 and group_down.get(group, 0.0) <= t)
            for n in groups[group]
            if free(n)
        ]
        if not members:
            return None
        group, name = rng.choice(members)
        if kind in _PAUSES:
            duration, away = round(rng.uniform(1.0, 4.0), 3), 0.0
        else:
            duration, away = 0.0, _AWAY_S[kind]
        busy[name] = group_down[group] = t + duration + away + 1.0
        return PlannedFault(0, t, kind, (name,), duration)
    if kind in _TRANSFER_RULES:
        prefills = [n for n in shape.prefill if free(n)]
        if not prefills:
            return None
        name = rng.choice(prefills)
        duration = round(rng.uniform(3.0, 8.0), 3)
        busy[name] = t + duration
        return PlannedFault(0, t, kind, (name,), duration, (_TRANSFER_RULES[kind],))
    if kind is FaultKind.PARTITION:
        pairs = [(p, d) for p in shape.prefill for d in shape.decode if free(p) and free(d)]
        if not pairs or partition_until > t:
            return None
        pair = rng.choice(pairs)
        return PlannedFault(0, t, kind, pair, round(rng.uniform(2.0, 6.0), 3))
    if kind is FaultKind.ETCD_RESTART and shape.etcd is not None and free(shape.etcd):
        busy[shape.etcd] = t + _AWAY_S[kind]
        return PlannedFault(0, t, kind, (shape.etcd,))
    return None
