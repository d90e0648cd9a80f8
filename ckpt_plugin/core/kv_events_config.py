"""``--kv-events-config``: vLLM's ``KVEventsConfig``, the same JSON object with the same keys and defaults.

A deployment that runs vLLM with ``--kv-events-config '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557",
"replay_endpoint": "tcp://*:5558"}'`` passes the same text to ckpt-serve. What is published, and how, is
:mod:`ckpt_plugin.services.kv_events` (docs/server.md, "KV events").
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["ENDPOINT_SCHEMES", "KvEventsConfig", "parse_kv_events_config"]

ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


class KvEventsConfig(BaseModel):
    """vLLM's ``KVEventsConfig`` (vllm/config/kv_events.py): its fields, defaults and meaning; an unknown key is
    refused, as vLLM refuses it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enable_kv_cache_events: bool = Field(False, description="Publish KV events (BlockStored, BlockRemoved, "
                                         "AllBlocksCleared) for the pages of the states this server holds.")
    publisher: Literal["null", "zmq"] | None = Field(
        None, description='"zmq", or "null" for none; unset: "zmq" when enable_kv_cache_events, else "null".')
    endpoint: str = Field("tcp://*:5557", description="The PUB socket: bound where the address has a * (or ::, "
                          "ipc://, inproc://), else connected to a subscriber that binds.")
    replay_endpoint: str | None = Field(None, description="A ROUTER socket (bound) answering a request for the "
                                        "batches from a sequence number on, out of the last buffer_steps.")
    buffer_steps: int = Field(10_000, ge=0, description="Batches kept for the replay socket.")
    hwm: int = Field(100_000, ge=0, description="ZeroMQ high-water mark of the PUB socket: messages queued for a "
                     "slow subscriber before it drops them.")
    max_queue_size: int = Field(100_000, ge=1, description="Notifications waiting for the publisher's thread; "
                                "past them new ones are dropped and counted.")
    topic: str = Field("", description="The first frame of every message (subscribers filter on it).")

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(ENDPOINT_SCHEMES):
            raise ValueError(f"a ZeroMQ endpoint starts with {', '.join(ENDPOINT_SCHEMES)}, not {value!r}")
        return value

    @model_validator(mode="after")
    def _publisher(self) -> "KvEventsConfig":
        if self.publisher is None:  # vLLM's __post_init__: the flag alone turns the ZeroMQ publisher on
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        return self

    @property
    def publishing(self) -> bool:
        """Whether events are published: enabled, with the ZeroMQ publisher."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


def parse_kv_events_config(value: Any) -> Any:
    """The JSON text of a flag or variable as an object (a mapping or ``None`` passes through)."""
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return None
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"kv_events_config is not JSON: {exc}") from None
    return value
