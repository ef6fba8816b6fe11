"""The fuzzers' shared parts: what a case is, the oracle (each request alone in a roomy
colocated engine), and how a run is checked and its failures recorded
(tests/fuzz/harness.py)."""

from __future__ import annotations

import json
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from engine import LLM, SamplingParams
from engine.engine_core import EngineCore
from engine.lora.request import LoRARequest
from engine.request import Request, RequestStatus
from protocol import LoRASpec
from tests.fuzz.structured import violation
from tests.lora_adapters import spec_of

VOCAB = 384  # tests/tiny_models.py
MAX_MODEL_LEN = 1024
ORACLE_MIN_TOKENS = 1  # the oracle generates at least this many (shorter max_tokens: a prefix)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def spec_params(spec: ReqSpec, max_tokens: int | None = None) -> SamplingParams:
    """Greedy, ignore_eos, unless spec.params says otherwise (penalties, min_tokens and
    stop tokens, seeded sampling: all deterministic for a prompt alone)."""
    kw: dict[str, Any] = dict(temperature=0.0, ignore_eos=True)
    kw.update(spec.params)
    kw["max_tokens"] = spec.max_tokens if max_tokens is None else max_tokens
    kw["min_tokens"] = min(kw.get("min_tokens", 0), kw["max_tokens"])
    return SamplingParams(**kw)


# ----------------------------------------------------------------------------- oracle

# Options every fuzzed engine and the oracle take on top of their own (benchmarks/fuzz/
# schedules.py --kv-cache-dtype): the oracle is then that configuration's colocated engine.
ENGINE_OPTIONS: dict[str, Any] = {}
# --lora: the adapters the fuzzed requests may name (tests/fuzz/lora.py fills it).
LORA_ADAPTERS: dict[str, LoRARequest] = {}


def lora_request_of(name: str | None) -> LoRARequest | None:
    return None if name is None else LORA_ADAPTERS[name]


def lora_spec(name: str | None) -> LoRASpec | None:
    """What a Generate carries for the adapter `name` (the decode worker's verb takes it)."""
    r = lora_request_of(name)
    return None if r is None else spec_of(r)


class Oracle:
    """What a request gets alone in a roomy colocated engine (no prefix caching, so every
    prompt is computed from scratch), cached per (prompt, sampling params but
    max_tokens): with a smaller max_tokens a request gets a prefix of it (its draws and
    min_tokens masking depend on the position alone), ending where a stop token ends it.
    expect() returns (tokens, status): status "stop" or "length"."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = str(model_dir)
        self.llm = LLM(self.model_dir, num_kv_blocks=256, block_size=16, max_num_batched_tokens=2048,
                       enable_prefix_caching=False, **ENGINE_OPTIONS)
        self._cache: dict[tuple, tuple[list[int], bool, int]] = {}  # -> tokens, stopped, max_tokens asked
        self.seconds = 0.0

    @staticmethod
    def _key(spec: ReqSpec) -> tuple:
        # min_tokens is capped by max_tokens (SamplingParams refuses more): keyed capped
        params = dict(spec.params, min_tokens=min(spec.params.get("min_tokens", 0), spec.max_tokens))
        return tuple(spec.prompt), json.dumps(params, sort_keys=True), spec.lora  # structured_outputs: a nested dict

    def expect(self, spec: ReqSpec) -> tuple[list[int], str]:
        key = self._key(spec)
        have = self._cache.get(key)
        if have is None or (not have[1] and have[2] < spec.max_tokens):
            t0 = time.monotonic()
            n = max(spec.max_tokens, ORACLE_MIN_TOKENS, have[2] if have else 0)
            n = min(n, MAX_MODEL_LEN - len(spec.prompt))
            out = self.llm.generate([list(spec.prompt)], spec_params(spec, n), use_tqdm=False,
                                    lora_request=lora_request_of(spec.lora))[0]
            have = (out.token_ids, out.finish_reason == "stop", n)
            self._cache[key] = have
            self.seconds += time.monotonic() - t0
        tokens, stopped, _ = have
        if stopped and len(tokens) <= spec.max_tokens:
            return list(tokens), "stop"
        return list(tokens[:spec.max_tokens]), "length"

    def text(self, token_ids: list[int]) -> str:
        """The tokens' text (structured outputs are checked on it)."""
        return self.llm.tokenizer.decode(token_ids)

    def tokens(self, prompt: list[int], max_tokens: int) -> list[int]:
        """Plain greedy (ignore_eos) tokens."""
        return self.expect(ReqSpec("", list(prompt), max_tokens))[0]

    def prefetch(self, specs: list[ReqSpec]) -> None:
        """Compute each distinct request once, for the most tokens any spec asks of it."""
        most: dict[tuple, ReqSpec] = {}
        for s in specs:
            key = self._key(s)
            if key not in most or most[key].max_tokens < s.max_tokens:
                most[key] = s
        for s in most.values():
            self.expect(s)


