"""Rules: what is served and where (model directory and name, listen address, API key)."""

from __future__ import annotations

from vfleet.engine.rules.core import (
    FIELD_NOTES,
    Ctx,
    rule,
)


@rule("model", FIELD_NOTES, "serve the model directory on the host under a stable name")
def model(c: Ctx) -> None:
    model_dir = c.s.model_dir or c.host.model_dir(c.model.name)
    c.d.model_dir = model_dir
    c.arg("model", model_dir, "the model directory on the serving host")
    name = c.s.served_model_name or c.model.served_model_name
    c.d.served_model_name = name
    c.arg("served-model-name", name, "the name clients put in `model`; stable across swaps")


@rule("listen", "vfleet default", "listen on loopback unless told otherwise")
def listen(c: Ctx) -> None:
    # Where: the rule `front` (api_surface) decided it, and whether vLLM hides behind nginx.
    if c.d.front:
        why = f"behind the nginx front on {c.d.host}:{c.d.port}: only it may be reached"
    elif c.d.vllm_host.startswith("127."):
        why = "loopback by default: put nginx or a firewall in front before opening it"
    else:
        why = "operator setting"
    c.arg("host", c.d.vllm_host, why)
    c.arg("port", c.d.vllm_port, "OpenAI-compatible API and /metrics")


# The variable vLLM reads the API key from.
API_KEY_ENV = "VLLM_API_KEY"


@rule(
    "api-key-in-env",
    "vfleet security policy; vLLM source (envs.py reads VLLM_API_KEY)",
    "the API key goes into the 0600 env file, never into argv or unit files",
)
def api_key_in_env(c: Ctx) -> None:
    if c.s.api_key is not None:
        c.setenv(
            API_KEY_ENV,
            c.s.api_key.get_secret_value(),
            "vLLM reads it when --api-key is absent; argv is visible to every user in ps",
            secret=True,
        )
