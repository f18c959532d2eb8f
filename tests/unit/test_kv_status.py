"""NVMe KV status codes: decoded from a completion, judged the same way by every card driver."""

from __future__ import annotations

import logging

import pytest

from kvharbor.hal.base import DeviceError, DeviceFull, DeviceTransient, TargetUnreachable
from kvharbor.hal.kv_judge import StatusJudge
from kvharbor.hal.kv_status import (
    CAPACITY_EXCEEDED,
    HOST_PATHING_ERROR,
    INVALID_VALUE_SIZE,
    KEY_NOT_FOUND,
    NAMESPACE_NOT_READY,
    SUCCESS,
    KvStatus,
    StatusClass,
)


def test_decoding_takes_type_and_code_and_ignores_crd_more_dnr() -> None:
    # DNR (bit 14), More (bit 13) and CRD (bits 12:11) set around SCT 1h, SC 87h.
    assert KvStatus.decode((1 << 14) | (1 << 13) | (3 << 11) | (0x1 << 8) | 0x87) == KEY_NOT_FOUND
    assert KvStatus.decode(KEY_NOT_FOUND.encode()) == KEY_NOT_FOUND
    assert KEY_NOT_FOUND.code == "1/87h" and KEY_NOT_FOUND.kind is StatusClass.MISS
    assert KvStatus(0x3, 0x71).kind is StatusClass.UNAVAILABLE, "every path-related code is a lost path"
    assert KvStatus(0x7, 0x42).kind is StatusClass.OTHER and KvStatus(0x7, 0x42).meaning == "unknown status"


def test_misses_are_counted_never_logged(caplog: pytest.LogCaptureFixture) -> None:
    judge = StatusJudge("card")
    with caplog.at_level(logging.DEBUG):
        assert judge.judge(SUCCESS, "store") is True
        assert [judge.judge(KEY_NOT_FOUND, "retrieve") for _ in range(1000)] == [False] * 1000
    assert judge.counts() == {"1/87h": 1000}
    assert caplog.text == ""


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (CAPACITY_EXCEEDED, DeviceFull),
        (HOST_PATHING_ERROR, TargetUnreachable),
        (NAMESPACE_NOT_READY, DeviceTransient),
        (INVALID_VALUE_SIZE, DeviceError),
        (KvStatus(0x7, 0x42), DeviceError),  # A status no table knows.
    ],
)
def test_other_statuses_raise_typed_and_are_said_once_per_code(
    status: KvStatus, error: type[DeviceError], caplog: pytest.LogCaptureFixture
) -> None:
    judge = StatusJudge("card")
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            with pytest.raises(error, match=status.code):
                judge.judge(status, "store")
    assert judge.counts() == {status.code: 3}
    said = caplog.text.count(f"card 'card': store answered status {status.code} ({status.meaning})")
    assert said == (0 if status is CAPACITY_EXCEEDED else 1), "full is said by the tier; the rest once here"
