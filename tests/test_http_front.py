"""Where and how a tidal HTTP front listens, as vLLM's flags set it: TLS (and mutual TLS),
a Unix domain socket, the path prefix of a proxy (`--root-path`), browsers of other origins
(CORS), uvicorn's log level and access log. Served through the official client; settings
that cannot work are refused by name before anything binds."""

from __future__ import annotations

import shutil
import ssl
import subprocess

import httpx
import openai
import pytest

from server_fixtures import Server
from tidal.cli import FRONT_FLAGS, _strip_flags
from tidal.server.config import HttpConfig, ServerConfig

KEY = "front-key"
ORIGIN = "https://chat.example.com"
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 and its key (the client's certificate too)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a certificate with")
    where = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(where / "key.pem"), "-out", str(where / "cert.pem"),
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return where / "cert.pem", where / "key.pem"


def context(certs, with_cert: bool = True) -> ssl.SSLContext:
    """A client's TLS context trusting the server's certificate, showing its own."""
    ctx = ssl.create_default_context(cafile=str(certs[0]))
    if with_cert:
        ctx.load_cert_chain(str(certs[0]), str(certs[1]))
    return ctx


@pytest.fixture(scope="module")
def tls_server(certs):
    cert, key = map(str, certs)
    s = Server("--ssl-keyfile", key, "--ssl-certfile", cert, "--ssl-ca-certs", cert,
               "--ssl-cert-reqs", "2", "--root-path", "/llm", "--api-key", KEY,
               "--allowed-origins", ORIGIN, "--disable-uvicorn-access-log",
               scheme="https", verify=context(certs))
    yield s
    s.stop()


def test_tls_with_client_certificates_behind_a_path_prefix(tls_server, certs):
    answers = []
    for prefix in ("", "/llm"):  # a proxy that strips the prefix, and one that does not
        with httpx.Client(verify=context(certs)) as http:  # closed: no idle TLS session
            client = openai.OpenAI(base_url=f"{tls_server.url}{prefix}/v1", api_key=KEY,
                                   max_retries=0, http_client=http)
            out = client.chat.completions.create(model="smollm2-135m", messages=MESSAGES,
                                                 max_tokens=4, temperature=0)
        answers.append(out.choices[0].message.content)
    assert answers[0] == answers[1] and answers[0]
    with httpx.Client(verify=context(certs)) as http:
        for prefix in ("", "/llm"):  # the key is asked for on either path
            r = http.get(f"{tls_server.url}{prefix}/v1/models")
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            r = http.post(f"{tls_server.url}{prefix}/classify", json={"input": "x"})
            assert r.status_code == 401
        page = http.get(f"{tls_server.url}/docs", params={"api_key": KEY}).text
        assert "/llm/openapi.json?api_key=" in page  # the proxy's prefix in the page's links
    with pytest.raises(httpx.HTTPError):  # no client certificate: no TLS session
        httpx.get(tls_server.url + "/health", verify=context(certs, with_cert=False))
    with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port
        httpx.get(f"http://127.0.0.1:{tls_server.port}/health")
    assert "GET /v1/models" not in tls_server.output()  # no access log


def test_cors_answers_the_allowed_origins_preflight_before_the_key(tls_server, certs):
    with httpx.Client(verify=context(certs)) as http:
        url = tls_server.url + "/v1/chat/completions"
        ask = {"access-control-request-method": "POST",
               "access-control-request-headers": "authorization, content-type"}
        ok = http.options(url, headers={"origin": ORIGIN, **ask})
        assert ok.status_code == 200
        assert ok.headers["access-control-allow-origin"] == ORIGIN
        assert "authorization" in ok.headers["access-control-allow-headers"].lower()
        other = http.options(url, headers={"origin": "https://evil.example", **ask})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        refused = http.post(url, json={}, headers={"origin": ORIGIN})  # no key: 401, readable
        assert refused.status_code == 401
        assert refused.headers["access-control-allow-origin"] == ORIGIN
        models = http.get(tls_server.url + "/v1/models",
                          headers={"origin": ORIGIN, "authorization": f"Bearer {KEY}"})
        assert models.status_code == 200
        assert models.headers["access-control-allow-origin"] == ORIGIN


def test_a_unix_socket_serves_instead_of_a_port(tmp_path):
    path = str(tmp_path / "tidal.sock")
    server = Server("--uds", path, "--uvicorn-log-level", "warning",
                    transport=httpx.HTTPTransport(uds=path))
    try:
        server.url = "http://localhost"  # the socket, whatever the host
        client = openai.OpenAI(base_url="http://localhost/v1", api_key="none", max_retries=0,
                               http_client=httpx.Client(transport=httpx.HTTPTransport(uds=path)))
        out = client.completions.create(model="smollm2-135m", prompt="1, 2, 3,", max_tokens=3,
                                        temperature=0)
        assert out.usage.completion_tokens == 3
        with pytest.raises(httpx.ConnectError):  # nothing on the TCP port
            httpx.get(f"http://127.0.0.1:{server.port}/health")
    finally:
        log = server.stop()
    assert "Uvicorn running" not in log  # warning level: uvicorn's info lines are not logged


def test_settings_that_cannot_work_are_refused_by_name(tmp_path):
    cert = tmp_path / "cert.pem"
    cert.write_text("x")
    cases = [
        (dict(ssl_keyfile=str(cert)), "both --ssl-keyfile and --ssl-certfile"),
        (dict(ssl_keyfile=str(cert), ssl_certfile=str(tmp_path / "nope.pem")),
         "ssl_certfile .* is not a file"),
        (dict(ssl_ca_certs=str(cert)), "ssl_ca_certs needs TLS"),
        (dict(ssl_keyfile=str(cert), ssl_certfile=str(cert), ssl_cert_reqs=2),
         "ssl_cert_reqs needs --ssl-ca-certs"),
        (dict(ssl_cert_reqs=3), "ssl_cert_reqs must be 0, 1 or 2"),
        (dict(uds=str(tmp_path / "no" / "such" / "s.sock")), "its folder does not exist"),
        (dict(root_path="llm"), "root_path must look like /prefix"),
        (dict(root_path="/llm/"), "root_path must look like /prefix"),
        (dict(allowed_origins=("*",), allow_credentials=True), "name the origins"),
        (dict(uvicorn_log_level="loud"), "uvicorn_log_level must be one of"),
    ]
    for kwargs, why in cases:
        for config in (HttpConfig, ServerConfig):
            with pytest.raises(ValueError, match=why):
                config(**kwargs)


def test_pd_instances_leave_the_front_flags_to_the_router():
    argv = ["serve", "--pd", "1p1d", "--allowed-origins", "https://a", "https://b", "--model",
            "m", "--ssl-keyfile=k.pem", "--ssl-certfile", "c.pem", "--allow-credentials",
            "--max-n", "4", "--root-path", "/x", "--uds", "/tmp/s"]
    kept = _strip_flags(argv, ("--pd", *FRONT_FLAGS))
    assert kept == ["serve", "--model", "m", "--max-n", "4"]
