"""401, 413 and 429 as the official `openai` client sees them, from the router served
over real HTTP (uvicorn on 127.0.0.1) in front of a fake decode worker; and
`pdserve status` sending its key."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from cluster.cli import main
from cluster.config import ClusterConfig
from cluster.serve import router_for
from tests.http_server import free_port, serving
from tests.unit.test_router_http import FakeDecodeWorker

KEY = "sk-pdserve-test-0123456789abcdef"


@pytest.fixture(scope="module")
def served(llama_dir: Path) -> Iterator[tuple[str, str]]:
    fake = FakeDecodeWorker(step_s=0.01)
    config = ClusterConfig.from_dict({"model": str(llama_dir), "prefill": {"replicas": 0}, "router": {
        "api_keys": [KEY], "max_body_bytes": 16 * 1024, "key_requests_per_s": 0.5, "key_burst": 4}})
    try:
        with serving(router_for(config, {"decode-0": fake.address}), free_port()) as base:
            yield base, str(llama_dir)
    finally:
        fake.close()


def client(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=f"{base}/v1", max_retries=0, timeout=20)


@pytest.mark.timeout(60)
def test_401_413_and_429_through_the_openai_client(served, capsys, monkeypatch) -> None:
    base, model = served
    with pytest.raises(openai.AuthenticationError) as err:
        client(base, "sk-wrong").completions.create(model=model, prompt="Hello", max_tokens=2)
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    assert err.value.response.headers["www-authenticate"].startswith("Bearer")

    ok = client(base, KEY)  # 1 of the key's burst of 4
    out = ok.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert out.usage.completion_tokens == 3
    assert [m.id for m in ok.models.list()] == [model]  # not a generation request: not counted

    with pytest.raises(openai.APIStatusError) as err:  # 2 of 4
        ok.completions.create(model=model, prompt="x" * 20_000, max_tokens=2)
    assert err.value.status_code == 413 and "router.max_body_bytes" in err.value.message

    ok.completions.create(model=model, prompt="Hello", max_tokens=2)  # 3 of 4
    ok.completions.create(model=model, prompt="Hello", max_tokens=2)  # 4 of 4
    with pytest.raises(openai.RateLimitError) as err:
        ok.completions.create(model=model, prompt="Hello", max_tokens=2)
    assert err.value.status_code == 429 and 1 <= int(err.value.response.headers["retry-after"]) <= 2

    # pdserve status: the key from $PDSERVE_API_KEY or --api-key; a wrong one is said so.
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    assert main(["status", "--url", base]) == 1
    assert "needs an API key (401): set PDSERVE_API_KEY or pass --api-key" in capsys.readouterr().err
    assert main(["status", "--url", base, "--api-key", "sk-wrong"]) == 1
    assert "refused the API key" in capsys.readouterr().err
    monkeypatch.setenv("PDSERVE_API_KEY", KEY)
    assert main(["status", "--url", base]) == 0
    out = capsys.readouterr()
    assert out.out.startswith(f"model {model}") and KEY not in out.out + out.err


@pytest.mark.timeout(60)
def test_pdserve_status_with_a_config_sends_its_first_key(served, tmp_path: Path, capsys, monkeypatch) -> None:
    base, model = served
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    monkeypatch.setenv("PDSERVE_TEST_KEYS", f"{KEY},sk-other")
    config = tmp_path / "cluster.yaml"
    config.write_text(f"model: {model}\nrouter: {{port: {base.rsplit(':', 1)[1]}, api_keys: 'env:PDSERVE_TEST_KEYS'}}\n")
    assert main(["status", str(config)]) == 0
    assert capsys.readouterr().out.startswith(f"model {model}")
