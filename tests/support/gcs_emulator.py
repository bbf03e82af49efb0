"""A GCS bucket on loopback for the gs:// tests: gcp-storage-emulator (in memory, a thread of the test process) and
the variables that point gcsfs (etils.epath), google-cloud-storage (TensorBoard) and tensorstore (orbax's arrays)
at it; a trainer child started with those variables writes there too."""

from __future__ import annotations

import contextlib
import json
import socket
import urllib.parse
import urllib.request
from collections.abc import Iterator

from gcp_storage_emulator.handlers import objects
from gcp_storage_emulator.server import create_server

BUCKET = "drgrpo-test"
_download = objects.download


def _download_with_generation(request, response, storage, *args, **kwargs):
    """The emulator's media download plus the x-goog-generation header GCS sends, which tensorstore reads (without
    it a re-read of an object it wrote fails as a malformed generation)."""
    _download(request, response, storage, *args, **kwargs)
    with contextlib.suppress(Exception):  # a missing object: the 404 as it was
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        response["x-goog-generation"] = obj["generation"]
        response["x-goog-metageneration"] = obj["metageneration"]


@contextlib.contextmanager
def gcs_emulator() -> Iterator[tuple[str, dict[str, str]]]:
    """(the emulator's URL, the environment variables that point the clients at it) while bucket BUCKET is served."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    objects.download = _download_with_generation  # objects.get (the JSON API's alt=media) calls it by name
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
    server.start()
    url = f"http://127.0.0.1:{port}"
    try:
        yield url, {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url,
                    "GOOGLE_AUTH_TOKEN_FOR_TESTING": "none"}
    finally:
        server.stop()
        objects.download = _download


def bucket_objects(url: str, prefix: str) -> dict[str, bytes]:
    """{name below prefix: content} of BUCKET, read over the emulator's JSON API (no client's cache)."""
    base = f"{url}/storage/v1/b/{BUCKET}/o"
    with urllib.request.urlopen(f"{base}?prefix={urllib.parse.quote(prefix)}") as answer:
        names = [item["name"] for item in json.load(answer).get("items", [])]
    found = {}
    for name in names:
        with urllib.request.urlopen(f"{base}/{urllib.parse.quote(name, safe='')}?alt=media") as answer:
            found[name[len(prefix):]] = answer.read()
    return found