def hf_agreement(model_dir: str | Path, oracle: Oracle, prompts: list[list[int]],
                 max_tokens: int = 12) -> list[str]:
    """Compare the oracle with Hugging Face transformers' greedy generate on a few
    prompts; returns a description of each disagreement (empty: they agree)."""
    from tests.fidelity.test_hf_fidelity import hf_greedy

    refs = hf_greedy(Path(model_dir), prompts, max_tokens=max_tokens)
    bad = []
    for p, ref in zip(prompts, refs):
        ours = oracle.tokens(p, max_tokens)
        if ours != ref:
            bad.append(f"prompt len {len(p)} {p[:8]}...: oracle {ours} != HF {ref}")
    return bad


# ----------------------------------------------------------------------------- results

@dataclass
class Failure:
    seed: int
    kind: str  # mismatch | exception | hang | error_finish | invariant | rejection | constraint
    detail: str
    known: str = ""  # F1..F4 when it looks like a known bug, else ""

    def line(self) -> str:
        tag = f" [{self.known}]" if self.known else ""
        return f"seed={self.seed} kind={self.kind}{tag} {self.detail}"


@dataclass
class SeedResult:
    seed: int
    requests: int = 0
    failures: list[Failure] = field(default_factory=list)
    seconds: float = 0.0
    stats: dict[str, int] = field(default_factory=dict)


class Hang(Exception):
    pass


def live_followers() -> list[int]:
    """The pids of this process's children that are tensor-parallel followers
    (engine.distributed.follower) and still alive: none once every engine is closed."""
    import os

    me, found = str(os.getpid()), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rpartition(")")[2].split()
            if fields[1] != me or fields[0] == "Z":  # the parent's pid; a zombie is dead
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                if b"engine.distributed.follower" in fh.read():
                    found.append(int(entry))
        except (OSError, IndexError):  # gone meanwhile
            continue
    return found


def _exc_failure(seed: int, where: str, exc: BaseException, state: str = "") -> Failure:
    """An exception that escaped the engine (or the watchdog's Hang) as a Failure."""
    if isinstance(exc, Hang):
        return Failure(seed, "hang", f"{where}: {exc.args[0]}{' | ' + state if state else ''}",
                       exc.args[1] if len(exc.args) > 1 else "")
    tb = traceback.format_exc(limit=-12)
    return Failure(seed, "exception", f"{where}: {type(exc).__name__}: {exc} | {tb!r}"
                   f"{' | ' + state if state else ''}", _classify_exception(exc))


# ----------------------------------------------------------------------------- cases

@dataclass
class ReqSpec:
    rid: str
    prompt: list[int]
    max_tokens: int
    priority: int = 0
    arrive: int = 0  # step (offline) or tick (pd) at which it is added
    abort: int | None = None  # step/tick at which the client aborts it (None: never)
    # --- pd only
    remote: bool = True
    sender: bool = True  # D knows the prefill worker's agent name (as the real server does)
    fate: str = "ok"  # ok | lost (prefill message never reaches P) | perror (P fails it) | spurious (D told it failed while P goes on)
    fate_at: int = -1  # ticks after arrival: lost -> D.prefill_failed then (-1: rely on the deadline); perror/spurious -> when
    params: dict[str, Any] = field(default_factory=dict)  # SamplingParams besides greedy, ignore_eos, max_tokens
    queue_tag: float = 0.0  # the router's fair-queuing tag (router/fair_queue.py): within a priority, lower first
    lora: str | None = None  # the LoRA adapter it names (tests/fuzz/lora.py)


@dataclass
class OfflineCase:
    seed: int
    engine: dict[str, Any]  # EngineConfig options besides model
    mode: str  # "core": drive EngineCore.step; "llm": LLM.generate, the requests split over 1-3 calls
    requests: list[ReqSpec]
    # "core" with tiers: the fuzz's shared KV store below them (tests/fuzz/shared_store.py),
    # restarted empty at step store_restart if that is not None
    shared_store: bool = False
    store_restart: int | None = None


