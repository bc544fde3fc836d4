"""Every invalid setting names its variable (issue 22): a user who typed
HARMPI_TRANSPORT=tpc must be told which of the HARMPI_* variables is wrong."""

from __future__ import annotations

import pytest

from harmpi.config import Config
from harmpi.errors import HarmpiArgumentError

BAD = {
    "HARMPI_TIMEOUT_S": "x",
    "HARMPI_SPIN_COUNT": "-1",
    "HARMPI_SCHED_SLICE_US": "50",
    "HARMPI_SLOT_BYTES": "100",
    "HARMPI_SMALL_MAX_BYTES": "a",
    "HARMPI_HAR_LATENCY_MAX_BYTES": "-3",
    "HARMPI_ALGORITHM": "bfly",
    "HARMPI_TRANSPORT": "tpc",
    "HARMPI_RANKS_PER_NODE": "0",
    "HARMPI_STREAM_STORES": "q",
    "HARMPI_NATIVE": "maybe",
    "HARMPI_LOGITS_ROUTE": "z",
    "HARMPI_LOGITS_ALLREDUCE_MAX_BYTES": "x",
    "HARMPI_ABORT_ON_EXCEPTION": "2",
    "HARMPI_PROFILE": "p",
    "HARMPI_PROFILE_RECORDS": "-1",
    "HARMPI_IB_PORT": "x",
    "HARMPI_IB_GID_INDEX": "-1",
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_invalid_environment_setting_names_its_variable(name):
    with pytest.raises(HarmpiArgumentError) as exc:
        Config.from_env({name: BAD[name]})
    assert name in str(exc.value) and BAD[name] in str(exc.value)


@pytest.mark.parametrize("field, value, name", [
    ("transport", "tpc", "HARMPI_TRANSPORT"),
    ("algorithm", "bfly", "HARMPI_ALGORITHM"),
    ("spin_count", -1, "HARMPI_SPIN_COUNT"),
    ("sched_slice_us", 200_000, "HARMPI_SCHED_SLICE_US"),
    ("slot_nbytes", 100, "HARMPI_SLOT_BYTES"),
])
def test_invalid_config_field_names_field_and_variable(field, value, name):
    with pytest.raises(HarmpiArgumentError) as exc:
        Config(**{field: value})
    assert name in str(exc.value) and f"Config.{field}" in str(exc.value)
