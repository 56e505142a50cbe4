"""Kafka SASL/TLS settings: one block, rendered for aiokafka, Faust and the Java clients."""

from __future__ import annotations

import ssl
import subprocess
from pathlib import Path

import faust
import pytest
from pydantic import ValidationError

from pipeline.settings import KafkaSecuritySettings, KafkaSettings

SECRET = 'S3cr3t "pw\\x'  # a quote and a backslash: JAAS needs them escaped


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("kafka-tls")
    cert = folder / "ca.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=ca",
            "-keyout",
            str(folder / "ca.key"),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert


def test_plaintext_is_the_default_and_adds_nothing() -> None:
    security = KafkaSettings().security
    assert security.protocol == "PLAINTEXT"
    assert security.aiokafka_options() == {}
    assert security.faust_credentials() is None
    assert security.java_properties() == {}


def test_sasl_ssl_scram_reaches_every_client(ca: Path, tmp_path: Path) -> None:
    (tmp_path / "kafka-pw").write_text(SECRET + "\n")
    security = KafkaSecuritySettings(
        protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512",
        username="edgefeed",
        password_file=tmp_path / "kafka-pw",
        ca_file=ca,
    )
    options = security.aiokafka_options()
    assert options["security_protocol"] == "SASL_SSL"
    assert options["sasl_mechanism"] == "SCRAM-SHA-512"
    assert options["sasl_plain_username"] == "edgefeed"
    assert options["sasl_plain_password"] == SECRET
    context = options["ssl_context"]
    assert isinstance(context, ssl.SSLContext) and context.check_hostname
    assert context.verify_mode == ssl.CERT_REQUIRED

    credentials = security.faust_credentials()
    assert isinstance(credentials, faust.SASLCredentials)
    assert credentials.protocol.value == "SASL_SSL"
    assert credentials.mechanism.value == "SCRAM-SHA-512"
    assert SECRET not in repr(credentials) and SECRET not in repr(security)

    props = security.java_properties(password_reference="${dir:/run/secrets:kafka}")
    for prefix in ("", "producer.", "consumer.", "admin."):
        assert props[f"{prefix}security.protocol"] == "SASL_SSL"
        assert props[f"{prefix}ssl.truststore.location"] == str(ca)
        assert props[f"{prefix}sasl.jaas.config"] == (
            "org.apache.kafka.common.security.scram.ScramLoginModule required "
            'username="edgefeed" password="${dir:/run/secrets:kafka}";'
        )
    escaped = security.java_properties()["sasl.jaas.config"]
    assert 'password="S3cr3t \\"pw\\\\x";' in escaped


def test_tls_only_uses_ssl_credentials(ca: Path) -> None:
    security = KafkaSecuritySettings(protocol="SSL", ca_file=ca)
    assert isinstance(security.faust_credentials(), faust.SSLCredentials)
    assert "sasl_mechanism" not in security.aiokafka_options()
    assert "sasl.jaas.config" not in security.java_properties()


def test_a_java_key_store_is_named_with_its_password_as_a_reference(ca: Path) -> None:
    """Kafka Connect presents the PKCS12 key store; its password stays in its file."""
    security = KafkaSecuritySettings(
        protocol="SSL",
        ca_file=ca,
        cert_file=Path("/run/secrets/kafka/user.crt"),
        key_file=Path("/run/secrets/kafka/user.key"),
        keystore_file=Path("/run/secrets/kafka/user.p12"),
        keystore_password_file=Path("/run/secrets/kafka/user.password"),
    )
    props = security.java_properties()
    for prefix in ("", "producer.", "consumer.", "admin."):
        assert props[f"{prefix}security.protocol"] == "SSL"
        assert props[f"{prefix}ssl.keystore.type"] == "PKCS12"
        assert props[f"{prefix}ssl.keystore.location"] == "/run/secrets/kafka/user.p12"
        assert props[f"{prefix}ssl.keystore.password"] == "${dir:/run/secrets/kafka:user.password}"
        assert props[f"{prefix}ssl.truststore.location"] == str(ca)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"protocol": "SSL", "keystore_file": "/k.p12"}, "both keystore_file and"),
        (
            {"protocol": "PLAINTEXT", "keystore_file": "/k.p12", "keystore_password_file": "/pw"},
            "TLS files",
        ),
        ({"protocol": "SASL_SSL", "username": "u", "password": "p"}, "needs sasl_mechanism"),
        ({"protocol": "SASL_SSL", "sasl_mechanism": "PLAIN", "username": "u"}, "exactly one"),
        ({"protocol": "PLAINTEXT", "username": "u", "password": "p"}, "use SASL_SSL"),
        (
            {
                "protocol": "SASL_PLAINTEXT",
                "sasl_mechanism": "PLAIN",
                "username": "u",
                "password": "p",
                "ca_file": "/ca.pem",
            },
            "TLS files",
        ),
        ({"protocol": "SSL", "cert_file": "/c.pem"}, "both cert_file and key_file"),
        ({"protocol": "SASL"}, "protocol"),
    ],
)
def test_inconsistent_security_is_refused(fields: dict[str, str], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        KafkaSecuritySettings.model_validate(fields)
