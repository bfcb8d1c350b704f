"""A tensorboard/ directory's scalars as TensorBoard shows them (its event files in name order; a purge event, the
SessionLog.START a SummaryWriter with purge_step writes, drops every earlier value at or after its step)."""

import struct
from pathlib import Path

from tensorboardX.proto.event_pb2 import Event, SessionLog


def scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    seen: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(Path(logdir).glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i + 12 <= len(data):  # records: length (8 bytes), its CRC (4), the event, its CRC (4)
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = Event.FromString(data[i + 12:i + 12 + n])
            i += n + 16
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                seen = {tag: [(s, v) for s, v in values if s < event.step] for tag, values in seen.items()}
            for value in event.summary.value:
                seen.setdefault(value.tag, []).append((event.step, value.simple_value))
    return seen
