"""Prometheus recording and alerting rules for vLLM, generated from one table.

`observability/prometheus/rules/vfleet.rules.yml` is the committed output of `rules_yaml()`
(a test keeps them equal; `vfleet prometheus rules --write` regenerates it). The recording
rules compute from vLLM's raw series the same figures the sidecar exports, so dashboards and
alerts work without the sidecar. Thresholds that differ per profile and model (acceptance floor,
decode baseline, TTFT budget) are series too, `vfleet:threshold:<name>{host,vfleet_instance}`,
rendered by `threshold_rules()` for the instances a Prometheus watches; an alert fires only
for instances that have a threshold.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import yaml
from vfleet_healthcheck import switch_record as switches

from vfleet.config.schema import Alerts

# The identity Prometheus attaches to every vLLM target (file_sd labels) plus vLLM's own label.
BY = "host, profile, preset, vfleet_instance, model_name"
VLLM = 'job="vllm"'


def _rate(series: str, window: str = "1m") -> str:
    return f"sum by ({BY}) (rate({series}{{{VLLM}}}[{window}]))"


def _quantile(q: float, hist: str, window: str = "5m") -> str:
    return f"histogram_quantile({q}, sum by ({BY}, le) (rate({hist}_bucket{{{VLLM}}}[{window}])))"


RECORDING: list[tuple[str, str]] = [
    ("vfleet:decode_tokens_per_second:rate1m", _rate("vllm:generation_tokens_total")),
    ("vfleet:prefill_tokens_per_second:rate1m", _rate("vllm:prompt_tokens_total")),
    ("vfleet:spec_decode_drafts_per_second:rate1m", _rate("vllm:spec_decode_num_drafts_total")),
    (
        "vfleet:spec_decode_draft_tokens_per_second:rate1m",
        _rate("vllm:spec_decode_num_draft_tokens_total"),
    ),
    (
        "vfleet:spec_decode_accepted_tokens_per_second:rate1m",
        _rate("vllm:spec_decode_num_accepted_tokens_total"),
    ),
    (
        "vfleet:spec_decode_acceptance_rate:rate1m",
        "vfleet:spec_decode_accepted_tokens_per_second:rate1m"
        " / vfleet:spec_decode_draft_tokens_per_second:rate1m > -1",
    ),
    (
        "vfleet:spec_decode_mean_acceptance_length:rate1m",
        "1 + vfleet:spec_decode_accepted_tokens_per_second:rate1m"
        " / vfleet:spec_decode_drafts_per_second:rate1m > -1",
    ),
    (
        "vfleet:spec_decode_position_acceptance_rate:rate1m",
        f"sum by ({BY}, position) "
        f"(rate(vllm:spec_decode_num_accepted_tokens_per_pos_total{{{VLLM}}}[1m]))"
        f" / on ({BY}) group_left vfleet:spec_decode_drafts_per_second:rate1m > -1",
    ),
    ("vfleet:steps_per_second:rate1m", _rate("vllm:iteration_tokens_total_count")),
    (
        "vfleet:tokens_per_step:rate1m",
        "vfleet:decode_tokens_per_second:rate1m / vfleet:steps_per_second:rate1m > -1",
    ),
    (
        "vfleet:stream_decode_tokens_per_second:rate1m",
        f"clamp_min(vfleet:decode_tokens_per_second:rate1m"
        f" - {_rate('vllm:time_to_first_token_seconds_count')}, 0)"
        f" / {_rate('vllm:inter_token_latency_seconds_sum')} > -1",
    ),
    (
        "vfleet:time_to_first_token_seconds:p50_5m",
        _quantile(0.5, "vllm:time_to_first_token_seconds"),
    ),
    (
        "vfleet:time_to_first_token_seconds:p95_5m",
        _quantile(0.95, "vllm:time_to_first_token_seconds"),
    ),
    (
        "vfleet:inter_token_latency_seconds:p50_5m",
        _quantile(0.5, "vllm:inter_token_latency_seconds"),
    ),
    (
        "vfleet:inter_token_latency_seconds:p95_5m",
        _quantile(0.95, "vllm:inter_token_latency_seconds"),
    ),
    ("vfleet:kv_cache_usage:ratio", f"max by ({BY}) (vllm:kv_cache_usage_perc{{{VLLM}}})"),
    ("vfleet:requests_running:sum", f"sum by ({BY}) (vllm:num_requests_running{{{VLLM}}})"),
    ("vfleet:requests_waiting:sum", f"sum by ({BY}) (vllm:num_requests_waiting{{{VLLM}}})"),
]
# `> -1` drops the NaN of 0/0 (an idle server) so that no series claims a rate it cannot know.

# threshold name -> Alerts field
THRESHOLDS: dict[str, str] = {
    "spec_decode_acceptance_floor": "acceptance_floor",
    "stream_decode_tokens_per_second_floor": "stream_decode_tokens_per_second_floor",
    "ttft_p95_seconds_budget": "ttft_p95_budget_s",
    "kv_cache_usage_ceiling": "kv_cache_usage_ceiling",
}


def _threshold(name: str) -> str:
    return f"on (host, vfleet_instance) group_left vfleet:threshold:{name}"


# The depth alert: the sidecar's expected gain of the recommended MTP depth over the running one
# (vfleet_healthcheck.depth) above this, for this long. 10 %: above the run-to-run spread of a
# decode measurement on these boxes, so a table measured once does not page on its own noise;
# 30 minutes: the sidecar's figure exists only while drafts flow, so this is 30 minutes of
# serving, not of idling (docs/TUNE.md, Recommended depth).
DEPTH_GAIN_ALERT = 0.10
DEPTH_GAIN_FOR = "30m"
# ...bridging gaps up to this long: one read of vLLM over the sidecar's timeout empties its
# window (vfleet_healthcheck.exporter), and the figure is back two scrapes later. Without the
# bridge each such gap started the 30 minutes again, so on a loaded host, where vLLM's /metrics
# is slow now and then, the alert could never fire (seen on the CPU profile: stop 42's CI).
# Idle longer than this still starts them again.
DEPTH_GAIN_BRIDGE = "2m"


# A switch that did not pass alerts for this long after it ended, or until the next switch of
# that instance passes (its record is replaced): the operator's answer is one command.
SWITCH_ALERT_S = 3600
SIDECAR = 'job="vfleet-sidecar"'


def _switch_ended(outcomes: list[str]) -> str:
    """The last switch to an instance (role `to`: one alert per switch, on the woken side)
    ended with one of ``outcomes`` within SWITCH_ALERT_S."""
    assert set(outcomes) <= set(switches.OUTCOMES), outcomes
    return (
        f'{switches.METRIC_OUTCOME}{{{SIDECAR}, role="to", outcome=~"{"|".join(outcomes)}"}}'
        f" and on (host, vfleet_instance) (time() - "
        f'{switches.METRIC_TIMESTAMP}{{{SIDECAR}, role="to"}} < {SWITCH_ALERT_S})'
    )


_SWITCH_SHOW = (
    "`vfleet switch show DIR` (DIR: the pair's `vfleet balancer` folder) gives the reason and "
    "each gate; `vfleet status` on the box shows the last switch per instance."
)


def _alert(
    name: str, expr: str, for_: str, severity: str, summary: str, description: str
) -> dict[str, Any]:
    return {
        "alert": name,
        "expr": expr,
        "for": for_,
        "labels": {"severity": severity},
        "annotations": {"summary": summary, "description": description},
    }


ALERTS: list[dict[str, Any]] = [
    _alert(
        "VfleetVllmDown",
        f"up{{{VLLM}}} == 0",
        "2m",
        "critical",
        "vLLM on {{ $labels.host }} ({{ $labels.vfleet_instance }}) is down",
        "Prometheus cannot scrape {{ $labels.instance }}. Check `vfleet status` and the "
        "instance log under <base>/logs/.",
    ),
    _alert(
        "VfleetSidecarDown",
        'up{job="vfleet-sidecar"} == 0',
        "5m",
        "warning",
        "vfleet sidecar on {{ $labels.host }} ({{ $labels.vfleet_instance }}) is down",
        "The derived figures and the info metric of this instance are missing; vLLM's own "
        "series and the recording rules still work.",
    ),
    _alert(
        "VfleetNoEngineAwake",
        # vLLM's sleep mode through the sidecar: a switch between resident engines that
        # stopped half-way (docs/SWAP.md) leaves every engine of the host asleep, and requests
        # wait in a paused queue instead of failing. A switch itself takes seconds.
        'sum by (host) (vfleet_engine_awake{job="vfleet-sidecar"}) == 0',
        "1m",
        "critical",
        "No vLLM engine on {{ $labels.host }} is awake",
        "Every engine the sidecars read is asleep (vllm:engine_sleep_state): requests wait "
        "unserved. `vfleet switch show` says what the last switch did; wake one with "
        "`vfleet switch to`.",
    ),
    _alert(
        "VfleetSwitchRolledBack",
        # The sidecar's record of the last `vfleet switch` (vfleet_healthcheck.switch_record):
        # a gate or step failed and the model that served before serves again, or nginx
        # refused the flip and nothing changed. Clients are served; the switch did not happen.
        _switch_ended(["rolled_back", "not_started"]),
        "0m",
        "warning",
        "vfleet switch to {{ $labels.host }} ({{ $labels.vfleet_instance }}) did not happen: "
        "{{ $labels.outcome }}, failed at {{ $labels.failed_at }}",
        "The switch was undone (or never started): the other model still serves. "
        + _SWITCH_SHOW
        + " Fix what failed (a failed greedy or acceptance gate: the woken engine answers "
        "otherwise than before it slept; wake, sleep, drain: the engine's or nginx's log), then "
        "run `vfleet switch to DIR {{ $labels.host }} -i INVENTORY` again.",
    ),
    _alert(
        "VfleetSwitchFailed",
        # The rollback failed too: neither model may serve (VfleetNoEngineAwake fires when
        # every engine of the host sleeps).
        _switch_ended(["failed"]),
        "0m",
        "critical",
        "vfleet switch to {{ $labels.host }} ({{ $labels.vfleet_instance }}) failed at "
        "{{ $labels.failed_at }} and its rollback failed",
        "The box may serve neither model. "
        + _SWITCH_SHOW
        + " Get one model serving first: `vfleet switch show DIR` says which replica is "
        "admitted and which sleeps; `vfleet balancer admit DIR HOST` and "
        "`vfleet switch to DIR HOST -i INVENTORY` for the one that served, or restart it "
        "(`make deploy HOST=...`).",
    ),
    _alert(
        "VfleetEngineRestarting",
        f"changes(process_start_time_seconds{{{VLLM}}}[15m]) >= 2",
        "0m",
        "critical",
        "vLLM on {{ $labels.host }} restarted {{ $value }} times in 15 minutes",
        "The engine is flapping: read the log for the error before the restarts (OOM, "
        "a kernel the GPU cannot run, a bad flag).",
    ),
    _alert(
        "VfleetSpecDecodeAcceptanceCollapse",
        # The rate exists only while drafts flow (0/0 is dropped); `and` says so explicitly.
        "vfleet:spec_decode_acceptance_rate:rate1m"
        f" < {_threshold('spec_decode_acceptance_floor')}"
        f" and on ({BY}) vfleet:spec_decode_draft_tokens_per_second:rate1m > 0",
        "10m",
        "warning",
        "MTP acceptance on {{ $labels.host }} is {{ $value | humanizePercentage }}, "
        "below this profile's floor",
        "Drafts are proposed but rarely accepted, so every step pays for drafting in vain. "
        "Known cause: YaRN rope scaling past the native context. Compare with the baseline "
        "and consider fewer speculative tokens.",
    ),
    _alert(
        "VfleetSpecDecodeDepthNotBest",
        # Only from a measured step-time table: a modelled one (state "modelled") is a guess
        # that the cost model's check shows off by 6-40% (docs/TUNE.md, The cost model).
        f"min_over_time(vfleet_spec_decode_recommended_gain_ratio{{{SIDECAR}}}"
        f"[{DEPTH_GAIN_BRIDGE}]) > {DEPTH_GAIN_ALERT} and ignoring(state) max_over_time("
        f'vfleet_spec_decode_recommendation_state{{{SIDECAR}, state="ok"}}[{DEPTH_GAIN_BRIDGE}])'
        " == 1",
        DEPTH_GAIN_FOR,
        "warning",
        "The recommended MTP depth on {{ $labels.host }} ({{ $labels.vfleet_instance }}) "
        "would decode {{ $value | humanizePercentage }} faster than the running one",
        "From the live per-position acceptance and the step times `vfleet tune` measured, "
        "another num_speculative_tokens would decode faster (vfleet_spec_decode_recommended_depth"
        " beside vfleet_spec_decode_running_depth; `vfleet status` shows both). Run `vfleet tune` "
        "on the host to confirm it and roll it out.",
    ),
    _alert(
        "VfleetDecodeBelowBaseline",
        "vfleet:stream_decode_tokens_per_second:rate1m"
        f" < {_threshold('stream_decode_tokens_per_second_floor')}",
        "10m",
        "warning",
        "Decode on {{ $labels.host }} is {{ $value | humanize }} tok/s per stream, below baseline",
        "Split it: tokens per step (acceptance) vs step time (inter-token latency). A lower "
        "step rate with the same acceptance points at the hardware or the backend.",
    ),
    _alert(
        "VfleetKvCacheNearFull",
        f"vfleet:kv_cache_usage:ratio > {_threshold('kv_cache_usage_ceiling')}",
        "5m",
        "warning",
        "KV cache on {{ $labels.host }} is {{ $value | humanizePercentage }} full",
        "Requests will queue or be preempted. Lower max_num_seqs or max_model_len, or add "
        "capacity (`vfleet plan` shows the budget).",
    ),
    _alert(
        "VfleetQueueBuilding",
        "min_over_time(vfleet:requests_waiting:sum[5m]) > 0",
        "5m",
        "warning",
        "{{ $value }} requests have waited on {{ $labels.host }} for 5 minutes",
        "Arrivals exceed what the instance serves: add a replica or lower the load.",
    ),
    _alert(
        "VfleetTtftP95AboveBudget",
        f"vfleet:time_to_first_token_seconds:p95_5m > {_threshold('ttft_p95_seconds_budget')}",
        "10m",
        "warning",
        "TTFT p95 on {{ $labels.host }} is {{ $value | humanizeDuration }}, above budget",
        "Long prompts, a cold prefix cache or a queue in front of prefill.",
    ),
]


def rules_doc() -> dict[str, Any]:
    return {
        "groups": [
            {
                "name": "vfleet-recording",
                "interval": "15s",
                "rules": [{"record": r, "expr": e} for r, e in RECORDING],
            },
            {"name": "vfleet-alerts", "rules": ALERTS},
        ]
    }


def threshold_rules(instances: Iterable[tuple[dict[str, str], Alerts | None]]) -> dict[str, Any]:
    """One constant series per instance and threshold that is set.

    Keyed by (host, vfleet_instance), so two deployments of the same profile and preset may
    carry different baselines; `profile` and `preset` are kept for reading.
    """
    rules: list[dict[str, Any]] = []
    seen: set[tuple[str, str]] = set()
    for labels, alerts in sorted(instances, key=lambda i: (i[0]["host"], i[0]["vfleet_instance"])):
        key = (labels["host"], labels["vfleet_instance"])
        if key in seen or alerts is None:
            continue
        seen.add(key)
        for name, field in THRESHOLDS.items():
            value = getattr(alerts, field)
            if value is not None:
                rules.append(
                    {
                        "record": f"vfleet:threshold:{name}",
                        "expr": f"vector({value})",
                        "labels": {
                            k: labels[k] for k in ("host", "vfleet_instance", "profile", "preset")
                        },
                    }
                )
    return {"groups": [{"name": "vfleet-thresholds", "rules": rules}]}


HEADER = (
    "# Generated by `vfleet prometheus rules --write` from src/vfleet/render/promrules.py."
    " Do not edit.\n"
)
THRESHOLDS_HEADER = (
    "# Rendered by vfleet from the deployed instances' `alerts:` settings. Do not edit.\n"
)


class _Dumper(yaml.SafeDumper):
    """Indent lists under their key, as yamllint (and promtool's own files) expect."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)


def to_yaml(doc: dict[str, Any], header: str = HEADER) -> str:
    return header + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=100, allow_unicode=True)


def rules_yaml() -> str:
    return to_yaml(rules_doc())
