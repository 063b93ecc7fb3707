"""What a soak sends, drawn from one seed. Pure: no I/O, no clock.

**Load** (`plan_load`): requests arrive as a Poisson process. An arrival is a single request
or the first turn of a multi-turn session whose later turns follow their previous turn
(`think_s` after it ends, so the runner, not the plan, times them). Each request draws its
kind: chat or completions, streamed or not, a short or a long prompt, greedy or seeded
sampling (both deterministic, so a fault-free reference exists), `ignore_eos` or not; a
streamed one may be a client that disconnects after some tokens; a few are malformed (each
kind has the 400 and `param` the router must answer, `MALFORMED`). The arrival rate is set so
that requests (turns included) arrive at `rate` per second on average.

The same seed, duration and rate give the same plan: a failed soak replays with the seed its
history records (the faults: `nemesis_plan`).
"""

from __future__ import annotations

import enum
import json
import random
from dataclasses import dataclass, replace

from pdserve.errors import ConfigError

# Ordinary token ids of the tiny model, clear of its special tokens.
VOCAB = (40, 2000)
_WORDS = tuple(
    [
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
)


class Api(enum.StrEnum):
    """Which OpenAI endpoint a request uses."""

    COMPLETIONS = "completions"
    CHAT = "chat"


class Malformed(enum.StrEnum):
    """A broken request; `MALFORMED` says what the router must answer."""

    BAD_JSON = "bad_json"
    WRONG_MODEL = "wrong_model"
    N_ZERO = "n_zero"
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
        Malformed.N_ZERO: (Api.COMPLETIONS, {**good, "n": 0}, "n"),
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
            out.append(replace(first, session=session))
            for turn in range(1, rng.randint(2, mix.max_turns)):
                later = _one(rng, mix, len(out), t, api, long=False)
                # A later turn adds a short user message (16-64 ids, or a few words).
                think_s = round(rng.uniform(0.2, 1.0), 3)
                later = replace(later, session=session, turn=turn, think_s=think_s)
                if api is Api.COMPLETIONS:
                    later = replace(later, new_token_ids=later.new_token_ids[: rng.randint(16, 64)])
                out.append(later)
        else:
            api = Api.CHAT if rng.random() < mix.chat else Api.COMPLETIONS
            out.append(_one(rng, mix, index, t, api, rng.random() < mix.long_prompt))
        t += rng.expovariate(arrival_rate)
    return out
