"""`rlstream ctl`: the command-line client of a service's admin API.

    rlstream ctl get                       --url http://127.0.0.1:8081
    rlstream ctl set max_staleness 4       --url ... --token $RLSTREAM_ADMIN_TOKEN
    rlstream ctl set max_staleness auto    (the consumer's controller sets it again)
    rlstream ctl set mode reweight
    rlstream ctl set paused true

Values are validated locally first (a bad value never reaches the service),
then by the service, which writes the change to `rlstream.control`.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request

from rlstream.common.control.messages import parse_control_text
from rlstream.common.errors import AdminApiError, ConfigError


def _request(url: str, token: str | None, body: dict | None = None) -> dict:
    req = urllib.request.Request(url.rstrip("/") + "/admin/control",
                                 data=None if body is None else json.dumps(body).encode(),
                                 method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")
        hint = " (set --token or RLSTREAM_ADMIN_TOKEN)" if e.code == 401 else ""
        raise AdminApiError(f"{url} answered {e.code}: {detail}{hint}", status=e.code) from None
    except (urllib.error.URLError, OSError) as e:
        raise AdminApiError(f"cannot reach {url}: {e}; is the service running? (--url)") from None


def run_ctl(action: str, key: str | None, value: str | None, url: str, token: str | None) -> int:
    if action == "get":
        state = _request(url, token)
        print(json.dumps(state if key is None else {key: state.get(key)}, indent=1))
        return 0
    if key is None or value is None:
        raise ConfigError("usage: rlstream ctl set KEY VALUE")
    typed = parse_control_text(key, value)
    print(json.dumps(_request(url, token, {"key": key, "value": typed})))
    return 0
