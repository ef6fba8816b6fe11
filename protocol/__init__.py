"""The typed messages every pdserve process speaks, and their one wire form.

Neutral ground: the router, the worker roles, the KV transports (their control
messages, protocol/kv_control.py) and the launchers all import it, and it imports
nothing of theirs (only the engine's torch-free records whose wire forms travel inside
Generate: engine.sampling_params, how a request is sampled, and engine.lora.request,
the LoRA adapter it runs with).
"""

from engine.sampling_params import child_request_id
from protocol.control import CONTROL_MESSAGES, Peers, Ready, Serving, Stop
from protocol.kv_control import KV_CONTROL_MESSAGES
from protocol.sampling import WireSamplingParams, from_wire, to_wire
from protocol.stats import Histogram, KVTierStats, SpecDecodeStats, StepTimes, TierUsage, WorkerStats, mean_points
from protocol.wire import PROTOCOL_VERSION, Codec, Message, MessageError, encode
from protocol.worker import (
                             WORKER_MESSAGES,
                             Abort,
                             Generate,
                             LoRASpec,
                             PrefillDone,
                             Rejected,
                             RemotePrefill,
                             Stats,
                             StatsReply,
                             TokenLogprobs,
                             Tokens,
)

__all__ = ["CONTROL_MESSAGES", "KV_CONTROL_MESSAGES", "PROTOCOL_VERSION", "WORKER_MESSAGES", "Abort", "Codec", "Generate", "Histogram", "KVTierStats", "LoRASpec", "Message",
           "MessageError", "Peers", "PrefillDone", "Ready", "Rejected", "RemotePrefill", "Serving", "SpecDecodeStats", "StepTimes", "TierUsage",
           "Stats", "StatsReply", "Stop", "TokenLogprobs", "Tokens", "WireSamplingParams", "WorkerStats", "child_request_id",
           "encode", "from_wire", "mean_points", "to_wire"]
