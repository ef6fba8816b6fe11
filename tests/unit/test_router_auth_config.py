"""router.api_keys and the new router bounds in the cluster config: keys from a list, a
file or an environment variable, resolved as the config loads; every mistake a
ConfigError naming its field (and never the key); no key in any repr; a non-loopback
host without keys refused unless router.allow_unauthenticated says so."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest

from cluster.config import ClusterConfig, ConfigError, RouterConfig, load_cluster_config
from cluster.worker_configs import without_router_secrets

BASE = {"model": "m", "prefill": {"replicas": 1}, "decode": {"replicas": 1}}
SECRET = "sk-secret-0123456789"


def router(**fields: object) -> RouterConfig:
    return ClusterConfig.from_dict({**BASE, "router": fields}).router


def test_keys_from_a_list_a_file_or_an_environment_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert router().api_keys is None
    assert router(api_keys=["sk-a", "sk-b", "sk-a"]).api_keys == ("sk-a", "sk-b")
    monkeypatch.setenv("MY_KEYS", " sk-a , sk-b,,")
    assert router(api_keys="env:MY_KEYS").api_keys == ("sk-a", "sk-b")
    keys = tmp_path / "keys"
    keys.write_text("# the team's keys\n\nsk-a\n  sk-b  \n# sk-old\n")
    assert router(api_keys=f"file:{keys}").api_keys == ("sk-a", "sk-b")


@pytest.mark.parametrize("value,message", [
    ("env:NO_SUCH_VARIABLE_PDSERVE", "environment variable NO_SUCH_VARIABLE_PDSERVE is not set"),
    ("env:EMPTY_KEYS", "environment variable EMPTY_KEYS holds no key"),
    ("env:", "'env:' must name an environment variable"),
    ("file:/no/such/pdserve/keys", "cannot read the key file '/no/such/pdserve/keys'"),
    ("file:{comments}", "holds no key"),
    ([], "the list holds no key"),
    ([""], "key 0 of the list must be a non-empty string"),
    (["sk-a", 5], "key 1 of the list must be a non-empty string, got a int"),
    (["sk a"], "key 0 of the list has a space, a comma or a character that is not printable ASCII"),
    (["sk-é"], "not printable ASCII"),
    ({"key": SECRET}, "must be a list of keys, 'env:NAME' (comma-separated keys) or 'file:PATH'"),
    (SECRET, "(a bare string is not taken as a key); got a str"),
    (3, "got 3"),
])
def test_a_bad_key_source_names_the_field_and_never_the_key(value: object, message: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMPTY_KEYS", " , ")
    monkeypatch.delenv("NO_SUCH_VARIABLE_PDSERVE", raising=False)
    comments = tmp_path / "keys"
    comments.write_text("# nothing but comments\n\n")
    if isinstance(value, str):
        value = value.format(comments=comments)
    with pytest.raises(ConfigError) as err:
        router(api_keys=value)
    assert str(err.value).startswith("router.api_keys: ") and message in str(err.value), str(err.value)
    assert SECRET not in str(err.value)


def test_keys_are_in_no_repr(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_TEST_KEYS", SECRET)
    config = ClusterConfig.from_dict({**BASE, "router": {"api_keys": "env:PDSERVE_TEST_KEYS"}})
    assert config.router.api_keys == (SECRET,)
    assert SECRET not in repr(config) and SECRET not in repr(config.router) and SECRET not in str(config)


def test_what_a_worker_is_handed_holds_no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Ray launcher hands each worker actor the cluster config, and Ray keeps an
    actor's arguments: the keys are not in them."""
    monkeypatch.setenv("PDSERVE_TEST_KEYS", SECRET)
    config = ClusterConfig.from_dict({**BASE, "router": {"api_keys": "env:PDSERVE_TEST_KEYS"}})
    assert SECRET.encode() in pickle.dumps(config)  # what the router's own config holds
    handed = without_router_secrets(config)
    assert SECRET.encode() not in pickle.dumps(handed) and handed.router.api_keys is None
    assert dataclasses.replace(handed, router=config.router) == config  # and nothing else changed


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.10", "::", "my-host.example"])
def test_a_reachable_host_without_keys_needs_allow_unauthenticated(host: str) -> None:
    with pytest.raises(ConfigError) as err:
        router(host=host)
    message = str(err.value)
    assert message.startswith("router.allow_unauthenticated: must be true to serve router.host"), message
    assert repr(host) in message and "router.api_keys" in message
    assert router(host=host, allow_unauthenticated=True).api_keys is None
    assert router(host=host, api_keys=["sk-a"]).api_keys == ("sk-a",)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1"])
def test_loopback_needs_no_keys(host: str) -> None:
    assert router(host=host).host == host


def test_the_yaml_file_refuses_0_0_0_0_without_keys(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text("model: m\nrouter: {host: 0.0.0.0}\n")
    with pytest.raises(ConfigError, match=r"^router\.allow_unauthenticated: .*'0\.0\.0\.0'"):
        load_cluster_config(path)
    path.write_text("model: m\nrouter: {host: 0.0.0.0, allow_unauthenticated: true}\n")
    assert load_cluster_config(path).router.allow_unauthenticated is True


@pytest.mark.parametrize("fields,message", [
    ({"max_body_bytes": 0}, "router.max_body_bytes: must be >= 1, got 0"),
    ({"max_messages": 0}, "router.max_messages: must be >= 1, got 0"),
    ({"max_stop": -1}, "router.max_stop: must be >= 1, got -1"),
    ({"max_string_chars": 0}, "router.max_string_chars: must be >= 1, got 0"),
    ({"max_tokenize_queue": 0}, "router.max_tokenize_queue: must be >= 1, got 0"),
    ({"body_timeout_s": 0}, "router.body_timeout_s: must be > 0, got 0"),
    ({"body_timeout_s": "30s"}, "router.body_timeout_s: must be a number, got '30s'"),
    ({"body_timeout_s": float("inf")}, "router.body_timeout_s: must be finite, got inf"),
    ({"key_requests_per_s": float("inf")}, "router.key_requests_per_s: must be finite, got inf"),
    ({"worker_timeout_s": float("nan")}, "router.worker_timeout_s: must be finite, got nan"),
    ({"key_requests_per_s": 0}, "router.key_requests_per_s: must be > 0, got 0"),
    ({"key_burst": 0, "key_requests_per_s": 1}, "router.key_burst: must be >= 1, got 0"),
    ({"key_burst": 5}, "router.key_burst: needs key_requests_per_s"),
    ({"key_tokens_in_flight": 0}, "router.key_tokens_in_flight: must be >= 1, got 0"),
    ({"metrics_need_key": "no"}, "router.metrics_need_key: must be true or false, got 'no'"),
    ({"allow_unauthenticated": 1}, "router.allow_unauthenticated: must be true or false, got 1"),
    ({"access_log": "off"}, "router.access_log: must be true or false, got 'off'"),
])
def test_bounds_and_limits_are_validated(fields: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        router(**fields)
    assert str(err.value).startswith(message), str(err.value)


def test_limits_are_off_by_default_and_bounds_on() -> None:
    config = router()
    assert config.access_log is True and router(access_log=False).access_log is False
    assert (config.key_requests_per_s, config.key_burst, config.key_tokens_in_flight) == (None, None, None)
    assert config.max_body_bytes == 8 * 1024 * 1024 and config.body_timeout_s == 30.0
    assert router(key_requests_per_s=2, key_burst=4).key_requests_per_s == 2.0