@dataclass
class PDCase:
    seed: int
    transport: str
    dec: dict[str, Any]
    pre: dict[str, Any]
    deadline_s: float
    grace_s: float
    timeout_s: float
    slow_copy_p: float  # probability a write's data plane is slowed
    slow_copy_max_s: float  # by up to this
    p_skip: float  # probability P does not step in a tick (a slower prefill worker)
    jitter_s: float  # sleep up to this in some ticks (wall time passes: deadlines)
    msg_delay_max: int  # ticks a control message may take (each way, FIFO)
    requests: list[ReqSpec]
    d_skip: float = 0.0  # probability D does not step (nor poll) in a tick: a slow receiver
    # > 0: a copy that has started takes at most this long (queueing before it starts is
    # not bounded): within the transport's bounds (cancel_grace_s / 2), so no byte may
    # land once its blocks are released. 0: unbounded, as a stalled host can make it
    # (then D may rightly fail requests whose blocks a late write overwrote).
    copy_bound_s: float = 0.0
    # The engines with tiers share the fuzz's KV store (tests/fuzz/shared_store.py): P
    # writes its prompts' blocks through, D loads prefixes from it.
    shared_store: bool = False
    # transport_options.stream and stream_min_tokens of both transports: when P posts a
    # prompt's blocks (each as computed, each layer group as computed, or all once
    # prefilled), and stream_layers, layers per write in layer mode.
    stream: str = "chunk"
    stream_min_tokens: int = 0
    stream_layers: int = 1


def case_dict(case: OfflineCase | PDCase) -> dict[str, Any]:
    return asdict(case)


# ----------------------------------------------------------------------------- checks

def _classify_exception(exc: BaseException) -> str:
    msg = f"{type(exc).__name__}: {exc}"
    if "prefix hits only apply to a request holding" in msg:
        return "F1"
    return ""


def _classify_violation(params: dict[str, Any], why: str) -> str:
    """S1: json_object lets any JSON value through, not only an object
    (/work/shared/repro/issue17/json_object_not_object.py)."""
    return "S1" if "json_object" in params["structured_outputs"] and "is not a JSON object" in why else ""


def _sched_state(core: EngineCore) -> str:
    s = core.scheduler
    waiting = [(r.request_id, r.status.value, r.num_computed_tokens, r.num_tokens, len(core.kv.block_ids(r.request_id)))
               for _, r in sorted(s.waiting, key=lambda x: x[0])]
    running = [(r.request_id, r.num_computed_tokens, r.num_tokens, len(core.kv.block_ids(r.request_id)))
               for r in s.running]
    parked = [(r.request_id, r.status.value, len(core.kv.block_ids(r.request_id)))
              for r in s.requests.values() if r.status == RequestStatus.WAITING_FOR_REMOTE_KV]
    return (f"running={running} waiting={waiting} parked={parked} free_blocks={core.kv.num_free_blocks}/"
            f"{core.kv.pool.num_blocks} budget={s.max_num_batched_tokens} preemptions={s.num_preemptions}")


def _classify_hang(core: EngineCore) -> str:
    """F4: chunked prefill off, a preempted request longer than the budget can never be
    re-admitted. F2: nothing running; a request waiting behind one that cannot fit
    while requests holding blocks (parked or with remote KV) wait."""
    s = core.scheduler
    waiting = [r for _, r in sorted(s.waiting, key=lambda x: x[0])]
    if (not core.config.enable_chunked_prefill and s.num_preemptions
            and any(r.num_tokens > s.max_num_batched_tokens for r in waiting)):
        return "F4"
    holders = [r for r in s.requests.values() if r.status != RequestStatus.RUNNING and core.kv.block_ids(r.request_id)]
    if waiting and holders:  # nothing running (deadlock), or running ones thrashing (livelock)
        return "F2"
    return ""


def _check_tokens(seed: int, rid: str, request: Request, spec: ReqSpec, oracle: Oracle,
                  aborted: bool, failures: list[Failure], known: str = "") -> None:
    ref, status = oracle.expect(spec)
    got = list(request.output_token_ids)
    what = f"{rid} prompt_len={len(spec.prompt)} max_tokens={spec.max_tokens}{' params=' + str(spec.params) if spec.params else ''}"
    if aborted:
        if got != ref[:len(got)]:
            failures.append(Failure(seed, "mismatch", f"{what} (aborted): tokens so far {got} are not a prefix "
                                    f"of the oracle's {ref}", known))
        return
    if request.status not in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED):
        err = getattr(request, "error", None)
        failures.append(Failure(seed, "error_finish", f"{what} ended {request.status.value}"
                                f"{' error=' + str(err) if err else ''} with {len(got)} tokens", known))
        return
    if request.status == RequestStatus.FINISHED_STOPPED:
        check_constraint(seed, what, spec.params, got, oracle, failures, known)
    if got != ref or request.status.value != status:
        first = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
        failures.append(Failure(seed, "mismatch", f"{what} cached={request.num_cached_tokens} "
                                f"preemptions={request.num_preemptions} first diff at {first}: got {got} "
                                f"({request.status.value}) oracle {ref} ({status})", known))


def check_constraint(seed: int, what: str, params: dict[str, Any], tokens: list[int], oracle: Oracle,
                     failures: list[Failure], known: str = "") -> None:
    """A request that finished "stop" obeys its structured_outputs, if it has one."""
    why = violation(params, tokens, oracle.text)
    if why:
        failures.append(Failure(seed, "constraint", f"{what}: {why} (tokens {tokens})",
                                known or _classify_violation(params, why)))
