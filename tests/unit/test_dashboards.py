"""The Grafana dashboards: committed JSON is current, every query is sound PromQL over the right
series with the dashboard's filters, and the provisioning files say what Grafana needs.

No Prometheus or Grafana runs here, so a small PromQL parser (the subset the dashboards use)
stands in for Prometheus' own: it rejects unbalanced brackets, unknown functions, range
selectors where an instant vector belongs and the reverse, and it lists every series selector.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import yaml
from vfleet_healthcheck import switch_record

from vfleet.render import dashboards
from vfleet.render.dashboards import (
    DATASOURCE,
    EXPECTED_EMPTY,
    UIDS,
    PanelQuery,
    iter_panel_queries,
    substitute,
)

REPO = Path(__file__).resolve().parents[2]
GRAFANA = REPO / "observability" / "grafana"
DASH_DIR = GRAFANA / "dashboards"
FILTERS = {"host": ("=~", "$host"), "profile": ("=~", "$profile"), "preset": ("=~", "$preset")}

# Every series a dashboard may read: vLLM 0.32's names and the sidecar's (docs/OBSERVABILITY.md).
_HIST = ("time_to_first_token_seconds", "inter_token_latency_seconds", "iteration_tokens_total")
VLLM_SERIES = {
    *(
        f"vllm:{n}"
        for n in (
            "generation_tokens_total", "prompt_tokens_total", "spec_decode_num_drafts_total",
            "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
            "spec_decode_num_accepted_tokens_per_pos_total", "request_success_total",
            "num_preemptions_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
            "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
        )
    ),
    *(f"vllm:{h}_{s}" for h in _HIST for s in ("bucket", "sum", "count")),
    "process_start_time_seconds",
    "up",
}  # fmt: skip
SIDECAR_SERIES = {
    "vfleet_vllm_up", "vfleet_scrape_duration_seconds", "vfleet_window_seconds",
    "vfleet_spec_decode_acceptance_rate", "vfleet_spec_decode_mean_acceptance_length",
    "vfleet_spec_decode_position_acceptance_rate", "vfleet_spec_decode_drafts_per_second",
    "vfleet_spec_decode_draft_tokens_per_second", "vfleet_spec_decode_accepted_tokens_per_second",
    "vfleet_decode_tokens_per_second", "vfleet_prefill_tokens_per_second",
    "vfleet_steps_per_second", "vfleet_tokens_per_step", "vfleet_stream_decode_tokens_per_second",
    "vfleet_time_to_first_token_seconds", "vfleet_inter_token_latency_seconds",
    "vfleet_requests_running", "vfleet_requests_waiting", "vfleet_kv_cache_usage_ratio",
    "vfleet_engine_awake", "vfleet_engine_sleep_level",
    "vfleet_vllm_restarts_total", "vfleet_upstream_errors_total", "vfleet_info",
    "vfleet_spec_decode_running_depth", "vfleet_spec_decode_recommended_depth",
    "vfleet_spec_decode_recommended_gain_ratio", "vfleet_spec_decode_expected_tokens_per_second",
    "vfleet_decode_step_seconds", "vfleet_decode_step_floor_seconds", "vfleet_decode_floor_ratio",
    "vfleet_release_output_tokens_per_second", "vfleet_release_ttft_p95_seconds",
    "vfleet_release_spec_decode_acceptance_rate", "vfleet_release_tokens_per_step",
    *switch_record.METRICS,
}  # fmt: skip
STANDARD_UNITS = {"s", "percentunit", "reqps", "short", "none"}


# ---- a PromQL parser for the subset the dashboards use -----------------------------------------

_TOKEN = re.compile(
    r"""\s*(?:
      (?P<str>"(?:[^"\\]|\\.)*")
    | (?P<range>\[[^\]\[]*\])
    | (?P<num>\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)
    | (?P<ident>[A-Za-z_:][\w:]*)
    | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=])
    | (?P<punct>[(){},])
    )""",
    re.X,
)
AGGREGATIONS = {"sum", "avg", "min", "max", "count"}
FUNCTIONS = {  # name -> (number of arguments, index of the range-vector argument or None)
    "rate": (1, 0),
    "irate": (1, 0),
    "increase": (1, 0),
    "changes": (1, 0),
    "histogram_quantile": (2, None),
    "clamp_min": (2, None),
}
BINARY = {"+", "-", "*", "/", "%", "^", "==", "!=", "<", ">", "<=", ">="}
DURATION = re.compile(r"^(\d+[smhdwy])+$")
GRAFANA_WINDOWS = {"$__rate_interval", "$__interval", "$__range"}


class Selector(NamedTuple):
    metric: str
    matchers: dict[str, tuple[str, str]]
    window: str | None  # the range, for a range selector
    func: str | None  # the function that reads the range


class PromQL:
    """Recursive descent over tokens; `selectors` lists every series selector parsed."""

    def __init__(self, expr: str) -> None:
        self.toks: list[tuple[str, str]] = []
        pos, expr = 0, expr.rstrip()
        while pos < len(expr):
            m = _TOKEN.match(expr, pos)
            if not m or m.end() == pos:
                raise SyntaxError(f"cannot read {expr[pos : pos + 20]!r} in {expr!r}")
            kind = m.lastgroup or ""
            self.toks.append((kind, m.group(kind)))
            pos = m.end()
        self.i = 0
        self.selectors: list[Selector] = []

    def peek(self) -> tuple[str, str]:
        return self.toks[self.i] if self.i < len(self.toks) else ("eof", "")

    def take(self, kind: str | None = None, value: str | None = None) -> str:
        k, v = self.peek()
        if (kind and k != kind) or (value and v != value) or k == "eof":
            raise SyntaxError(f"expected {value or kind or 'a token'}, got {v or 'the end'!r}")
        self.i += 1
        return v

    def parse(self) -> PromQL:
        self.expr()
        if self.peek()[0] != "eof":
            raise SyntaxError(f"unexpected {self.peek()[1]!r}")
        return self

    def expr(self) -> None:
        self.unary()
        while self.peek()[0] == "op" and self.peek()[1] in BINARY:
            self.take()
            if self.peek()[1] == "bool":
                self.take()
            if self.peek()[1] in ("on", "ignoring"):
                self.take()
                self.labels()
                if self.peek()[1] in ("group_left", "group_right"):
                    self.take()
                    if self.peek()[1] == "(":
                        self.labels()
            self.unary()

    def unary(self) -> None:
        if self.peek() in (("op", "-"), ("op", "+")):
            self.take()
        self.primary()

    def primary(self) -> None:
        kind, val = self.peek()
        if kind in ("num", "str"):
            self.take()
        elif val == "(":
            self.take()
            self.expr()
            self.take("punct", ")")
        elif val in AGGREGATIONS:
            self.take()
            self.grouping()
            self.take("punct", "(")
            self.expr()
            self.take("punct", ")")
            self.grouping()
        elif kind == "ident" and self.toks[self.i + 1 : self.i + 2] == [("punct", "(")]:
            self.call()
        else:
            self.selector(None)

    def call(self) -> None:
        name = self.take("ident")
        if name not in FUNCTIONS:
            raise SyntaxError(f"unknown function {name}()")
        arity, range_arg = FUNCTIONS[name]
        self.take("punct", "(")
        for n in range(arity):
            if n:
                self.take("punct", ",")
            if n == range_arg:
                self.selector(name)
            else:
                self.expr()
        self.take("punct", ")")

    def selector(self, func: str | None) -> None:
        metric = self.take("ident")
        matchers: dict[str, tuple[str, str]] = {}
        if self.peek()[1] == "{":
            self.take()
            while self.peek()[1] != "}":
                label = self.take("ident")
                op = self.take("op")
                if op not in ("=", "!=", "=~", "!~"):
                    raise SyntaxError(f"bad matcher operator {op}")
                matchers[label] = (op, json.loads(self.take("str")))
                if self.peek()[1] != "}":
                    self.take("punct", ",")
            self.take("punct", "}")
        window = None
        if self.peek()[0] == "range":
            window = self.take()[1:-1]
            if not (DURATION.match(window) or window in GRAFANA_WINDOWS):
                raise SyntaxError(f"bad range [{window}]")
        if (window is None) != (func is None):
            where = f"in {func}()" if func else "outside a range function"
            raise SyntaxError(f"{metric}: range selector {'missing ' if func else ''}{where}")
        self.selectors.append(Selector(metric, matchers, window, func))

    def grouping(self) -> None:
        if self.peek()[1] in ("by", "without"):
            self.take()
            self.labels()

    def labels(self) -> None:
        self.take("punct", "(")
        while self.peek()[1] != ")":
            self.take("ident")
            if self.peek()[1] != ")":
                self.take("punct", ",")
        self.take("punct", ")")


def parse(expr: str) -> PromQL:
    """A panel's PromQL, or a variable's `label_values(selector, label)`."""
    m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", expr.strip(), re.S)
    if m:
        p = PromQL(m.group(1))
        p.selector(None)
        if p.peek()[0] != "eof":
            raise SyntaxError(f"label_values() takes one selector: {expr!r}")
        return p
    return PromQL(expr).parse()


# ---- fixtures -----------------------------------------------------------------------------------


def committed() -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(DASH_DIR.glob("*.json"))}


def panels(d: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for p in d.get("panels", []):
        out += [p, *panels(p)]
    return out


def all_queries() -> list[PanelQuery]:
    return [q for d in committed().values() for q in iter_panel_queries(d)]


def panel_queries() -> list[PanelQuery]:
    return [q for q in all_queries() if q.kind == "panel"]


def qid(q: PanelQuery) -> str:
    return f"{q.dashboard_uid}/{q.panel_title}/{q.ref_id or q.kind}"


# ---- the files ----------------------------------------------------------------------------------


def test_committed_dashboards_are_the_generated_ones() -> None:
    assert dashboards.check(DASH_DIR) == [], (
        "run: python -m vfleet.render.dashboards --write " + str(DASH_DIR.relative_to(REPO))
    )


def test_write_then_check_and_check_catches_drift(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert dashboards.main(["--write", str(tmp_path)]) == 0
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == sorted(f"{u}.json" for u in UIDS)  # no temp files left behind
    for name in files:
        text = (tmp_path / name).read_text()
        assert text == json.dumps(json.loads(text), sort_keys=True, indent=2) + "\n"
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o644
    assert dashboards.main(["--check", str(tmp_path)]) == 0

    f = tmp_path / "vfleet-fleet.json"
    f.write_text(f.read_text().replace('"vfleet / Fleet"', '"edited in the UI"'))
    (tmp_path / "vfleet-old.json").write_text("{}\n")
    (tmp_path / "vfleet-overview.json").unlink()
    capsys.readouterr()
    assert dashboards.main(["--check", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "vfleet-fleet.json: differs" in err and '-  "title": "edited in the UI"' in err
    assert "vfleet-overview.json: missing" in err
    assert "vfleet-old.json: not generated" in err


def test_three_dashboards_with_fixed_uids_and_tag() -> None:
    ds = committed()
    assert set(ds) == set(UIDS) == {"vfleet-overview", "vfleet-spec-decode", "vfleet-fleet"}
    for name, d in ds.items():
        assert d["uid"] == name
        assert "vfleet" in d["tags"]
        titles = [p["title"] for p in panels(d) if p["type"] != "row"]
        assert len(titles) == len(set(titles)), f"{name}: panel titles must be unique"
        ids = [p["id"] for p in panels(d)]
        assert len(ids) == len(set(ids)), f"{name}: panel ids must be unique"


def test_importing_the_module_does_not_import_the_sdk() -> None:
    code = "import sys, vfleet.render.dashboards; sys.exit('grafana_foundation_sdk' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# ---- panels -------------------------------------------------------------------------------------


def test_every_panel_reads_the_datasource_variable_and_has_a_unit() -> None:
    checked = 0
    for uid, d in committed().items():
        for p in panels(d):
            if p["type"] == "row":
                continue
            where = f"{uid}/{p['title']}"
            assert p["datasource"] == DATASOURCE, where
            assert p["targets"], f"{where}: no query"
            for t in p["targets"]:
                assert t["datasource"] == DATASOURCE, where
            unit = p["fieldConfig"]["defaults"].get("unit", "")
            assert unit in STANDARD_UNITS or re.fullmatch(r"suffix:\S.*", unit), (where, unit)
            checked += 1
    assert checked >= 25


def test_no_hard_coded_datasource_uid_anywhere() -> None:
    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            ds = node.get("datasource")
            if isinstance(ds, dict):
                assert ds == DATASOURCE, path
            for k, v in node.items():
                walk(v, f"{path}/{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}/{i}")

    for uid, d in committed().items():
        walk(d, uid)
        assert "vfleet-prometheus" not in json.dumps(d), uid


def test_graph_legends_name_the_host() -> None:
    for uid, d in committed().items():
        for p in panels(d):
            if p["type"] in ("timeseries", "stat"):
                for t in p["targets"]:
                    assert "{{host}}" in t["legendFormat"], f"{uid}/{p['title']}/{t['refId']}"


def test_expected_empty_names_real_panels() -> None:
    titles = {(q.dashboard_uid, q.panel_title) for q in panel_queries()}
    assert set(EXPECTED_EMPTY) <= titles
    assert all(EXPECTED_EMPTY.values())


def test_iter_panel_queries_sees_every_target_and_variable() -> None:
    for uid, d in committed().items():
        qs = iter_panel_queries(d)
        targets = [t for p in panels(d) for t in p.get("targets", [])]
        assert [q.expr for q in qs if q.kind == "panel"] == [t["expr"] for t in targets]
        assert {q.panel_title for q in qs if q.kind == "variable"} == {"host", "profile", "preset"}
        assert all(q.dashboard_uid == uid for q in qs)
    assert any(q.instant for q in panel_queries())  # the fleet table


# ---- PromQL -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        'sum(rate(vllm:prompt_tokens_total{host=~"$host"}[$__rate_interval])',  # unbalanced (
        'vllm:num_requests_running{host=~"$host"',  # unbalanced {
        "rate(vllm:prompt_tokens_total[5m)",  # unbalanced [
        'rate(vllm:prompt_tokens_total{host=~"$host"})',  # rate of an instant vector
        "vllm:prompt_tokens_total[5m]",  # range vector as a result
        "rate(vllm:prompt_tokens_total[5 m])",  # not a duration
        "ratee(vllm:prompt_tokens_total[5m])",  # unknown function
        'vllm:num_requests_running{host~"a"}',  # bad matcher
        "sum by (host (vllm:num_requests_running)",
        "vllm:num_requests_running /",
        "/ vllm:num_requests_running",
        "histogram_quantile(0.5)",
        'vllm:num_requests_running{host=~"$host"} $host',
    ],
)
def test_the_promql_checker_rejects_broken_queries(bad: str) -> None:
    with pytest.raises(SyntaxError):
        parse(bad)


@pytest.mark.parametrize("q", all_queries(), ids=qid)
def test_every_query_parses_before_and_after_substitution(q: PanelQuery) -> None:
    parse(q.expr)
    plain = substitute(q.expr, "2m")
    assert "$" not in plain
    for s in parse(plain).selectors:
        assert s.window is None or DURATION.match(s.window), s
        for _, (_, value) in s.matchers.items():
            re.compile(value)  # regex matchers must stay valid once variables are replaced


@pytest.mark.parametrize("q", panel_queries(), ids=qid)
def test_every_series_is_known_and_filtered_by_the_variables(q: PanelQuery) -> None:
    sels = parse(q.expr).selectors
    assert sels
    for s in sels:
        assert s.metric in VLLM_SERIES | SIDECAR_SERIES, f"unknown series {s.metric}"
        for label, matcher in FILTERS.items():
            assert s.matchers.get(label) == matcher, f'{s.metric} lacks {label}=~"${label}"'
        if s.metric in ("up", "process_start_time_seconds"):  # the sidecar exports them too
            assert s.matchers.get("job") == ("=", "vllm"), s.metric


@pytest.mark.parametrize("q", panel_queries(), ids=qid)
def test_counters_are_read_through_rate_over_the_rate_interval(q: PanelQuery) -> None:
    for s in parse(q.expr).selectors:
        counter = bool(re.search(r"_(total|count|sum|bucket)$", s.metric))
        if s.metric.startswith("vllm:"):
            assert not counter or s.func in ("rate", "increase"), f"{s.metric} read raw"
            if s.func:  # raw vLLM counters follow the zoom and the scrape interval
                assert s.window == ("$__range" if q.instant else "$__rate_interval"), s
        elif s.func in ("rate", "irate"):
            assert s.window == "$__rate_interval", s
        elif s.func in ("increase", "changes"):  # "in the last hour" on sidecar or start time
            assert s.window == "1h" or s.window == "$__rate_interval", s


def test_ratios_aggregate_both_sides_alike() -> None:
    """`sum by (x) (rate(a)) / sum by (x) (rate(b))`: never a ratio of unaggregated rates."""
    for q in panel_queries():
        for side in re.split(r"\s/\s(?:on \([^)]*\) group_left\s)?", q.expr)[1:]:
            assert side.lstrip("(").startswith("sum by (host"), qid(q)


def test_substitute() -> None:
    expr = 'rate(x{host=~"$host", profile=~"${profile}", preset=~"$preset"}[$__rate_interval])'
    assert substitute(expr) == 'rate(x{host=~".*", profile=~".*", preset=~".*"}[1m])'
    assert substitute("increase(x[$__range]) / $__interval", range_="6h") == (
        "increase(x[6h]) / 15s"
    )
    assert substitute("rate(x[$__rate_interval])", "30s") == "rate(x[30s])"
    with pytest.raises(ValueError, match=r"\$nope"):
        substitute("x{a=~'$nope'}")


# ---- variables ----------------------------------------------------------------------------------


def test_variables() -> None:
    for uid, d in committed().items():
        by_name = {v["name"]: v for v in d["templating"]["list"]}
        assert list(by_name) == ["datasource", "profile", "preset", "host"], uid
        assert by_name["datasource"]["type"] == "datasource"
        assert by_name["datasource"]["query"] == "prometheus"
        for name in ("host", "profile", "preset"):
            v = by_name[name]
            assert v["type"] == "query" and v["datasource"] == DATASOURCE, (uid, name)
            assert v["multi"] is True and v["includeAll"] is True and v["allValue"] == ".*"
            assert v["query"].startswith("label_values(") and v["query"].endswith(f", {name})")


# ---- provisioning -------------------------------------------------------------------------------


def test_datasource_provisioning() -> None:
    doc = yaml.safe_load((GRAFANA / "provisioning/datasources/vfleet.yml").read_text())
    assert doc["apiVersion"] == 1
    (ds,) = doc["datasources"]
    assert ds["uid"] == "vfleet-prometheus" and ds["name"] == "vfleet Prometheus"
    assert ds["type"] == "prometheus" and ds["isDefault"] is True
    assert ds["url"] == "${VFLEET_PROMETHEUS_URL}"


def test_dashboard_provisioning() -> None:
    doc = yaml.safe_load((GRAFANA / "provisioning/dashboards/vfleet.yml").read_text())
    assert doc["apiVersion"] == 1
    (p,) = doc["providers"]
    assert p["type"] == "file" and p["folder"] == "vfleet"
    assert p["allowUiUpdates"] is False
    assert p["options"] == {
        "path": "/var/lib/grafana/dashboards/vfleet",
        "foldersFromFilesStructure": False,
    }
