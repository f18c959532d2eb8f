"""`GatewayStatus`'s one JSON form: what the socket, ``kvharbor status --json`` and the dashboard carry."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from kvharbor.gateway.status import GatewayStatus, StatusFormError, peek_release, tier_condition
from kvharbor.ops.status_text import codec_text, layouts_text, render_status, write_queue_text
from kvharbor.telemetry.metrics import CodecStats
from tests.support.status_sample import LAYOUT, UNREGISTERED, sample_status


def test_the_json_form_round_trips_into_the_same_typed_status() -> None:
    status = sample_status()
    again = GatewayStatus.from_json(status.to_json())
    assert again == status
    assert again.layouts[0].fingerprint.chunk_size == 16 and again.cards["card"].capacity_usage.value == "WARNING"
    assert again.store.tiers[0].layouts == {LAYOUT.digest().hex(): 2, UNREGISTERED: 1}
    tier = again.store.tiers[0]
    assert tier.write_queue is not None and tier.write_queue.depth == 3 and tier.counters.async_dropped == 2
    assert tier.counters.codec.ratio == 4.0 and tier.counters.codec.decoded_values == 1


def test_the_human_status_says_a_tier_s_write_queue_and_what_its_codec_achieved() -> None:
    status = sample_status()
    text = render_status(status)
    assert (
        "write queue: 3 of 256 writes, 3.0 MiB of 1.00 GiB (2 workers); 5 written, 2 dropped (queue full), "
        "1 lost at shutdown" in text
    ), text
    assert "codec none: ratio 4.00 over 4 values; compresses at 4 MiB/s, decompresses at 2 MiB/s" in text
    tier = status.store.tiers[0]
    plain = dataclasses.replace(tier, write_queue=None, counters=dataclasses.replace(tier.counters, codec=CodecStats()))
    assert write_queue_text(plain) is None and codec_text(plain) is None


def test_each_registered_layout_shows_its_objects_per_tier_and_the_rest_are_unregistered() -> None:
    status = sample_status()
    registered, unregistered = layouts_text(status)
    assert registered.startswith(f"{LAYOUT.short()}: by 'vllm-worker rank 0' ")
    assert registered.endswith(", this run; objects: card 2")
    assert unregistered == "unregistered: objects: card 1 (1 digest)"
    (layout,) = status.layouts
    alone = dataclasses.replace(status, layouts=[], store=dataclasses.replace(status.store, tiers=[]))
    assert layouts_text(alone) == ["none registered"]
    unstored = dataclasses.replace(status, store=dataclasses.replace(status.store, tiers=[]))
    assert layouts_text(unstored)[0].endswith("; objects: none") and layout.this_run


def test_an_unreadable_card_temperature_survives_as_nan_in_strict_json() -> None:
    text = sample_status(temperature_c=math.nan).to_json()
    document = json.loads(text)  # Strict JSON: no bare NaN token.
    assert document["cards"]["card"]["temperature_c"] == "NaN"
    assert math.isnan(GatewayStatus.from_json(text).cards["card"].temperature_c)


def test_a_document_of_another_form_is_refused_naming_the_field_and_its_release_still_read() -> None:
    document = sample_status().to_document()
    del document["shm"]
    text = json.dumps(document)
    with pytest.raises(StatusFormError, match="shm"):
        GatewayStatus.from_json(text)
    assert peek_release(text) == ("0.0.0", 8)
    assert peek_release("[1]") is None and peek_release("not json") is None


def test_hit_rates_are_none_before_any_lookup_and_tokens_over_tokens_after() -> None:
    rate = sample_status().hit_rate
    assert rate.recent == 0.5 and rate.total == 48 / 128
    empty = GatewayStatus.from_json(
        sample_status().to_json().replace('"recent_lookup_tokens":64', '"recent_lookup_tokens":0')
    )
    assert empty.hit_rate.recent is None


def test_tier_conditions_name_the_breaker_the_health_and_the_tiers_that_did_not_open() -> None:
    status = sample_status()
    assert status.tier_conditions() == {
        "card": "degraded: CapacityUsage WARNING",
        "files": "unavailable: no such directory",
    }
    (tier,) = status.store.tiers
    open_breaker = dataclasses.replace(tier, breaker="open")
    assert tier_condition(open_breaker).startswith("breaker open")
