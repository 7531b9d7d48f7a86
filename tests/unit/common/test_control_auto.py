"""`max_staleness: auto` on the control plane: the config value, `ctl set max_staleness auto`,
the reason in a record, an operator's bound that holds against the controller's records,
and the admin API's writes (a recording producer stands in for Kafka)."""
from __future__ import annotations

import json

import pytest

from rlstream.common.config import ControlSettings, KafkaSettings, StalenessSettings
from rlstream.common.control.messages import (
    AUTO,
    CONTROLLER,
    encode_control,
    parse_control_text,
    parse_control_value,
)
from rlstream.common.control import signing
from rlstream.common.control.plane import ControlFollower, ControlPlaneWriter, ControlView, _RefusalLog
from rlstream.common.errors import ConfigError


def test_config_auto_starts_the_controller_at_its_start_bound():
    s = StalenessSettings.model_validate({"max_staleness": "auto", "auto": {"min": 1, "max": 6, "start": 3}})
    assert (s.max_staleness, s.max_staleness_auto) == (3, True)
    assert StalenessSettings.model_validate(s.model_dump()) == s  # a run's written config reads back
    assert StalenessSettings.model_validate({"max_staleness": 5}).max_staleness_auto is False
    with pytest.raises(ValueError, match="outside staleness.auto's limits"):
        StalenessSettings.model_validate({"max_staleness": 9, "max_staleness_auto": True})


def test_command_line_auto_and_the_new_key():
    assert parse_control_text("max_staleness", " Auto ") == AUTO
    assert parse_control_text("max_staleness_auto", "false") is False
    with pytest.raises(ConfigError):
        parse_control_value("max_staleness", "auto")  # only an operator's request may say auto
    with pytest.raises(ConfigError):
        parse_control_value("max_staleness_auto", 1)


def test_a_record_carries_its_reason():
    _, v = encode_control("max_staleness", 2, by=CONTROLLER, reason="tighten 4 -> 2: ess 0.41 < 0.6")
    assert json.loads(v)["reason"] == "tighten 4 -> 2: ess 0.41 < 0.6"
    assert "reason" not in json.loads(encode_control("max_staleness", 2, by="admin")[1])


def follower(auto: bool) -> ControlFollower:
    f = ControlFollower.__new__(ControlFollower)  # _apply alone: no broker
    f.view = ControlView(state=ControlSettings(max_staleness=4, max_staleness_auto=auto))
    f._key, f._applied_at, f._refusals = KEY, {}, _RefusalLog()
    return f


KEY = signing.signing_key("admin-token")


def apply(f, key, value, by, reason=None):
    k, v = encode_control(key, value, by=by, reason=reason)
    return f._apply("control", k, v, [(signing.HEADER, signing.signature(KEY, k, v))])


def test_followers_ignore_the_controller_while_an_operators_bound_holds():
    f = follower(auto=True)
    assert apply(f, "max_staleness", 2, CONTROLLER, "tighten") is not None and f.view.state.max_staleness == 2
    # the operator: auto off, then its bound; a controller record racing in after it is ignored
    apply(f, "max_staleness_auto", False, "admin")
    apply(f, "max_staleness", 6, "admin")
    assert apply(f, "max_staleness", 1, CONTROLLER, "tighten 2 -> 1") is None
    assert f.view.state.max_staleness == 6
    apply(f, "max_staleness_auto", True, "admin")  # `ctl set max_staleness auto`
    assert apply(f, "max_staleness", 3, CONTROLLER, "tighten 6 -> 3") is not None
    assert f.view.state.max_staleness == 3


class Recorder:
    def __init__(self):
        self.sent = []

    def send(self, topic, key, value, headers=None):
        self.sent.append((key.decode(), json.loads(value)))
        return self

    def get(self, timeout):
        return None


def writer() -> ControlPlaneWriter:
    w = ControlPlaneWriter.__new__(ControlPlaneWriter)
    w.kafka, w._p, w._key = KafkaSettings(), Recorder(), KEY
    return w


def test_an_operators_bound_takes_it_from_the_controller_first_and_auto_hands_it_back():
    w = writer()
    assert w.set_by_operator("max_staleness", 6, by="admin") == 6
    assert [(k, r["value"]) for k, r in w._p.sent] == [("max_staleness_auto", False), ("max_staleness", 6)]
    w._p.sent.clear()
    assert w.set_by_operator("max_staleness", AUTO, by="admin") == AUTO
    assert [(k, r["value"]) for k, r in w._p.sent] == [("max_staleness_auto", True)]
    w._p.sent.clear()
    with pytest.raises(ConfigError):
        w.set_by_operator("max_staleness", -1, by="admin")
    assert w._p.sent == []  # a bad value writes nothing, not even the hand-over
    assert w.set_by_operator("decay", 0.5, by="admin") == 0.5 and len(w._p.sent) == 1
