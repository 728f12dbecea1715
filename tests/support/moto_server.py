"""An in-process moto S3 server for tests, as plain functions plus pytest fixtures.

Use the fixtures by importing them into a test module (pytest registers imported fixtures)::

    from support.moto_server import moto_endpoint, s3_bucket  # noqa: F401

- ``moto_endpoint`` (session scope): starts ``ThreadedMotoServer`` on ``127.0.0.1:0`` and yields
  ``http://127.0.0.1:<real port>``. Under ``pytest -n 2`` each xdist worker is its own process and
  starts its own server; a port of 0 means the two never collide.
- ``s3_bucket`` (function scope): a fresh, uniquely named bucket; emptied and removed afterwards.

Buckets are created with boto3, not ``s3fs.mkdir`` (which sends a ``LocationConstraint`` that
moto rejects for us-east-1). All clients use explicit dummy credentials, so no test depends on the
machine's AWS configuration.
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from moto.server import ThreadedMotoServer

__all__ = [
    "DUMMY_KEY",
    "DUMMY_SECRET",
    "REGION",
    "boto3_client",
    "create_bucket",
    "delete_bucket",
    "moto_endpoint",
    "s3_bucket",
    "s3_storage_options",
    "start_moto_server",
    "unique_bucket_name",
]

DUMMY_KEY = "dstl-test-key"
DUMMY_SECRET = "dstl-test-secret-DO-NOT-LOG"  # tests assert this never shows up in messages
REGION = "us-east-1"


def start_moto_server() -> tuple[ThreadedMotoServer, str]:
    """Start a moto server on a free local port; return it and its endpoint URL."""
    # werkzeug logs every request at INFO; that is noise in captured test output.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


@functools.cache
def boto3_client(endpoint: str) -> Any:
    """A boto3 S3 client for the moto server (test setup and inspection only; cached, since
    creating one costs ~0.1 s and clients are thread-safe)."""
    return boto3.client("s3", endpoint_url=endpoint, region_name=REGION,
                        aws_access_key_id=DUMMY_KEY, aws_secret_access_key=DUMMY_SECRET)


def create_bucket(endpoint: str, name: str) -> str:
    """Create bucket ``name`` on the server; return the name."""
    boto3_client(endpoint).create_bucket(Bucket=name)
    return name


def delete_bucket(endpoint: str, name: str) -> None:
    """Delete every object of bucket ``name``, then the bucket."""
    client = boto3_client(endpoint)
    paginator = client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=name):
        keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=name, Delete={"Objects": keys})
    client.delete_bucket(Bucket=name)


def s3_storage_options(endpoint: str) -> dict[str, Any]:
    """s3fs options for the moto server: dummy credentials and the endpoint."""
    return {
        "key": DUMMY_KEY,
        "secret": DUMMY_SECRET,
        "client_kwargs": {"endpoint_url": endpoint, "region_name": REGION},
    }


def unique_bucket_name(prefix: str = "dstl-test") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:20]}"


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """Endpoint URL of this worker's moto server (started on first use)."""
    server, endpoint = start_moto_server()
    try:
        yield endpoint
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(moto_endpoint: str) -> Iterator[str]:
    """A fresh bucket on the moto server; removed with its objects after the test."""
    name = create_bucket(moto_endpoint, unique_bucket_name())
    yield name
    delete_bucket(moto_endpoint, name)
