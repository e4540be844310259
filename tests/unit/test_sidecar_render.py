"""Where the sidecar listens and how local tools and Prometheus reach it."""

from __future__ import annotations

import json

from vfleet.engine.compile import resolve
from vfleet.render.monitoring import scrape_target
from vfleet.render.plan import plan
from vfleet.render.release import render_files


def test_sidecar_listens_where_vllm_does_and_tools_use_loopback() -> None:
    for host, reached in (("127.0.0.1", "127.0.0.1"), ("0.0.0.0", "127.0.0.1")):
        sets = [f"host={host}", "port=8001", "allow_no_api_key=true"]
        launch = resolve("cpu", "tiny-dense", sets=sets)
        files = {f.name: f.content for f in render_files(launch)}
        assert json.loads(files["sidecar.json"])["listen"] == f"{host}:9501"
        assert scrape_target(launch)["sidecar_port"] == 9501
        p = plan("cpu", "tiny-dense", sets=sets)
        assert p.sidecar.url == f"http://{reached}:9501"


def test_sidecar_port_must_differ_from_vllm() -> None:
    import pytest

    from vfleet.errors import VfleetError

    with pytest.raises(VfleetError, match="rule sidecar"):
        resolve("cpu", "tiny-dense", sets=["port=8001", "sidecar_port=8001"])
