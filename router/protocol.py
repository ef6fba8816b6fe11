"""Messages between the router, decode workers and prefill workers (ZMQ, msgpack).

Every worker binds one ROUTER socket; whoever talks to it holds a DEALER whose
routing id is its own name. A worker answers on the socket a message came in on.

    router  -> decode   generate, abort, stats
    decode  -> router   tokens (one per request per step; logprobs of those tokens when
                        asked; the request's phase times with the last), rejected
                        (the request ends there, maybe after tokens; status 400: bad
                        input; 500: it failed on the worker: its engine step failed,
                        or the worker did), stats_reply (the worker's figures, with
                        `stalled` and `no_progress_s`: cluster/worker_loop.py)
    decode  -> prefill  prefill (decode-first push: D's blocks and deadline), abort
    prefill -> decode   prefill_done (error "" when every block was written; compute and
                        transfer seconds, bytes written)

Version 2: tokens carry logprobs and phases; prefill_done its timings.
Version 3: stats and stats_reply carry a sequence number, so the router's health pings
and its /metrics scrapes can share a connection without taking each other's replies.
Version 4: stats_reply carries the worker's prefix-cache events since its last reply
(kv_events: [block hash, cached?] in order; kv_reset: some were dropped, start over),
for the router's kv_aware index.
Version 5: prefill carries the decode worker's transport session: a prefill worker
writes only into the blocks of the process that reserved them, never into those of
one restarted under the same name.
Version 6: rejected carries an HTTP status: 400 for bad input, 500 for a request that
failed on the worker (the router answers with that status).
    launcher <-> worker  over the control channel (cluster/control.py): ready (address,
                         transport metadata), peers, serving (the first peers applied and
                         every KV handshake made: pre-warmed; `cold` names peers whose
                         handshake failed)
"""

from __future__ import annotations

from kv_transfer.messages import _BOOL, _BYTES, _DICT, _FLOAT, _INT, _LIST, _STR, Schema

WORKER = Schema(6, {
    "generate": {"id": _STR, "prompt": _LIST, "params": _DICT, "remote": _BOOL, "priority": _INT},
    "abort": {"id": _STR},
    "stats": {"seq": _INT},
    "tokens": {"id": _STR, "tokens": _LIST, "finished": _BOOL, "reason": _STR, "cached": _INT,
               "logprobs": _LIST, "phases": _DICT},
    "rejected": {"id": _STR, "error": _STR, "status": _INT},
    "stats_reply": {"seq": _INT, "stats": _DICT, "kv_events": _LIST, "kv_reset": _BOOL},
    "prefill": {"id": _STR, "prompt": _LIST, "peer": _STR, "blocks": _LIST, "first": _INT,
                "epoch": _INT, "deadline": _FLOAT, "session": _STR},
    "prefill_done": {"id": _STR, "error": _STR, "compute_s": _FLOAT, "transfer_s": _FLOAT, "bytes": _INT},
    "ready": {"name": _STR, "address": _STR, "metadata": _BYTES},
    "peers": {"prefill": _DICT, "decode": _LIST},
    "serving": {"cold": _LIST},
})
encode, decode = WORKER.encode, WORKER.decode
