"""What a running vLLM server says about itself: the model it serves and its version.

Shared by `vfleet bench`, the performance gate and `vfleet tune` (every one of them benches a
server it did not start, so it asks the server rather than the profile).
"""

from __future__ import annotations

from vfleet.errors import VfleetError
from vfleet.measure.client import BenchError, Client


class Unreachable(VfleetError):
    """The server could not be used: not bad input, so exit 1."""

    exit_code = 1


def served_model(
    client: Client, wanted: str | None, max_model_len: int | None
) -> tuple[str, int | None]:
    """The served model to use and its max_model_len, from /v1/models."""
    try:
        data = client.request_json("GET", "/v1/models", timeout=30)
    except BenchError as exc:
        raise Unreachable(
            str(exc), where=client.base_url, fix="start the server, or check --url (and the key)"
        ) from None
    items = data.get("data") if isinstance(data, dict) else None
    models = {str(m["id"]): m for m in items or [] if isinstance(m, dict) and "id" in m}
    if wanted is None:
        if len(models) != 1:
            raise VfleetError(
                f"the server serves {len(models)} models: {', '.join(models) or 'none'}",
                key="--model",
                fix="pass --model NAME",
            )
        wanted = next(iter(models))
    elif wanted not in models:
        raise VfleetError(
            f"{wanted!r} is not served by {client.base_url}",
            key="--model",
            fix=f"one of: {', '.join(models) or '(none listed)'}",
        )
    listed = models[wanted].get("max_model_len")
    if max_model_len is None and isinstance(listed, int):
        max_model_len = listed
    return wanted, max_model_len


def server_version(client: Client) -> str | None:
    try:
        data = client.request_json("GET", "/version", timeout=30)
    except BenchError:
        return None
    version = data.get("version") if isinstance(data, dict) else None
    return version if isinstance(version, str) and version else None
