"""What `bigmoe run --yes` prints never shows the API key, and exposing the API without one warns."""

from __future__ import annotations

import subprocess

import pytest
from bigmoe.run import curl_line
from bigmoe.serve.preflight import exposure_warning


def test_the_curl_line_reads_the_key_from_the_environment():
    line = curl_line("http://127.0.0.1:8000", "tiny-moe", "sk-very-secret")
    assert "sk-very-secret" not in line and '"Authorization: Bearer $BIGMOE_API_KEY"' in line
    assert "Authorization" not in curl_line("http://127.0.0.1:8000", "tiny-moe", None)


def test_the_curl_line_expands_the_key_in_a_shell():
    line = curl_line("http://127.0.0.1:1", "tiny-moe", "set")
    echoed = subprocess.run(
        ["bash", "-c", "echo " + line.replace("curl -s ", "", 1)],
        capture_output=True,
        text=True,
        env={"BIGMOE_API_KEY": "sk-from-env", "PATH": "/usr/bin:/bin"},
    )
    assert "Authorization: Bearer sk-from-env" in echoed.stdout


@pytest.mark.parametrize(
    "host,key,warns",
    [
        ("127.0.0.1", None, False),
        ("localhost", None, False),
        ("::1", None, False),
        ("127.0.0.2", None, False),
        ("0.0.0.0", None, True),
        ("192.168.1.5", None, True),
        ("myhost.lan", None, True),
        ("::", None, True),
        ("0.0.0.0", "sk-x", False),
    ],
)
def test_serving_beyond_loopback_without_a_key_warns(host, key, warns):
    warning = exposure_warning(host, key)
    assert (warning is not None) == warns
    if warns:
        assert f"--host {host}" in warning and "--api-key" in warning and "\n" not in warning
