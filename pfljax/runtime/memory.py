"""Memory accounting before training: client data, state, the compiled round.

`memory_report` says, before the first round, how many bytes the run holds and
how many clients would fit: client data (train and test, as stored), the state
(`client_*` rows per client and the rest), the compiled round's
`memory_analysis()` where the backend gives it (temporaries, arguments,
outputs), and the memory available (`device_memory_bytes`: the accelerator's
free memory, or the host's available memory on CPU). `check_fits` turns an
estimate above the available memory into one clear error before training.
`host_memory_report` is its counterpart for clients kept in host memory
(pfljax.runtime.offload): host bytes follow C, device bytes follow the round's K.
"""

from __future__ import annotations

import os
from typing import Any

import jax

from pfljax.core.params import tree_bytes

ROUND_STATE_COPIES = 4  # state in, state out, the participants' updates and optimizer state


def device_memory_bytes(device=None) -> int | None:
    """The device's free memory in bytes (accelerators), available host memory
    on CPU, or None when unknown."""
    device = device or jax.local_devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001  some backends do not implement memory_stats
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    return host_memory_bytes()


def client_state_bytes(state: Any) -> int:
    """Bytes of the `client_*` fields of a state (the part that grows with C)."""
    fields = state._asdict() if hasattr(state, "_asdict") else vars(state)
    return sum(tree_bytes(v) for k, v in fields.items() if k.startswith("client_"))


def compiled_bytes(compiled) -> dict[str, int]:
    """The compiled program's memory_analysis() (temp, argument, output, alias,
    generated code bytes); {} where the backend does not give it."""
    try:
        analysis = compiled.memory_analysis()
    except Exception:  # noqa: BLE001  not implemented on every backend
        return {}
    if analysis is None:
        return {}
    names = ("temp", "argument", "output", "alias", "generated_code")
    return {f"round_{n}_bytes": int(getattr(analysis, f"{n}_size_in_bytes", 0) or 0) for n in names}


def memory_report(state: Any, data: Any, compiled=None, available: int | None = None) -> dict:
    """Bytes of a run before its first round, and the largest number of clients that fits.

    Args:
      state: the algorithm's state (arrays or ShapeDtypeStructs) for C clients.
      data: its ClientData.
      compiled: the compiled round (jax.stages.Compiled), for memory_analysis().
      available: bytes available (default: `device_memory_bytes()`).

    Returns a JSON-ready dict: num_clients, data_bytes, state_bytes,
    client_state_bytes_per_client, the compiled round's figures, estimated_bytes
    (data + ROUND_STATE_COPIES x state + the round's temporaries), available_bytes
    and max_clients (at the same data and state per client, the round's
    temporaries unchanged: they follow the participants, not C).
    """
    num = int(data.train.count.shape[0])
    data_bytes, state_bytes = tree_bytes(data), tree_bytes(state)
    per_client_state = client_state_bytes(state) / max(num, 1)
    fixed_state = state_bytes - per_client_state * num
    report = {
        "num_clients": num,
        "data_bytes": data_bytes,
        "state_bytes": state_bytes,
        "client_state_bytes_per_client": int(per_client_state),
        **(compiled_bytes(compiled) if compiled is not None else {}),
    }
    temp = report.get("round_temp_bytes", 0)
    report["fixed_state_bytes"] = int(fixed_state)
    report["estimated_bytes"] = int(data_bytes + ROUND_STATE_COPIES * state_bytes + temp)
    available = device_memory_bytes() if available is None else available
    report["available_bytes"] = available
    if available is not None:
        report["max_clients"] = max_clients(report, available)
    return report


def host_memory_report(
    host_data: Any,
    host_rows: Any,
    view_state: Any,
    view_data: Any,
    compiled=None,
    available: int | None = None,
) -> dict:
    """Bytes of a run whose clients live in host memory (pfljax.runtime.offload).

    Args:
      host_data, host_rows: every client's data and `client_*` state rows (host numpy).
      view_state, view_data: the state and data of one round's K participants.
      compiled: the compiled round on them, for memory_analysis().
      available: device bytes available (default: `device_memory_bytes()`).

    Returns a JSON-ready dict: client_storage "host", num_clients, clients_per_round,
    host_bytes and host_bytes_per_client (data and state rows of every client), the
    device figures, which follow K, not C: device_data_bytes (two rounds'
    participants' data: the running round's and the prefetched next), device_state_bytes
    (the view's state), the compiled round's figures, estimated_bytes (device_data_bytes
    + ROUND_STATE_COPIES x device_state_bytes + the round's temporaries), available_bytes
    and, as `max_clients`, the clients that fit at the same bytes per client in the host
    memory left (`device_memory_bytes(host)` on a CPU backend; the host's otherwise).
    """
    num, k = int(host_data.train.count.shape[0]), int(view_data.train.count.shape[0])
    host_bytes = tree_bytes((host_data, host_rows))
    report = {
        "client_storage": "host",
        "num_clients": num,
        "clients_per_round": k,
        "host_bytes": host_bytes,
        "host_bytes_per_client": host_bytes // max(num, 1),
        "device_data_bytes": 2 * tree_bytes(view_data),
        "device_state_bytes": tree_bytes(view_state),
        **(compiled_bytes(compiled) if compiled is not None else {}),
    }
    report["estimated_bytes"] = int(
        report["device_data_bytes"]
        + ROUND_STATE_COPIES * report["device_state_bytes"]
        + report.get("round_temp_bytes", 0)
    )
    report["available_bytes"] = device_memory_bytes() if available is None else available
    host_left = host_memory_bytes()
    if host_left is not None:
        report["host_available_bytes"] = host_left
        report["max_clients"] = num + int(host_left // max(report["host_bytes_per_client"], 1))
    return report


def host_memory_bytes() -> int | None:
    """The host's available memory in bytes, or None when unknown."""
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def max_clients(report: dict, available: int) -> int:
    """The largest C whose data (at the same bytes per client) and state fit in
    `available` bytes, the round's temporaries unchanged (they follow the participants)."""
    num = max(report["num_clients"], 1)
    per_client = report["data_bytes"] / num + ROUND_STATE_COPIES * report["client_state_bytes_per_client"]
    room = available - ROUND_STATE_COPIES * report["fixed_state_bytes"] - report.get("round_temp_bytes", 0)
    return int(max(room, 0) // max(per_client, 1))


def check_fits(report: dict, hint: str) -> None:
    """ValueError, one line naming `hint` (what to change), when the estimate exceeds
    the available memory."""
    need, have = report["estimated_bytes"], report.get("available_bytes")
    if have is not None and need > have:
        mib = {k: report[k] / 2**20 for k in ("data_bytes", "state_bytes")}
        raise ValueError(
            f"this run needs about {need / 2**20:.0f} MiB (client data {mib['data_bytes']:.0f} MiB, "
            f"state {mib['state_bytes']:.0f} MiB x {ROUND_STATE_COPIES}, the round's temporaries) "
            f"but {have / 2**20:.0f} MiB are available; about {report.get('max_clients', 0)} "
            f"clients fit: {hint}"
        )
