"""The storaged client library (what inference links against; it never imports the server).

- `StorageClient(socket_path, *, timeout=60.0)`: `info() -> ServerInfo`, `stats() -> Stats`,
  `attach(model) -> Session`, `wait_until_serving(timeout)`, `close()`.
- `Session`: `acquire(layer, experts, *, stream=None, release_other_layers=False) -> list[int]`
  (slot ids, pinned until the layer's next acquire, or any layer's with release_other_layers;
  on CUDA the stream waits for copies in flight), `acquire_raw(layer, experts, *,
  release_other_layers=False) -> (slots, ready_events)`, `release(layer=None)`, `prefetch(layer, experts)`,
  `slot_bytes(slot, nbytes=None) -> uint8 tensor`, `object_layout(layer, expert) -> ObjectLayout`,
  `layers`, `slot_size`, `slot_count`, `arena`, `close()`.
- Errors: `StorageError` (base, `.code` a `StatusCode`, plain Python with gRPC's names and
  numbers; `.details`), `NotFound`, `InvalidRequest`,
  `CapacityExhausted`, `DataLoss`, `SessionBusy`, `Unavailable`; `ClientClosed`.
"""

from storaged.client.client import Session, StorageClient
from storaged.client.errors import (CapacityExhausted, ClientClosed, DataLoss, InvalidRequest, NotFound,
                                    SessionBusy, StorageError, Unavailable)
from storaged.client.layout import LayerLayout, ObjectLayout, RoleLayout
from storaged.client.replies import ModelInfo, ServerInfo, Stats, TierStats
from storaged.wire.status import StatusCode

__all__ = [
    "CapacityExhausted", "ClientClosed", "DataLoss", "InvalidRequest", "LayerLayout", "ModelInfo",
    "NotFound", "ObjectLayout", "RoleLayout", "ServerInfo", "Session", "SessionBusy", "Stats", "StatusCode",
    "StorageClient", "StorageError", "TierStats", "Unavailable",
]
